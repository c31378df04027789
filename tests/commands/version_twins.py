"""Twins as SGLang versions (factories.version_twin), started on first use and shared by a
test module (the `version_twins` fixture, tests/commands/conftest.py): status and doctor
only read a twin (/server_info, /metrics), so one per (version, flags) serves them all."""

from __future__ import annotations

import contextlib

from factories import version_twin

from specd.twin.process import TwinProcess


class VersionTwins:
    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.started: dict[tuple[str, ...], TwinProcess] = {}

    def __call__(self, version: str, *extra: str) -> TwinProcess:
        """The twin as SGLang ``version`` with ``extra`` flags, healthy."""
        key = (version, *extra)
        if key not in self.started:
            twin = self.stack.enter_context(version_twin(version, *extra))
            twin.wait_healthy(20)
            self.started[key] = twin
        return self.started[key]
