"""The layers in pyproject.toml's import-linter contracts hold, and the check can fail.

`lint-imports` runs as `make lint` runs it, on the repository; then on a copy of the package
with one forbidden import added per contract, where it must fail and name that import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # The package is found through `root` first (PYTHONPATH, cwd), before the editable
    # install of the repository.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_layer_contracts_hold() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("core/windows.py", "import httpx", "specd.core.windows -> httpx"),
        ("core/forecast.py", "import subprocess", "specd.core.forecast -> subprocess"),
        ("core/history.py", "from specd.io import state", "specd.core.history -> specd.io.state"),
        ("twin/engine.py", "from specd.core import windows", "specd.twin.engine -> specd.core"),
        ("io/metrics.py", "import specd.daemon", "specd.io.metrics -> specd.daemon"),
        ("daemon.py", "import specd.commands.status", "specd.daemon -> specd.commands.status"),
    ],
)
def test_a_forbidden_import_breaks_the_contracts(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    shutil.copytree(
        REPO / "specd", tmp_path / "specd", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "specd" / module
    text = target.read_text()
    # After the __future__ import, where a plain import is legal.
    anchor = "from __future__ import annotations\n"
    assert anchor in text, module
    target.write_text(text.replace(anchor, f"{anchor}{line}  # noqa\n", 1))
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout
    assert broken in done.stdout, done.stdout
