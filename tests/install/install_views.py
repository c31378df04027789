"""`systemctl show` / `cat` output as systemd 252 prints it, for the install tests."""

from __future__ import annotations

from specd.install.execline import split_exec
from specd.install.layout import DROPIN_NAME, ENV_FILE, UNITS_DIR, Layout
from specd.install.plan import SystemState
from specd.install.unit import UnitView, parse_show

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
    unit: str = UNIT,
    environment_files: tuple[str, ...] = (),
) -> UnitView:
    """A UnitView as systemd 252 prints it for a unit whose ExecStart= is ``exec_value``."""
    _, words = split_exec(exec_value)
    argv = shown_argv if shown_argv is not None else " ".join(words)
    dropins = dropins or {}
    fragment = f"/etc/systemd/system/{unit}"
    show = "\n".join(
        [
            f"Id={unit}",
            "LoadState=loaded",
            show_line(argv, path=words[0]),
            f"Environment={environment}",
            *(f"EnvironmentFiles={p} (ignore_errors=yes)" for p in environment_files),
            f"FragmentPath={fragment}",
            f"DropInPaths={' '.join(dropins)}",
        ]
    )
    cat = f"# {fragment}\n[Unit]\nDescription=SGLang\n\n[Service]\nExecStart={exec_value}\n"
    for path, text in dropins.items():
        cat += f"\n# {path}\n{text}"
    return parse_show(unit, show, cat)


def installed_view(layout: Layout, unit: str = UNIT) -> UnitView:
    """The unit as systemd shows it once install's drop-in (in ``layout``) is loaded: its
    ExecStart= with $SPECD_SPECULATIVE_ARGS, today's SPEC as the variable's default."""
    dropin = UNITS_DIR / f"{unit}.d" / DROPIN_NAME
    return view_of(
        "/bin/false",
        dropins={str(dropin): layout.host(dropin).read_text()},
        # As systemctl show prints a value with spaces: the assignment quoted whole.
        environment=f'"SPECD_SPECULATIVE_ARGS={SPEC}"',
        shown_argv=f"{BASE} $SPECD_SPECULATIVE_ARGS",
        environment_files=(str(ENV_FILE),),
        unit=unit,
    )
