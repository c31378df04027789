"""The pure core: observation and decision types, acceptance, history, forecast, windows,
performance tables, the policies, decide and step. No clock, no file, no network."""
