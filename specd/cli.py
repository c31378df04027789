"""The `specd` command line: one subcommand per module.

Each subcommand lives in its own module exposing ``configure(parser)`` and
``run(args) -> int``. Only the chosen module is imported, so `specd status` on a
busy GPU box does not pay for aiohttp, rich or the twin — and a lean install (no
``tools`` extra) runs every command but the tools, which say what to install.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from specd import __version__

# name -> (module, one-line help). Order is the order shown in `specd --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "twin": ("specd.twin.cli", "run the SGLang twin: SGLang's HTTP API and metrics, simulated"),
    "check-config": (
        "specd.commands.check_config",
        "validate a config file and print the effective values",
    ),
    "override": ("specd.commands.override", "pin, freeze, clear or show the on-call override"),
    "load": (
        "specd.commands.load",
        "closed-loop streaming load against an OpenAI-compatible server",
    ),
    "run": ("specd.commands.run", "run the daemon (what specd.service starts)"),
    "status": (
        "specd.commands.status",
        "what specd is doing: steps, mode, last decision, next window",
    ),
    "recommend": ("specd.commands.recommend", "what specd would decide now against a live server"),
    "unfreeze": ("specd.commands.unfreeze", "clear the freeze that follows a failed restart"),
    "demo": (
        "specd.commands.demo",
        "specd tuning the embedded SGLang twin through a compressed day",
    ),
    "observe": (
        "specd.commands.observe",
        "scrape SGLang's /metrics and /server_info once and print it",
    ),
    "sweep": (
        "specd.commands.sweep",
        "measure tok/s per step count and concurrency (restarts SGLang)",
    ),
    "install": (
        "specd.install.command",
        "wire an existing SGLang unit to specd (drop-in, user, polkit)",
    ),
    "uninstall": ("specd.install.command", "remove exactly what `specd install` added"),
    "doctor": (
        "specd.commands.doctor",
        "check every part of the setup: ✓/✗ with one line of advice",
    ),
    "replay": (
        "specd.commands.replay",
        "replay a traffic trace through specd's decisions vs an oracle",
    ),
}


# The packages of the `tools` extra (pyproject.toml), and the commands that need them. They
# are checked before the command starts: several import them only when they use them (the
# twin its server, the demo a twin in a child process, sweep its chart hours into a run).
TOOLS_EXTRA_PACKAGES = ("aiohttp", "rich", "matplotlib")
NEEDS_TOOLS_EXTRA: dict[str, tuple[str, ...]] = {
    "twin": ("aiohttp",),
    "demo": ("aiohttp", "rich"),
    "load": ("rich",),
    "sweep": ("rich", "matplotlib"),
}


def _missing_tools_package(name: str) -> str | None:
    for package in NEEDS_TOOLS_EXTRA.get(name, ()):
        try:
            if importlib.util.find_spec(package) is None:
                return package
        except (ImportError, ValueError):
            return package
    return None


def _needs_tools(name: str) -> int:
    print(
        f"specd {name} needs the 'tools' extra: from the checkout, "
        "pip install -c requirements/constraints.txt '.[tools]'",
        file=sys.stderr,
    )
    return 2


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="specd",
        description="Keeps an SGLang server's speculative decoding tuned to its traffic.",
        epilog="commands:\n" + "\n".join(lines) + "\n\n`specd COMMAND --help` for details.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specd {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND")
    return parser


# What a shell reports for a command a closed pipe killed (as 130 for ^C).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
# sysexits' EX_IOERR: the command's output could not be written (a full disk behind
# `> file`). Not 1, which override and unfreeze say when their file was not written.
EXIT_OUTPUT_FAILED = 74


def _tolerant_streams() -> None:
    """stdout and stderr that write what their encoding cannot hold as escapes: specd's
    messages carry →, ±, × and ✓, and a terminal or pipe in latin-1 or ASCII
    (PYTHONIOENCODING, a C locale without UTF-8 mode) made every command end in a
    UnicodeEncodeError, some after their file was written. A closed one is devnull."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    # Closed (`specd status >&-`): Python leaves None there and every print of a command
    # raised; what it says goes nowhere, as with >/dev/null, and it does its work.
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    elif isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout = _GuardedStdout(sys.stdout)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115


def main(argv: Sequence[str] | None = None) -> int:
    _tolerant_streams()
    try:
        try:
            return _main(argv)
        finally:
            # Written out here, not at exit, so that a reader gone is caught below (also
            # after --help's SystemExit).
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader left early (`specd status | head -1`): Python's "Note on SIGPIPE".
        # stdout goes to devnull so that the flush at exit does not fail again.
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except OutputFailed as failed:
        # `specd override freeze ... > /var/log/full/x`: the freeze is written, then its
        # confirmation is not; a traceback and exit 1 said "not written".
        _stdout_to_devnull()
        exc = failed.error
        with contextlib.suppress(OSError):
            print(
                f"specd: cannot write the output ({exc.strerror or exc}); what the command "
                "did up to there is done: `specd status` shows it",
                file=sys.stderr,
            )
        return EXIT_OUTPUT_FAILED


class OutputFailed(Exception):
    """stdout refused a write (its disk full or failing), not the pipe's reader gone: not
    an OSError, so no command's handling of its own files' errors takes it for theirs."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _GuardedStdout:
    """sys.stdout, whose write errors other than a closed pipe are `OutputFailed`."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args:
        # No command: the usage on stderr and exit 2, as for any wrong command line
        # (`--help` asked for is exit 0).
        top.print_help(sys.stderr)
        return 2
    if args[0].startswith("-"):
        top.parse_args(args)
        return 2
    name = args[0]
    if name not in COMMANDS:
        top.parse_args(args[:1])  # prints "invalid choice" and exits 2
        return 2
    module_name, help_ = COMMANDS[name]
    if _missing_tools_package(name) is not None:
        return _needs_tools(name)
    # httpx imports its own command-line client (click, pygments, rich: ~30 ms of every
    # command that speaks HTTP) whenever those are installed; no specd command runs it, and
    # httpx stands in a stub that says what to install when they are absent.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in TOOLS_EXTRA_PACKAGES:
            return _needs_tools(name)
        raise
    parser = argparse.ArgumentParser(prog=f"specd {name}", description=help_)
    module.configure(parser)
    ns = parser.parse_args(args[1:])
    try:
        return int(module.run(ns))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
