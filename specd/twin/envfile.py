"""systemd's ``EnvironmentFile=`` as the twin's stand-ins read it: the standard library only,
so the stand-in ``systemctl`` (specd/twin/standin.py), a process started for every command,
does not import specd's config and HTTP layers to read one file."""

from __future__ import annotations

from pathlib import Path


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, blanks skipped)."""
    values: dict[str, str] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return values  # EnvironmentFile=- : a missing file is fine
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        values[key.strip()] = value.strip().strip('"').strip("'")
    return values
