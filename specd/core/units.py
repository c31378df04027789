"""Spans of time in seconds, the base unit of every setting, metric and timestamp here."""

MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86400.0
WEEK_S = 7 * DAY_S
