"""`specd install` and `specd uninstall`: the command line, and install's interactive flow."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from specd.commands.args import Int, Seconds
from specd.core.settings import FleetSettings
from specd.install.execute import execute
from specd.install.layout import MANIFEST_FILE, InstallError, Layout, check_unit_name
from specd.install.manifest import load_manifest
from specd.install.plan import FleetOptions, GatewayOptions, Plan, build_plan, system_state
from specd.install.probe import check_sglang, probe_config
from specd.install.render import specd_command
from specd.install.uninstall import uninstall
from specd.install.unit import read_unit
from specd.io.runner import Runner, SubprocessRunner


def _bound(name: str, kind: str) -> float:
    """FleetSettings' own ``ge``/``le`` for a field: the flag's bounds are the setting's."""
    for item in FleetSettings.model_fields[name].metadata:
        if hasattr(item, kind):
            return float(getattr(item, kind))
    raise LookupError(f"FleetSettings.{name} has no {kind} bound")


FLEET_SLOTS = Int(int(_bound("slots", "ge")), int(_bound("slots", "le")))
FLEET_LEASE_TTL_S = Seconds(_bound("lease_ttl_s", "ge"), _bound("lease_ttl_s", "le"))


def _ask(question: str) -> bool:
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def install(
    args: argparse.Namespace, runner: Runner, layout: Layout, out: Any, now_s: float | None = None
) -> int:
    unit = check_unit_name(args.unit)
    if not args.dry_run and os.geteuid() != 0 and layout.root == Path("/"):
        raise InstallError("must run as root (writes /etc, runs systemctl); see --dry-run")
    try:
        manifest = load_manifest(layout)
    except PermissionError:
        if not args.dry_run:
            raise
        # Root's alone (0600). Read as "not installed": the plan is what a first install does.
        print(
            f"note: cannot read {MANIFEST_FILE} as this user: planned as a first install", file=out
        )
        manifest = None
    if manifest is not None and manifest.get("unit") != unit:
        raise InstallError(
            f"specd is installed for {manifest.get('unit')}; run `specd uninstall` before "
            f"installing it for {unit}"
        )
    if not args.gateway_url and (args.gateway_api_key_file or args.gateway_worker_url):
        raise InstallError("--gateway-api-key-file/--gateway-worker-url need --gateway-url")
    fleet_extras = (
        args.fleet_group,
        args.fleet_slots,
        args.fleet_lease_ttl_s,
        args.fleet_holder_name,
    )
    if not args.etcd_endpoint and any(v is not None for v in fleet_extras):
        raise InstallError(
            "--fleet-group/--fleet-slots/--fleet-lease-ttl-s/--fleet-holder-name need "
            "--etcd-endpoint"
        )
    if args.etcd_endpoint and args.fleet_group is None:
        raise InstallError("--etcd-endpoint needs --fleet-group (the same on every server)")
    fleet = FleetOptions(args.etcd_endpoint, *fleet_extras) if args.etcd_endpoint else None
    view = read_unit(runner, unit)
    system = system_state(runner)
    interactive = sys.stdin.isatty() and not args.yes and not args.dry_run
    add_metrics = args.add_enable_metrics
    moment = time.time() if now_s is None else now_s
    installed = {
        str(path): str(record.get("sha256"))
        for path, record in (manifest or {}).get("files", {}).items()
        if isinstance(record, dict)
    }

    sglang_key = args.sglang_api_key_file

    def plan_for(metrics: bool) -> Plan:
        return build_plan(
            view,
            layout,
            system,
            add_metrics=metrics,
            specd_argv=args.specd,
            url=args.url,
            fresh=manifest is None,
            gateway=None
            if not args.gateway_url
            else GatewayOptions(
                args.gateway_url, args.gateway_api_key_file, args.gateway_worker_url
            ),
            fleet=fleet,
            now_s=moment,
            installed=installed,
            server_api_key_file=sglang_key,
        )

    try:
        plan = plan_for(add_metrics)
    except InstallError as exc:
        if add_metrics or not interactive or "--enable-metrics" not in str(exc):
            raise
        print(str(exc), file=out)
        if not _ask(f"Add --enable-metrics to {unit}'s command line in specd's drop-in?"):
            return 1
        plan = plan_for(True)
    spec = plan.spec
    print(
        f"{unit}: {spec.algorithm}, --speculative-num-steps {spec.steps}, "
        f"--speculative-num-draft-tokens {spec.draft_tokens}, "
        f"metrics {'on' if spec.metrics else 'added by the drop-in'}, "
        f"SGLang at {plan.url}",
        file=out,
    )
    key = plan.server_api_key_file
    refusal, silent = check_sglang(
        plan.url,
        unit,
        spec.port,
        given=args.url is not None,
        api_key=None if key is None else layout.host(Path(key)),
    )
    if refusal is not None:
        raise InstallError(refusal)
    problems, notes = probe_config(plan.fleet, plan.gateway, plan.url, layout)
    for note in notes:
        print(f"note: {note}", file=out)
    for problem in problems:
        print(f"warning: {problem}", file=out)
    for warning in [*plan.warnings, *([] if silent is None else [silent])]:
        print(f"warning: {warning}", file=out)
    refuse = bool(problems) and not args.allow_unreachable and not plan.empty
    if refuse and not args.dry_run:
        raise InstallError(
            f"{len(problems)} etcd endpoint(s)/gateway replica(s) do not answer (above): fix "
            "the URL or key, or pass --allow-unreachable to install anyway (specd then makes "
            "no restart until they answer; `specd doctor` shows it)"
        )
    if refuse:
        print(
            "(install without --dry-run refuses this; --allow-unreachable installs anyway)",
            file=out,
        )
    for path, why in plan.unreadable.items():
        print(
            f"note: cannot read {path} as this user ({why}): what install would change there "
            "is not shown (`sudo specd install --dry-run` shows it)",
            file=out,
        )
    if plan.unreadable and not args.dry_run:
        raise InstallError(f"cannot read {', '.join(map(str, plan.unreadable))}")
    if plan.empty and not plan.unreadable:
        print("nothing to do: specd is installed and running for this unit", file=out)
        return 0
    if args.dry_run:
        print("dry run: these files would be written and these commands run\n", file=out)
        out.write(plan.render())
        for note in plan.notes:
            print("\n" + note, file=out)
        return 0
    if not args.yes:
        if not interactive:
            raise InstallError(
                "stdin is not a terminal: pass --yes to install without asking "
                "(--dry-run shows the plan)"
            )
        out.write(plan.render())
        if not _ask("Proceed?"):
            return 1
    execute(plan, layout, runner, view, out)
    for note in plan.notes:
        print(note, file=out)
    print("installed; check it with `specd doctor` (undo with `specd uninstall`)", file=out)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    if parser.prog.endswith("uninstall"):
        parser.description = (
            "Remove exactly what `specd install` added (its manifest says what), restore the "
            "files it changed (bytes, mode, owner), archive specd's state, env file and "
            "override under /var/backups/specd/ (an env file install converted is put back "
            "as it was), and leave the SGLang unit as it was."
        )
        parser.add_argument(
            "--restart-sglang",
            action="store_true",
            help="restart the SGLang unit afterwards so it runs its original command now",
        )
        parser.set_defaults(action="uninstall")
        return
    parser.description = (
        "Wire an existing SGLang unit to specd: a drop-in repeating its ExecStart= with the "
        "step count from specd's env file, the specd user and state dir, specd.service, the "
        "polkit rule and /etc/specd/specd.toml. Never restarts SGLang. Idempotent."
    )
    parser.add_argument("--unit", required=True, help="the SGLang service, e.g. sglang.service")
    parser.add_argument(
        "--url",
        default=None,
        help="SGLang's base URL, e.g. http://127.0.0.1:30000 (default: from --host/--port "
        "of the unit's command line)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every file (as a diff) and command; change nothing",
    )
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    parser.add_argument(
        "--sglang-api-key-file",
        default=None,
        metavar="PATH",
        help="file holding SGLang's --api-key, where the unit runs with one ([sglang] "
        "server_api_key_file; absolute path, not readable by others, e.g. "
        "/etc/specd/sglang.key 0600 specd:specd)",
    )
    parser.add_argument(
        "--gateway-url",
        action="append",
        default=[],
        metavar="URL",
        help="an SGLang model gateway (smg) replica routing to this server, e.g. "
        "http://10.0.0.2:30080; repeat for each replica. specd then drains this server there "
        "before each restart ([gateway] in specd.toml)",
    )
    parser.add_argument(
        "--gateway-api-key-file",
        default=None,
        metavar="PATH",
        help="file holding the gateway's admin API key (absolute path, not readable by others)",
    )
    parser.add_argument(
        "--gateway-worker-url",
        default=None,
        metavar="URL",
        help="the URL the gateway knows this server by (default: SGLang's URL)",
    )
    parser.add_argument(
        "--etcd-endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="an etcd member's client URL, e.g. http://10.0.0.5:2379; repeat for each. "
        "specd then takes a slot of --fleet-group before each restart ([fleet] in specd.toml)",
    )
    parser.add_argument(
        "--fleet-group",
        default=None,
        metavar="NAME",
        help="the servers that share restart slots, the same on each (letters, digits, "
        "'.', '_', '-')",
    )
    parser.add_argument(
        "--fleet-slots",
        type=FLEET_SLOTS,
        default=None,
        metavar="N",
        help=f"how many servers of the group may restart at once ({FLEET_SLOTS.spec}, default 1)",
    )
    parser.add_argument(
        "--fleet-lease-ttl-s",
        type=FLEET_LEASE_TTL_S,
        default=None,
        metavar="SECONDS",
        help="TTL of a slot's etcd lease: a specd that dies frees its slot this long after "
        f"({FLEET_LEASE_TTL_S.spec}, default 30)",
    )
    parser.add_argument(
        "--fleet-holder-name",
        default=None,
        metavar="NAME",
        help="how this specd names itself in a slot (default: host name and unit)",
    )
    parser.add_argument(
        "--allow-unreachable",
        action="store_true",
        help="install even if an etcd endpoint or gateway replica does not answer now "
        "(warned; specd makes no restart until it answers)",
    )
    parser.add_argument(
        "--add-enable-metrics",
        action="store_true",
        help="add --enable-metrics to the command in the drop-in if the unit lacks it",
    )
    parser.set_defaults(action="install", specd=specd_command())


def run(args: argparse.Namespace) -> int:
    runner = SubprocessRunner()
    layout = Layout()
    try:
        if args.action == "uninstall":
            if os.geteuid() != 0:
                raise InstallError("must run as root (removes files in /etc, runs systemctl)")
            return uninstall(layout, runner, args.restart_sglang, sys.stdout)
        return install(args, runner, layout, sys.stdout)
    except InstallError as exc:
        print(f"specd {args.action}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"specd {args.action}: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1
