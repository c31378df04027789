"""SGLang's command line: the speculative flags in every form SGLang accepts, variables from the
unit's environment, each refusal with its message, and where specd reaches SGLang."""

from __future__ import annotations

from pathlib import Path

import pytest
from install_views import BASE, FRESH, PYTHON, SPEC, SPECD, UNIT, view_of

from specd.install.execline import Command
from specd.install.layout import DROPIN_NAME, InstallError, Layout
from specd.install.plan import build_plan
from specd.install.sglang_args import analyse, sglang_url
from specd.install.unit import live_command


@pytest.mark.parametrize(
    ("args", "setting", "kept"),
    [
        (SPEC, ("NEXTN", 4, 5), None),
        (
            "--speculative-algorithm=EAGLE3 --speculative-num-steps=2 "
            "--speculative-eagle-topk=1 --speculative-num-draft-tokens=3",
            ("EAGLE3", 2, 3),
            None,
        ),
        # argparse abbreviations SGLang accepts.
        (
            "--speculative-algo NEXTN --speculative-num-st 3 --speculative-eagle 1 "
            "--speculative-num-d 4",
            ("NEXTN", 3, 4),
            None,
        ),
        # The alias's value is a value, not a flag; the last occurrence wins, as in argparse,
        # and every occurrence moves into the variable. The draft model is not a setting.
        (
            f"--speculative-draft-model /m/draft {SPEC} --speculative-num-steps 6",
            ("NEXTN", 6, 5),
            "--speculative-draft-model /m/draft",
        ),
        # Adaptive switched off on the unit's own line: it moves with the setting too.
        (f"{SPEC} --speculative-adaptive=false", ("NEXTN", 4, 5), None),
        # Wired by an older specd (step variables): today's values are the drop-in's defaults.
        (
            "--speculative-algorithm NEXTN --speculative-num-steps ${SPECULATIVE_NUM_STEPS} "
            "--speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens ${SPECULATIVE_NUM_DRAFT_TOKENS}",
            ("NEXTN", 3, 4),
            None,
        ),
        # ... and with the names before those.
        (
            "--speculative-algorithm NEXTN --speculative-num-steps ${SPECD_SPEC_STEPS} "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens ${SPECD_SPEC_DRAFT_TOKENS}",
            ("NEXTN", 2, 3),
            None,
        ),
        # The operator's own variables, as systemd expands them: the default says the values.
        (
            "--speculative-algorithm ${ALGO} --speculative-num-steps ${MY_STEPS} "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 1${MY_STEPS}",
            ("EAGLE", 5, 15),
            None,
        ),
    ],
)
def test_flag_forms(
    tmp_path: Path, args: str, setting: tuple[str, int, int], kept: str | None
) -> None:
    view = view_of(
        f"{BASE} {args}",
        environment="SPECULATIVE_NUM_STEPS=3 SPECULATIVE_NUM_DRAFT_TOKENS=4 "
        "SPECD_SPEC_STEPS=2 SPECD_SPEC_DRAFT_TOKENS=3 MY_STEPS=5 ALGO=EAGLE",
    )
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    algorithm, steps, draft = setting
    assert (plan.spec.algorithm, plan.spec.steps, plan.spec.draft_tokens) == setting
    dropin = next(c for c in plan.files if c.path.name == DROPIN_NAME).new.decode()
    exec_line = dropin.split("ExecStart=\nExecStart=", 1)[1]
    # At the place of the setting's first option (here: after what came before it).
    before = kept if kept is not None else "--enable-metrics"
    assert exec_line.rstrip().endswith(f"{before} \\\n    $SPECD_SPECULATIVE_ARGS")
    # Nothing of the setting stays on the unit's own line (argparse would keep the last).
    assert "--speculative-a" not in exec_line
    assert "--speculative-n" not in exec_line
    assert "--speculative-e" not in exec_line
    if kept is not None:
        assert kept in exec_line
    assert (
        f'Environment="SPECD_SPECULATIVE_ARGS=--speculative-algorithm {algorithm} '
        f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
        f'--speculative-num-draft-tokens {draft}"\n'
    ) in dropin
    assert "SPECD_SPEC_" not in dropin
    assert "SPECULATIVE_NUM_" not in dropin


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--tp-size 4", "runs without speculative decoding"),
        ("--speculative-algorithm NGRAM --speculative-num-steps 2", "tunes the step count of"),
        (f"{SPEC} --speculative-adaptive", "runs with --speculative-adaptive"),
        (f"{SPEC} --speculative-adaptive-config /a.json --speculative-adaptive", "adaptive"),
        (SPEC.replace("topk 1", "topk 4"), "--speculative-eagle-topk 4: specd applies chain"),
        ("--speculative-algorithm NEXTN --speculative-eagle-topk 1", "lacks --speculative-num-st"),
        (SPEC.replace("steps 4", "steps $STEPS"), "has the value '\\$STEPS'"),
        (SPEC.replace("steps 4", "steps ${SPECULATIVE_NUM_STEPS}"), "sets no default"),
        (SPEC.replace("steps 4", "steps ${SPECD_SPEC_STEPS}"), "sets no default"),
        (SPEC.replace("steps 4", "steps ${UNSET}"), "has the value '\\$\\{UNSET\\}' \\(= ''"),
        (SPEC.replace("steps 4", "steps 0"), "must be >= 1"),
        (f"{SPEC} --speculative-num 3", "ambiguous abbreviation"),
        (f"{SPEC} --port http", "not a TCP port"),
        (f"{SPEC} --port ${{PORT}}", "--port '\\$\\{PORT\\}'.*pass --url"),
        (f"{SPEC} $MORE", "--speculative-num-steps comes from \\$MORE, which specd cannot"),
    ],
)
def test_refusals(args: str, message: str) -> None:
    view = view_of(f"{PYTHON} --enable-metrics {args}", environment="")
    command = live_command(view)
    with pytest.raises(InstallError, match=message):
        analyse(command, {"MORE": "--speculative-num-steps 2"}, UNIT)


def test_adaptive_switched_off_is_accepted() -> None:
    command = Command("", ("/bin/x", *SPEC.split(), "--speculative-adaptive=false"))
    assert analyse(command, {}, UNIT).steps == 4


def test_port_from_the_units_environment() -> None:
    command = Command("", ("/bin/x", "--port", "${PORT}", "--host=$$h", *SPEC.split()))
    spec = analyse(command, {"PORT": "31000"}, UNIT)
    assert (spec.host, spec.port) == ("$h", 31000)


def test_no_port_needed_when_the_url_is_given() -> None:
    command = Command("", ("/bin/x", "--port", "${PORT}", *SPEC.split()))
    assert analyse(command, {}, UNIT, read_url=False).port is None


@pytest.mark.parametrize(
    ("host", "port", "url"),
    [
        ("127.0.0.1", 30000, "http://127.0.0.1:30000"),
        ("0.0.0.0", 8000, "http://127.0.0.1:8000"),
        ("::", 30000, "http://[::1]:30000"),
        ("fd00::5", 30000, "http://[fd00::5]:30000"),
        ("gpu-01.lan", 30000, "http://gpu-01.lan:30000"),
    ],
)
def test_sglang_url(host: str, port: int, url: str) -> None:
    assert sglang_url(host, port) == url


WIRED_DEFAULT = {
    "SPECD_SPECULATIVE_ARGS": "--speculative-algorithm NEXTN --speculative-num-steps 3 "
    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
}


@pytest.mark.parametrize(
    ("words", "defaults", "message"),
    [
        (("$SPECD_SPECULATIVE_ARGS", "$SPECD_SPECULATIVE_ARGS"), WIRED_DEFAULT, "2 times"),
        (("$SPECD_SPECULATIVE_ARGS",), {}, "no Environment= gives it a default"),
        (
            ("--speculative-num-steps", "5", "$SPECD_SPECULATIVE_ARGS"),
            WIRED_DEFAULT,
            "has \\$SPECD_SPECULATIVE_ARGS and also --speculative-num-steps",
        ),
        (
            ("$SPECD_SPECULATIVE_ARGS",),
            {"SPECD_SPECULATIVE_ARGS": "--speculative-algorithm NEXTN"},
            "lacks --speculative-num-steps",
        ),
    ],
)
def test_wired_refusals(words: tuple[str, ...], defaults: dict[str, str], message: str) -> None:
    command = Command("", ("/bin/x", "--enable-metrics", *words))
    with pytest.raises(InstallError, match=message):
        analyse(command, defaults, UNIT)


def test_wired_reads_the_default_whatever_specd_applied_since() -> None:
    """The env file (what specd applied: here "off") does not change today's setting."""
    command = Command("", ("/bin/x", "--enable-metrics", "$SPECD_SPECULATIVE_ARGS"))
    spec = analyse(command, {"SPECD_SPECULATIVE_ARGS": ""}, UNIT, defaults=WIRED_DEFAULT)
    assert (spec.algorithm, spec.steps, spec.draft_tokens) == ("NEXTN", 3, 4)
    assert spec.setting_words == ()
    assert not spec.step_variables
