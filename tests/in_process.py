"""`specd ARGS` run in the test's own interpreter, through the entry point a `specd` process
runs (specd.cli.main), with its output, exit code and environment as a process would have
them. Where the process boundary is not what a test is about, this spares it an interpreter
start and the command's imports (~0.3 s of CPU each); the tests about the boundary (exit on
a closed pipe, signals, a second daemon, the shell's view of argparse) start real ones."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Mapping
from unittest import mock

from specd import cli


def specd_main(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``args`` as `specd` gets them; ``env``: the whole environment to run with (None: this
    one). Exit codes as the process would exit: argparse's SystemExit included, and a
    message in SystemExit printed to stderr with code 1, as Python does."""
    out, err = io.StringIO(), io.StringIO()
    environment = (
        mock.patch.dict(os.environ, env, clear=True)
        if env is not None
        else contextlib.nullcontext()
    )
    with environment, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int = cli.main(list(args))
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=err)
                code = 1
    return subprocess.CompletedProcess(["specd", *args], code, out.getvalue(), err.getvalue())
