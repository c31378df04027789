"""Small pure checks and renderings shared by io, commands and install (one of each).

No I/O: a unit name, a URL and a duration are checked or written here the same way for the
config, the applier, the SGLang client, the installer and every message.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from datetime import datetime, timezone

# systemd's unit-name characters (systemd.unit(5)), at most 255 of them; a service, since
# specd restarts it; not starting with "-" (systemctl would read an option); a template
# needs its instance ("sglang@.service" cannot be restarted).
_SERVICE_NAME = re.compile(r"[A-Za-z0-9:_.\\][A-Za-z0-9:_.\\-]*(@[A-Za-z0-9:_.\\-]+)?\.service")
MAX_UNIT_NAME_CHARS = 255


def is_service_name(name: str) -> bool:
    """True for a systemd service name such as ``sglang.service`` or ``sglang@1.service``."""
    return len(name) <= MAX_UNIT_NAME_CHARS and _SERVICE_NAME.fullmatch(name) is not None


def check_service_name(name: str) -> str:
    """``name`` itself, or ValueError: "'x' is not a systemd service name such as ..."."""
    if not is_service_name(name):
        raise ValueError(f"{name!r} is not a systemd service name such as sglang.service")
    return name


def check_http_url(value: str) -> str:
    """An http(s) URL with a host (and a valid port, if any), without a trailing slash.

    ValueError with a one-line reason naming the value otherwise.
    """
    example = f"{value!r} is not an http(s) URL such as http://127.0.0.1:30000"
    if not isinstance(value, str) or any(c.isspace() for c in value):
        raise ValueError(example)
    try:
        parsed = urllib.parse.urlsplit(value)
    except ValueError:
        raise ValueError(example) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(example)
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    return value.rstrip("/")


def _cut(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most] + "…"


def check_root_url(value: str, *, uses: str = "it reads /metrics and /server_info there") -> str:
    """``check_http_url``, and the server's root only: no path, query or fragment.

    specd reads /metrics, /server_info and /health_generate under the URL it is given, so
    ``http://127.0.0.1:30000/v1`` (the OpenAI API's URL, as OpenAI clients are given it)
    would read /v1/metrics and fail as if metrics were off. ValueError with a one-line
    reason naming the root URL to give instead; ``uses`` says what specd does with it.
    """
    url = check_http_url(value)
    parts = urllib.parse.urlsplit(url)
    extra = parts.path.rstrip("/")
    extra += f"?{parts.query}" if parts.query else ""
    extra += f"#{parts.fragment}" if parts.fragment else ""
    if extra:
        root = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        raise ValueError(
            f"{_cut(value)!r} is not the server's root URL: specd wants {root} "
            f"({uses}: drop {_cut(extra, 40)})"
        )
    return url


def duration_text(seconds: float) -> str:
    """``42 s``, ``7.5 min``, ``3.2 h``: how specd writes a span of time in messages."""
    if not math.isfinite(seconds):
        return "∞" if seconds > 0 else "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def iso_time(at: datetime) -> str:
    """An instant as specd writes it for the operator: ISO 8601 to the second with its
    offset (``2026-12-07T03:00:00+01:00``), the same text in every message, status line
    and JSON field, on whichever clock ``at`` is (a window's own, or UTC)."""
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError("iso_time needs a timezone-aware datetime")
    return at.replace(microsecond=0).isoformat()


def utc_time(t: float) -> str:
    """A Unix time as `iso_time` writes it in UTC: when something happened (a change, a
    going back, an exploration's start), as `specd status` writes such times."""
    return iso_time(datetime.fromtimestamp(t, tz=timezone.utc))


# Some Windows editors (and spreadsheets exporting CSV) start a text file with it; TOML and
# our CSV headers do not take it, and the parsers' own messages do not say what is there.
BOM_PROBLEM = "starts with a UTF-8 byte order mark (BOM); save the file as UTF-8 without BOM"


# C0 and C1 controls, DEL: in text an operator wrote they would move the cursor, recolour or
# clear the terminal of whoever reads it later. And the Unicode line and paragraph
# separators and bidirectional controls, which break a line or turn the text after them
# around where it is shown (a reason that reads "…4 steps" and means "…spets 4").
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with its control characters (a terminal's escapes, newlines, Unicode's line
    separators and bidirectional controls) written as ``\\x1b``- or ``\\u202e``-style
    escapes, so printing it shows it and does nothing else."""
    return _CONTROL.sub(lambda m: _escaped(m.group(0)), text)


def one_line(text: object, limit: int) -> str:
    """``text`` on one line (its whitespace runs one space), cut to ``limit`` characters
    with "…": a log field, an sd_notify STATUS= line, a message a line of output shows."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def ascii_count(text: str, most_digits: int) -> int | None:
    """``text`` as a count when it is ASCII digits, at most ``most_digits`` of them, else
    None: str.isdigit() also takes "²" and "٣", and int() refuses thousands of digits (or
    reads "٣" as 3) in what another program wrote."""
    if text.isascii() and text.isdigit() and len(text) <= most_digits:
        return int(text)
    return None


# SGLang's options whose value is a secret: its own launch_command (/server_info) carries
# them as given.
SECRET_OPTIONS = ("--api-key", "--admin-api-key")


def redact_options(words: list[str]) -> list[str]:
    """``words`` of a command line with the value of each secret option as ``***`` (both
    ``--api-key KEY`` and ``--api-key=KEY``)."""
    out: list[str] = []
    hide = False
    for word in words:
        if hide:
            out.append("***")
            hide = False
            continue
        name, eq, _ = word.partition("=")
        if name in SECRET_OPTIONS:
            if eq:
                out.append(f"{name}=***")
            else:
                out.append(word)
                hide = True
            continue
        out.append(word)
    return out


def redact_command(command: str) -> str:
    """A command line as one string, each secret option's value as ``***``."""
    if not any(option in command for option in SECRET_OPTIONS):
        return command
    return " ".join(redact_options(command.split(" ")))
