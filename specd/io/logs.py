"""structlog setup: one JSON object per line (or console text for humans).

Under systemd (``JOURNAL_STREAM`` set) each line is prefixed with its syslog priority,
``<3>`` … ``<7>``, which journald strips and records as the entry's PRIORITY, so
``journalctl -p warning -u specd`` works without a journald library.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import MutableMapping
from types import ModuleType
from typing import Any, TextIO

_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}


def _journald_priority(
    _logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    event_dict["_priority"] = _PRIORITY.get(method_name, 6)
    return event_dict


class _PriorityPrefixRenderer:
    def __init__(self, inner: Any, prefix: bool) -> None:
        self.inner = inner
        self.prefix = prefix

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        priority = event_dict.pop("_priority", 6)
        text = self.inner(logger, name, event_dict)
        return f"<{priority}>{text}" if self.prefix else str(text)


@functools.cache
def _structlog() -> ModuleType:
    """structlog, imported on first use: the commands that log nothing (status, override,
    check-config, ...) skip it. structlog imports rich whenever it is installed (the tools
    extra), for pretty tracebacks, and rich was ~40 ms of every `specd run`'s start; specd
    never renders through it (``format_exc_info`` turns an exception into plain text before
    either renderer sees it), so structlog is imported as on an install without rich, unless
    rich is loaded already (the demo): then it sees it as before."""
    hidden = "rich" not in sys.modules and "structlog" not in sys.modules
    if hidden:
        sys.modules["rich"] = None  # type: ignore[assignment]  # import rich: ImportError
    try:
        import structlog  # noqa: PLC0415  (see above)
    finally:
        if hidden and sys.modules.get("rich", 0) is None:
            del sys.modules["rich"]
    return structlog


def configure(fmt: str = "json", stream: TextIO | None = None, level: str = "info") -> None:
    structlog = _structlog()
    under_journald = bool(os.environ.get("JOURNAL_STREAM"))
    inner: Any
    if fmt == "console":
        inner = structlog.dev.ConsoleRenderer(colors=False)
    else:
        inner = structlog.processors.JSONRenderer(sort_keys=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _journald_priority,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _PriorityPrefixRenderer(inner, prefix=under_journald and fmt == "json"),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stdout),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> Any:
    return _structlog().get_logger("specd").bind(**bound)
