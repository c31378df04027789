"""The brain's speed-ups change no decision: replay on bench cases (kinds, regressions, a
weekly rhythm) decides, tick for tick, what the recorded fixture says it decided before.

Regenerate the fixture only for an intended change of behaviour:
``.venv/bin/python tests/bench/test_replay_decisions.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_replay  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import load_trace, replay  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "replay" / "decisions.json"
# (truth, trace, policy) → days replayed: choosing among kinds (off, then an adaptive set
# on day 2), a change to an oversold step count taken back, a weekly rhythm.
CASES = {
    ("heavyoff", "day_night", "model"): 2.0,
    ("heavyoff", "steady_heavy", "model"): 1.0,
    ("near cal 5+8%", "day_night", "model"): 2.0,
    ("k5to2", "weekly", "model"): 1.0,
}


def _decide(truth_name: str, trace_name: str, policy: str, tmp: Path) -> dict[str, Any]:
    """Every decision of one bench case (as `bench_replay.run_one` runs it), as JSON."""
    _, truth_path, calibration = next(t for t in bench_replay.TRUTHS if t[0] == truth_name)
    days = CASES[(truth_name, trace_name, policy)]
    trace = traces.write(trace_name, tmp / f"{trace_name}-{days:g}.csv", days)
    config = bench_replay.case_config(calibration, trace_name, policy)
    result = replay(
        load_trace(trace), read_table(truth_path), config, restart_s=bench_replay.RESTART_S
    )
    # Through JSON, as the fixture is: tuples come back as lists.
    out: dict[str, Any] = json.loads(
        json.dumps(
            {
                "setting_timeline": result.setting_timeline,
                "decisions": result.decisions,
                "specd_tokens": round(result.specd_tokens),
            }
        )
    )
    return out


def _key(case: tuple[str, str, str]) -> str:
    return "|".join(case)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_replay_decides_as_recorded(case: tuple[str, str, str], tmp_path: Path) -> None:
    recorded = json.loads(FIXTURE.read_text())[_key(case)]
    got = _decide(*case, tmp_path)
    assert got["setting_timeline"] == recorded["setting_timeline"]
    assert got["specd_tokens"] == recorded["specd_tokens"]
    assert len(got["decisions"]) == len(recorded["decisions"])
    for mine, theirs in zip(got["decisions"], recorded["decisions"], strict=True):
        assert mine == theirs


def test_the_fixture_has_changes_of_every_kind() -> None:
    """The cases exercise what the speed-ups touch: changes to off and to an adaptive set."""
    recorded = json.loads(FIXTURE.read_text())
    settings = {s for case in recorded.values() for _, s in case["setting_timeline"]}
    assert "off" in settings
    assert any(s.startswith("adaptive:") for s in settings)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        fixture = {_key(case): _decide(*case, Path(tmp)) for case in CASES}
        FIXTURE.write_text(json.dumps(fixture, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
