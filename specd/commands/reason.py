"""``--reason TEXT``: the operator's words that the next on-call reads (status, logs, the
dashboard). One check for every command that takes one, so what `override` refuses
`unfreeze` refuses too."""

from __future__ import annotations

import argparse
import getpass
import os
from collections.abc import Callable

from specd.commands.args import quoted
from specd.core.text import printable

# A sentence or a ticket link, not a document: the files that carry it are read with a
# 64 KiB cap, and a longer one would make the whole file unreadable.
MAX_REASON_CHARS = 2000


def check_utf8(text: str) -> None:
    """ArgumentTypeError unless ``text`` is UTF-8 text: a byte a terminal sent in another
    encoding (Latin-1's "é") reaches Python as a lone surrogate, which no file specd writes
    and no request body can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "backslashreplace").decode()
        raise argparse.ArgumentTypeError(
            f"{quoted(printable(shown))} is not UTF-8 text (the terminal sent it in another "
            "encoding); write it in UTF-8"
        ) from None


def reason_type(missing: str) -> Callable[[str], str]:
    """The argparse type of a ``--reason``; ``missing`` is what an empty one is told."""

    def reason(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(missing)
        check_utf8(text)
        if printable(text) != text:
            # They would act on the terminal of whoever reads the reason.
            raise argparse.ArgumentTypeError(
                f"{quoted(printable(text))} has control characters (a newline, a terminal "
                "escape, a Unicode line separator or bidirectional control)"
            )
        if len(text) > MAX_REASON_CHARS:
            raise argparse.ArgumentTypeError(
                f"{len(text)} characters; at most {MAX_REASON_CHARS} (link a ticket for more)"
            )
        return text.strip()

    reason.__name__ = "reason"  # what argparse calls the type in its messages
    return reason


def operator() -> str:
    """Who runs the command, as the next on-call should read it: the login name, and under
    sudo the one who ran sudo (``alice (sudo)``), not ``root``."""
    user = getpass.getuser()
    sudo = os.environ.get("SUDO_USER", "")
    if user == "root" and sudo and sudo != "root":
        return f"{printable(sudo[:64])} (sudo)"
    return printable(user)
