"""specd install's pure parts: reading `systemctl show`/`cat`, finding the speculative flags in
every form SGLang accepts, each refusal with its message, rendering, and the dry-run diff."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specd.install.installer import (
    CONFIG_FILE,
    DROPIN_NAME,
    POLKIT_FILE,
    SPECD_UNIT,
    UNITS_DIR,
    Command,
    InstallError,
    Layout,
    SystemState,
    UnitView,
    analyse,
    build_plan,
    format_exec,
    live_command,
    parse_exec_property,
    parse_show,
    render_config,
    render_polkit,
    sglang_url,
    split_exec,
    template,
)

UNIT = "sglang.service"
FRAGMENT = "/etc/systemd/system/sglang.service"
SPEC = (
    "--speculative-algorithm NEXTN --speculative-num-steps 4 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 5"
)
PYTHON = "/opt/sglang/bin/python -m sglang.launch_server"
BASE = f"{PYTHON} --host 127.0.0.1 --port 30000 --enable-metrics"
FRESH = SystemState(user_exists=False, specd_enabled=False, specd_active=False)
RUNNING = SystemState(user_exists=True, specd_enabled=True, specd_active=True)
SPECD = ["/opt/specd/bin/specd"]


def show_line(argv_text: str, path: str = "/opt/sglang/bin/python", ignore: str = "no") -> str:
    return (
        f"ExecStart={{ path={path} ; argv[]={argv_text} ; ignore_errors={ignore} ; "
        "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }"
    )


def view_of(
    exec_value: str,
    *,
    dropins: dict[str, str] | None = None,
    environment: str = "CUDA_VISIBLE_DEVICES=0,1,2,3 NCCL_IB_DISABLE=1",
    shown_argv: str | None = None,
) -> UnitView:
    """A UnitView as systemd 252 prints it for a unit whose ExecStart= is ``exec_value``."""
    _, words = split_exec(exec_value)
    argv = shown_argv if shown_argv is not None else " ".join(words)
    dropins = dropins or {}
    show = "\n".join(
        [
            f"Id={UNIT}",
            "LoadState=loaded",
            show_line(argv, path=words[0]),
            f"Environment={environment}",
            f"FragmentPath={FRAGMENT}",
            f"DropInPaths={' '.join(dropins)}",
        ]
    )
    cat = f"# {FRAGMENT}\n[Unit]\nDescription=SGLang\n\n[Service]\nExecStart={exec_value}\n"
    for path, text in dropins.items():
        cat += f"\n# {path}\n{text}"
    return parse_show(UNIT, show, cat)


# -- systemctl show / cat ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path", "argv", "ignore"),
    [
        (show_line(f"{BASE} {SPEC}"), "/opt/sglang/bin/python", f"{BASE} {SPEC}", False),
        (show_line("/bin/x a ; b", path="/bin/x", ignore="yes"), "/bin/x", "/bin/x a ; b", True),
    ],
)
def test_parse_exec_property(value: str, path: str, argv: str, ignore: bool) -> None:
    parsed = parse_exec_property(value.removeprefix("ExecStart="))
    assert (parsed.path, parsed.argv_text, parsed.ignore_errors) == (path, argv, ignore)


@pytest.mark.parametrize("value", ["/bin/x a b", "{ path=/bin/x }", "{ argv[]=x ; path=y }"])
def test_parse_exec_property_refuses_other_formats(value: str) -> None:
    with pytest.raises(InstallError, match="unexpected ExecStart format"):
        parse_exec_property(value)


@pytest.mark.parametrize(
    ("value", "prefix", "words"),
    [
        ("/bin/x a  b", "", ["/bin/x", "a", "b"]),
        ("-/bin/x \"a b\" 'c d'", "-", ["/bin/x", "a b", "c d"]),
        ("@/bin/x argv0 --y", "@", ["/bin/x", "argv0", "--y"]),
        (
            '/bin/x "say \\"hi\\"" 100%% $HOME ${V}',
            "",
            ["/bin/x", 'say "hi"', "100%", "$HOME", "${V}"],
        ),
        ("/bin/x a\\tb \\x41", "", ["/bin/x", "a\tb", "A"]),
        ("/bin/x '' z", "", ["/bin/x", "", "z"]),
    ],
)
def test_split_exec(value: str, prefix: str, words: list[str]) -> None:
    assert split_exec(value) == (prefix, words)


def test_split_exec_refuses_an_open_quote() -> None:
    with pytest.raises(InstallError, match="unterminated quote"):
        split_exec('/bin/x "a b')


@pytest.mark.parametrize(
    "words",
    [
        ["/bin/x", "--chat-template", "a b", "--x=1"],
        ["/bin/x", "100%", 'say "hi"', "back\\slash", ";", "tab\there", ""],
        ["/bin/x", "--speculative-num-steps", "${SPECD_SPEC_STEPS}", "$$literal"],
    ],
)
def test_format_exec_reads_back_as_the_same_words(words: list[str]) -> None:
    text = format_exec(Command("-", tuple(words)))
    joined = text.replace(" \\\n    ", " ")  # what systemd's line continuation yields
    assert split_exec(joined) == ("-", words)


def test_live_command_keeps_quoted_words_that_show_loses() -> None:
    view = view_of(f'{BASE} --chat-template "two words" {SPEC}')
    assert "two words" in live_command(view).words


def test_live_command_follows_dropins_and_continuations() -> None:
    dropin = "/etc/systemd/system/sglang.service.d/10-local.conf"
    override = f"[Service]\nExecStart=\nExecStart={PYTHON} \\\n  --port 31000 \\\n  {SPEC}\n"
    shown = f"{PYTHON} --port 31000 {SPEC}"
    view = parse_show(
        UNIT,
        "\n".join(
            [
                "LoadState=loaded",
                show_line(shown),
                f"FragmentPath={FRAGMENT}",
                f"DropInPaths={dropin}",
            ]
        ),
        f"# {FRAGMENT}\n[Service]\nExecStart=/bin/false\n\n# {dropin}\n{override}",
    )
    assert " ".join(live_command(view).words) == shown


@pytest.mark.parametrize(
    ("show", "message"),
    [
        ("LoadState=not-found\n", "no such unit"),
        ("LoadState=loaded\nExecStart=\n", "has no ExecStart="),
        (
            f"LoadState=loaded\n{show_line('/bin/a')}\n{show_line('/bin/b')}\n",
            "has 2 ExecStart= commands",
        ),
    ],
)
def test_live_command_refusals(show: str, message: str) -> None:
    with pytest.raises(InstallError, match=message):
        live_command(parse_show(UNIT, show, ""))


def test_live_command_refuses_a_command_it_cannot_read_exactly() -> None:
    view = view_of(f"{BASE} {SPEC}", shown_argv=f"{BASE} --extra word {SPEC}")
    with pytest.raises(InstallError, match="cannot read its ExecStart= unambiguously"):
        live_command(view)


# -- the flags in every form --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "steps", "draft", "dropin_fragment"),
    [
        (SPEC, 4, 5, "--speculative-num-steps ${SPECD_SPEC_STEPS}"),
        (
            "--speculative-algorithm=EAGLE3 --speculative-num-steps=2 "
            "--speculative-eagle-topk=1 --speculative-num-draft-tokens=3",
            2,
            3,
            "--speculative-num-draft-tokens=${SPECD_SPEC_DRAFT_TOKENS}",
        ),
        # argparse abbreviations SGLang accepts.
        (
            "--speculative-algo NEXTN --speculative-num-st 3 --speculative-eagle 1 "
            "--speculative-num-d 4",
            3,
            4,
            "--speculative-num-st ${SPECD_SPEC_STEPS}",
        ),
        # The alias's value is a value, not a flag; the last occurrence wins, as in argparse.
        (
            f"--speculative-draft-model /m/draft {SPEC} --speculative-num-steps 6",
            6,
            5,
            "--speculative-draft-model /m/draft",
        ),
        (
            "--speculative-algorithm NEXTN --speculative-num-steps ${SPECD_SPEC_STEPS} "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens ${SPECD_SPEC_DRAFT_TOKENS}",
            3,
            4,
            "Environment=SPECD_SPEC_STEPS=3 SPECD_SPEC_DRAFT_TOKENS=4",
        ),
    ],
)
def test_flag_forms(
    tmp_path: Path, args: str, steps: int, draft: int, dropin_fragment: str
) -> None:
    view = view_of(f"{BASE} {args}", environment="SPECD_SPEC_STEPS=3 SPECD_SPEC_DRAFT_TOKENS=4")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert (plan.spec.steps, plan.spec.draft_tokens) == (steps, draft)
    dropin = next(c for c in plan.files if c.path.name == DROPIN_NAME).new.decode()
    assert dropin_fragment in dropin
    assert f"Environment=SPECD_SPEC_STEPS={steps} SPECD_SPEC_DRAFT_TOKENS={draft}" in dropin


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
        (SPEC.replace("steps 4", "steps ${SPECD_SPEC_STEPS}"), "sets no default"),
        (SPEC.replace("steps 4", "steps 0"), "must be >= 1"),
        (f"{SPEC} --speculative-num 3", "ambiguous abbreviation"),
        (f"{SPEC} --port http", "not a TCP port"),
    ],
)
def test_refusals(args: str, message: str) -> None:
    view = view_of(f"{PYTHON} --enable-metrics {args}", environment="")
    command = live_command(view)
    with pytest.raises(InstallError, match=message):
        analyse(command, view.environment, UNIT)


def test_adaptive_switched_off_is_accepted() -> None:
    command = Command("", ("/bin/x", *SPEC.split(), "--speculative-adaptive=false"))
    assert analyse(command, {}, UNIT).steps == 4


def test_refuses_a_unit_without_metrics_unless_asked(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} {SPEC}")
    with pytest.raises(InstallError, match=r"runs without --enable-metrics.*--add-enable-metrics"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=True, specd_argv=SPECD)
    dropin = next(c for c in plan.files if c.path.name == DROPIN_NAME).new.decode()
    assert dropin.rstrip().endswith("--enable-metrics")


def test_refuses_when_a_later_dropin_sets_execstart(tmp_path: Path) -> None:
    later = "/etc/systemd/system/sglang.service.d/90-local.conf"
    view = view_of(
        f"{BASE} {SPEC}", dropins={later: f"[Service]\nExecStart=\nExecStart={BASE} {SPEC}\n"}
    )
    with pytest.raises(InstallError, match=r"90-local\.conf sets ExecStart= and is read after"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)


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


def test_url_comes_from_the_units_host_and_port(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --host=0.0.0.0 --port 31000 {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    config = next(c for c in plan.files if c.path == CONFIG_FILE).new.decode()
    assert 'sglang_url = "http://127.0.0.1:31000"' in config


# -- rendering and the plan ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("existing", "expect_in", "expect_not_in"),
    [
        (None, ['sglang_unit = "llm.service"', "[[windows]]"], ['sglang_unit = "sglang.service"']),
        (
            "min_history_s = 2.0\n[[windows]]\ncron = '* * * * mon'\nduration_s = 5.0\n",
            ['sglang_url = "http://h:1"\n', "min_history_s = 2.0", "cron = '* * * * mon'"],
            [],
        ),
        (
            'sglang_url="http://old:1"\nmax_steps = 4\n[[bands]]\nsteps = 3\n',
            ['sglang_url = "http://h:1"', "max_steps = 4"],
            ["http://old:1"],
        ),
    ],
)
def test_render_config(
    existing: str | None, expect_in: list[str], expect_not_in: list[str]
) -> None:
    text = render_config(existing, "http://h:1", "llm.service")
    for part in expect_in:
        assert part in text
    for part in expect_not_in:
        assert part not in text
    head = re.split(r"^\[", text, maxsplit=1, flags=re.MULTILINE)[0]
    assert 'sglang_unit = "llm.service"' in head  # a top-level key, before any table


def test_polkit_rule_is_scoped_to_the_unit() -> None:
    shipped = template("polkit")
    assert render_polkit(shipped, UNIT) == shipped
    assert 'var SGLANG_UNIT = "llm@a.service";' in render_polkit(shipped, "llm@a.service")
    with pytest.raises(InstallError, match="no `var SGLANG_UNIT"):
        render_polkit("polkit.addRule(function () {});", UNIT)


def test_dry_run_diff(tmp_path: Path) -> None:
    view = view_of(f"{BASE} {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    text = plan.render()
    dropin = UNITS_DIR / f"{UNIT}.d" / DROPIN_NAME
    assert f"--- {dropin} (absent)\n+++ {dropin} (new, 0644)\n" in text
    assert "+ExecStart=\n" in text
    assert "+    --speculative-num-steps ${SPECD_SPEC_STEPS} \\\n" in text
    assert "+EnvironmentFile=-/var/lib/specd/sglang.env\n" in text
    assert f"+ExecStart={SPECD[0]} run --config /etc/specd/specd.toml\n" in text
    assert f"+++ {POLKIT_FILE} (new, 0644)" in text
    commands = [line for line in text.splitlines() if line.startswith("$ ")]
    assert commands == [
        "$ systemd-sysusers /etc/sysusers.d/specd.conf",
        "$ mkdir -m 0750 /var/lib/specd",
        "$ chown specd:specd /var/lib/specd",
        "$ systemctl daemon-reload",
        f"$ systemctl enable --now {SPECD_UNIT}",
    ]
    assert "restart" not in " ".join(commands)  # never SGLang
    assert any("SGLang is not restarted" in note for note in plan.notes)
    assert not any(tmp_path.rglob("*"))  # planning wrote nothing


def test_plan_is_empty_once_installed(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    first = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    for change in first.files:
        target = layout.host(change.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(change.new)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    again = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert again.empty, again.render()


def test_an_edited_config_is_updated_in_place_and_restarts_specd(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    config.write_text('sglang_url = "http://127.0.0.1:30000"\nmin_history_s = 5.0\n')
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    plan = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    change = next(c for c in plan.files if c.path == CONFIG_FILE)
    assert change.old == config.read_bytes()
    assert b"min_history_s = 5.0" in change.new
    diff = change.diff().splitlines()
    assert '-sglang_url = "http://127.0.0.1:30000"' in diff
    assert '+sglang_url = "http://127.0.0.1:31000"' in diff
    assert '+sglang_unit = "sglang.service"' in diff
    assert ("systemctl", "restart", SPECD_UNIT) in plan.commands
