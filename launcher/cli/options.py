"""The launcher's command-line edge shared by every command: the node-source and torchrun
options, and their mapping into the typed request (`find_cluster` -> `Cluster`, `build_config`
-> `LaunchConfig`). No I/O beyond reading the node source."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from launcher.cluster import discovery
from launcher.cluster.reach import decide_reach
from launcher.cluster.topology import RANK_ORDERS
from launcher.code.tree import DEFAULT_FANOUT
from launcher.core.env import parse_env_pairs
from launcher.core.hang import HANG_OFF, TRAIN_HANG_TIMEOUT, parse_progress
from launcher.core.output import OUTPUT_ALL_UP_TO, OUTPUT_MODES
from launcher.core.types import Cluster, ControllerHost, LaunchConfig, SshConfig, UserError, Workload, new_job_id
from launcher.jobs.recovery import RecoverRequest, parse_duration

__all__ = [
    "SOURCE_OPTIONS",
    "DRY_RUN_JOB_ID",
    "ENV_OPTION",
    "ENV_FILE_OPTION",
    "IMAGE_OPTION",
    "TORCHRUN_OPTIONS",
    "DETACH_OPTION",
    "WAIT_OPTION",
    "CONTROLLER_GRACE_OPTION",
    "DEFAULT_CONTROLLER_GRACE",
    "RECOVER_OPTIONS",
    "SPARES_OPTION",
    "TERM_GRACE_OPTION",
    "EXEC_RESTARTS_OPTION",
    "hang_options",
    "HANG_OPTIONS_TRAIN",
    "HANG_OPTIONS_RUN",
    "PASS_THROUGH",
    "PROGRAM_AFTER",
    "DRY_RUN_FORMATS",
    "DryRunCommand",
    "apply_options",
    "find_cluster",
    "build_config",
    "ssh_config",
    "trusted_ssh",
    "recover_request",
]


# A dry run's job ID: a placeholder in the job ID's own format (launcher.core.types.new_job_id),
# the same every time, so two dry runs of one launch can be compared byte for byte.
DRY_RUN_JOB_ID = "00000000-000000-000000"
# --dry-run prints a person's reading of the plan; --dry-run=json the plans whole (the commands that
# start a launch: run, train, exec, nccl-tests; the others print the steps they would take).
DRY_RUN_FORMATS = ("text", "json")
_DRY_RUN_JSON = ("run", "train", "exec", "nccl-tests")
# Where DryRunCommand leaves an attached format for --dry-run's callback (click's ctx.meta: keys are
# dotted names unique to their user).
_ATTACHED_FORMAT = "gpufleet.dry_run_format"


class DryRunCommand(click.Command):
    """A command with --dry-run, which takes a format attached (`--dry-run=json`) and never the next
    word, so `launch logs --dry-run JOB` keeps JOB its argument (click's optional value would take
    it: https://click.palletsprojects.com/en/stable/options/#optional-value). --dry-run is a flag,
    and click's parser refuses a value attached to a flag only where it reads options, so its refusal
    says the word is this command's --dry-run (a program's own `--dry-run=x`, after `--` or after
    the program's name, is never read): the format is kept and the word parsed again as the flag."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        while True:
            try:
                return super().parse_args(ctx, list(args))  # a copy: click's parser consumes its list
            except click.BadOptionUsage as e:
                at = next((i for i, a in enumerate(args) if a.startswith("--dry-run=")), None)
                if e.option_name != "--dry-run" or at is None:
                    raise
                ctx.meta[_ATTACHED_FORMAT], args[at] = args[at].partition("=")[2], "--dry-run"


def _dry_run_format(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        value = ctx.meta.pop(_ATTACHED_FORMAT, value)
    if value not in (None, *DRY_RUN_FORMATS):
        raise click.BadParameter(f"{value!r} is not a dry run's format; one of: {', '.join(DRY_RUN_FORMATS)}")
    if value == "json" and ctx.command.name not in _DRY_RUN_JSON:
        raise click.BadParameter(f"json is for launch {', '.join(_DRY_RUN_JSON)}; use --dry-run here")
    return value


SOURCE_OPTIONS = [
    click.option(
        "--stack",
        help="Infra stack name: read `pulumi stack output --json --stack NAME` in the stack's Pulumi project "
        "(see --stack-dir); works from any directory.",
    ),
    click.option(
        "--stack-dir",
        metavar="DIR",
        help="The Pulumi project holding --stack (the gpufleet checkout you ran `pulumi up` in) "
        "[default: $GPUFLEET_STACK_DIR, else the checkout this launcher runs from, else the current directory].",
    ),
    click.option("--outputs", type=click.Path(path_type=Path), help="A saved stack-outputs JSON file."),
    click.option("--hostfile", type=click.Path(path_type=Path), help="One host per line, optional slots=N."),
    click.option(
        "--label",
        "labels",
        multiple=True,
        metavar="KEY=VALUE",
        help="Find instances by label through the Compute Engine API (repeatable).",
    ),
    click.option("--project", help="Project for --label."),
    click.option("--zone", help="Zone for --label and IAP [default: the stack's]."),
    click.option("--api-endpoint", hidden=True, help="Compute Engine API endpoint (tests)."),
    click.option("--local", is_flag=True, help="Run N nodes as process groups on this machine."),
    click.option("--nodes", type=int, help="Use the first N nodes in rank order."),
    click.option(
        "--controller",
        metavar="HOST",
        help="The host that runs detached jobs' controllers and keeps their records, not a node "
        "[default: the stack's controller VM, a hostfile's `controller HOST` line, else node 0].",
    ),
    click.option("--exclude", default="", metavar="HOST,...", help="Leave these hosts out."),
    click.option("--machine-type", help="Machine type for a hostfile (from the outputs otherwise)."),
    click.option("--external-ip", is_flag=True, help="SSH to external IPs (from outside the VPC)."),
    click.option(
        "--ssh-user",
        metavar="USER",
        help="The account to log in as on every node [default: with OS Login (the stack's nodes), your "
        "Google account's OS Login user name, e.g. alice_example_com; else ssh's own, ~/.ssh/config's User].",
    ),
    click.option(
        "--ssh-key",
        type=click.Path(path_type=Path),
        metavar="FILE",
        help="The private key ssh offers (its FILE.pub is what OS Login must hold; see --register-key) "
        "[default: ssh's own, ~/.ssh/id_ed25519, id_ecdsa, id_rsa, google_compute_engine].",
    ),
    click.option(
        "--register-key",
        is_flag=True,
        help="Add your public key to your OS Login profile first (as `gcloud compute os-login ssh-keys add "
        "--key-file=KEY.pub` does) when it is not there.",
    ),
    click.option("--oslogin-endpoint", hidden=True, help="OS Login API endpoint (tests)."),
    click.option(
        "--ssh-option",
        "ssh_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="An OpenSSH -o option (repeatable); wins over the defaults.",
    ),
    click.option(
        "--known-hosts",
        type=click.Path(path_type=Path),
        help="known_hosts file (default: one per cluster under ~/.cache/gpufleet).",
    ),
    click.option(
        "--iap/--no-iap",
        default=None,
        help="Reach the nodes through an IAP tunnel, or straight to their internal addresses (a VPN or peered "
        "network) [default: IAP when the nodes have no external address and this machine is not in their VPC].",
    ),
    click.option("--python", help="The python on the nodes [default: python3; --local: this python]."),
    click.option("--workdir", help="Directory the command runs in on each node."),
    click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True),
    click.option(
        "--dry-run",
        is_flag=True,
        flag_value="text",
        default=None,
        callback=_dry_run_format,
        help="Print what a real launch does on each node and connect to nothing: per node, its ranks, command, "
        "environment (--env values hidden), checks, mounts and prepare steps. --dry-run=json prints every node's "
        "whole plan as JSON, one document per launch on one line (launch run, train, exec, nccl-tests).",
    ),
    click.option(
        "--job-id",
        "dry_run_job_id",
        metavar="ID",
        help=f"With --dry-run: the job ID the commands carry, like 20260101-120000-a1b2c3 [default: {DRY_RUN_JOB_ID}, "
        "so two dry runs of one launch print the same bytes; a real launch makes a new one].",
    ),
]

ENV_OPTION = click.option(
    "--env",
    "env",
    multiple=True,
    metavar="KEY[=VALUE]",
    help="Set or override a variable on every node (repeatable); KEY alone passes this machine's value. "
    "Values reach the nodes on stdin, never on a command line.",
)
ENV_FILE_OPTION = click.option(
    "--env-file",
    "env_file",
    multiple=True,
    metavar="FILE",
    help="KEY=VALUE lines (# comments) to set on every node, as --env does (repeatable; --env wins).",
)

# The ranks run in a container (launcher.core.container); the stack's `image` output is the default.
IMAGE_OPTION = click.option(
    "--image",
    metavar="IMAGE",
    help="Run the ranks inside this container image on every node (docker, else podman), pulled first, "
    "wired for the machine type's GPUs and GPUDirect; torchrun is the image's python3 "
    "[default: the stack's `image` output, else none]. See docs/containers.md.",
)

# Issue 13: the job goes to a controller on node 0 (launcher.jobs.handoff) and outlives this client.
DETACH_OPTION = click.option(
    "--detach",
    is_flag=True,
    help="Check every node, hand the job to a controller on the controller host (see --controller; "
    "node 0 only when the cluster has none), print `job ID` and return; see `launch jobs/logs/stop/attach`.",
)

# Another account's job holding the nodes (launcher.core.holds): wait for them instead of refusing.
WAIT_OPTION = click.option(
    "--wait",
    "wait_nodes",
    is_flag=True,
    help="When another account's job holds some of the nodes, wait for them (a progress line says whose "
    "job) instead of refusing.",
)

# A detached job's nodes keep training without their controller this long (launcher.core.supervise).
DEFAULT_CONTROLLER_GRACE = "10m"
CONTROLLER_GRACE_OPTION = click.option(
    "--controller-grace",
    metavar="DURATION",
    help="With --detach: if the job's controller dies (killed, its VM rebooted), the nodes keep training "
    "this long for a controller started again (`launch jobs`, `launch attach`, the controller VM's boot) to "
    f"re-adopt them, then stop themselves, e.g. 90s, 30m [default: {DEFAULT_CONTROLLER_GRACE}].",
)

# A detached job that loses a node comes back on its own (launcher.jobs.recovery, launcher.jobs.restarts).
RECOVER_OPTIONS = [
    click.option(
        "--recover",
        is_flag=True,
        help="With --detach: when a node is lost or preempted (or a worker fails, see --max-restarts), wait "
        "for every node to pass its check again and relaunch the same command on the same nodes "
        "(launch train: with --resume, needs --checkpoint-dir or --local-checkpoint-every; your own "
        "program: GPUFLEET_ATTEMPT and GPUFLEET_RESTART_REASON tell it, it resumes from its own checkpoint).",
    ),
    click.option(
        "--max-recoveries",
        type=int,
        help="Give up after N recoveries from a lost or preempted node (launch train: from anything) [default: 3].",
    ),
    click.option(
        "--no-restart-exit-codes",
        metavar="CODE,...",
        help="With --recover on your own program: a worker exit status that is never restarted [default: 2].",
    ),
    click.option(
        "--recover-timeout",
        metavar="DURATION",
        help="How long a lost node may take to come back, e.g. 90s, 30m [default: 30m].",
    ),
    click.option(
        "--restart-stopped/--no-restart-stopped",
        default=None,
        help="With --recover: start a node's VM again when Compute Engine stopped it (TERMINATED); "
        "needs the cluster from --stack, --outputs or --label [default: on with --recover].",
    ),
    click.option(
        "--min-nodes",
        type=int,
        help="With --recover: when a lost node is not back within --recover-timeout, go on without it "
        "if N nodes or more are left (new WORLD_SIZE, GPUFLEET_RESTART_REASON=shrunk) [default: fail].",
    ),
]

# Idle nodes that take a lost node's place at once (launcher.jobs.spares): launch train and run.
SPARES_OPTION = click.option(
    "--spares",
    type=int,
    metavar="K",
    help="With --detach --recover: keep the last K nodes (in rank order) prepared and idle; one takes a lost "
    "or bad node's place at once, same world size; with none left, --recover waits (or --min-nodes) [default: 0].",
)

_MAX_RESTARTS_HELP = (
    "torchrun's in-place restarts of the workers; with --recover on launch run/exec, the controller's "
    "relaunches after a failed worker or a hang instead."
)


def hang_options(default: str | None) -> list:
    """--hang-timeout (on by default for train, off for run) and --progress (launcher.core.hang)."""
    on = f"[default: {default}]" if default else "[default: off]"
    return [
        click.option(
            "--hang-timeout",
            default=default,
            metavar="DURATION",
            help="After this long without progress (e.g. 30s, 10m), collect every worker's stack with py-spy, "
            f"name the rank that holds the job up, and stop it; off turns it off {on}.",
        ),
        click.option(
            "--progress",
            metavar="REGEX",
            help="Count only output lines matching REGEX (e.g. 'step \\d+') as progress [default: any line].",
        ),
    ]


HANG_OPTIONS_TRAIN = hang_options(TRAIN_HANG_TIMEOUT)
HANG_OPTIONS_RUN = hang_options(None)

TORCHRUN_OPTIONS = [
    click.option("--nproc-per-node", type=int, help="Processes per node (default: GPUs, or 1 on CPU)."),
    click.option("--max-restarts", type=int, default=0, show_default=True, help=_MAX_RESTARTS_HELP),
    click.option("--rdzv-port", type=int, help="Rendezvous port on node 0 [default: 29500; --local: a free one]."),
    ENV_OPTION,
    ENV_FILE_OPTION,
    IMAGE_OPTION,
    click.option("--nccl-debug", is_flag=True, help="NCCL_DEBUG=INFO on every node."),
    click.option("--image-os", type=click.Choice(["ubuntu", "cos"]), help="Interface naming of the image."),
    click.option(
        "--rank-order",
        type=click.Choice(RANK_ORDERS),
        help="Node i of this order holds torchrun's group rank i (RANK 0 on node 0): topology (by each "
        "node's physical_host, as `launch doctor` orders them) or given (the node source's order) "
        "[default: topology when every node reports a physical_host, else given].",
    ),
]


# What a stop gives every rank between SIGTERM and SIGKILL (launcher.core.node_run).
TERM_GRACE_OPTION = click.option(
    "--term-grace",
    metavar="DURATION",
    help="On a stop or a Spot preemption notice every rank gets SIGTERM, then SIGKILL after this "
    "long, e.g. 10s [default: 25s, inside Compute Engine's 30 s notice].",
)

OUTPUT_OPTION = click.option(
    "--output",
    type=click.Choice(OUTPUT_MODES),
    help="Which nodes' lines an attached launch shows live: all, rank0 (node 0's, and a node's last lines "
    "when it fails) or failures (only a failed node's last lines), with a status line for the rest; "
    f"every node's lines are in its log either way [default: all up to {OUTPUT_ALL_UP_TO} nodes, rank0 above].",
)

# A launch down a tree of the nodes (launcher.code.launch_tree): this machine opens node 0's session only.
FANOUT_OPTION = click.option(
    "--fanout",
    metavar="K|off",
    help="Open only node 0's session from here and let each node open K others' (a tree; each node's "
    "part signed for it alone, passed on with the relay key), or off: one session per node from here. "
    f"SSH nodes only [default: 4 for an attached launch above {OUTPUT_ALL_UP_TO} nodes, else off].",
)

EXEC_RESTARTS_OPTION = click.option(
    "--max-restarts",
    type=int,
    default=0,
    show_default=True,
    help="With --recover: relaunch the command after it fails, up to N times.",
)


def apply_options(options):
    def deco(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return deco


# train passes options it does not know to workloads.train; run and exec take their program
# after the first argument or `--`, so a misspelt launcher option is an error, not a command.
PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "allow_interspersed_args": False}
PROGRAM_AFTER = {"allow_interspersed_args": False}


def find_cluster(o: dict[str, Any]) -> Cluster:
    """Exactly one node source, then --exclude and --nodes."""
    flags = {
        "stack": "--stack",
        "outputs": "--outputs",
        "hostfile": "--hostfile",
        "labels": "--label",
        "local": "--local",
    }
    given = [k for k in flags if o.get(k)]
    if len(given) != 1:
        what = ", ".join(flags[g] for g in given) if given else "none"
        raise UserError(f"give exactly one node source (--stack, --outputs, --hostfile, --label, --local); got {what}")
    ext = o.get("external_ip", False)
    src = given[0]
    if src == "local":
        if o.get("nodes") is None:
            raise UserError("--local needs --nodes N (how many nodes to simulate here)")
        for key, flag in (("exclude", "--exclude"), ("machine_type", "--machine-type")):
            if o.get(key):
                raise UserError(
                    f"{flag} does not apply to --local (its nodes are processes on this machine, on CPU); drop it"
                )
        if o.get("controller"):
            raise UserError("--controller does not apply to --local (no detached jobs there); drop it")
        return discovery.local_cluster(o["nodes"])
    if src == "hostfile":
        cluster = discovery.read_hostfile(o["hostfile"], machine_type=o.get("machine_type"))
    elif src == "outputs":
        cluster = discovery.read_outputs_file(o["outputs"], prefer_external=ext)
    elif src == "stack":
        cluster = discovery.read_stack(o["stack"], prefer_external=ext, directory=o.get("stack_dir"))
    else:
        cluster = _label_cluster(o, ext)
    _check_machine_type(cluster, "--machine-type" if o.get("machine_type") else _SOURCE_NAME[src](o))
    if o.get("controller"):
        host = o["controller"]
        cluster = replace(cluster, controller=ControllerHost(host=host, address=discovery.address_of(host)))
    if o.get("machine_type") and src != "hostfile":
        cluster = replace(cluster, machine_type=o["machine_type"])
        _check_machine_type(cluster, "--machine-type")
    exclude = tuple(h.strip() for h in (o.get("exclude") or "").split(",") if h.strip())
    return cluster.select(o.get("nodes"), exclude)


def _label_cluster(o: dict[str, Any], ext: bool) -> Cluster:
    labels = {}
    for pair in o["labels"]:
        k, sep, v = pair.partition("=")
        if not sep:
            raise UserError(f"--label {pair!r} is not KEY=VALUE")
        labels[k] = v
    if not o.get("project") or not o.get("zone"):
        raise UserError("--label needs --project and --zone")
    client = None
    if o.get("api_endpoint"):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import compute_v1

        client = compute_v1.InstancesClient(
            credentials=AnonymousCredentials(), transport="rest", client_options={"api_endpoint": o["api_endpoint"]}
        )
    return discovery.discover_by_label(
        labels, o["project"], o["zone"], client=client, machine_type=o.get("machine_type"), prefer_external=ext
    )


_SOURCE_NAME = {
    "hostfile": lambda o: f"hostfile {o['hostfile']}",
    "outputs": lambda o: str(o["outputs"]),
    "stack": lambda o: f"stack {o['stack']!r}",
    "labels": lambda o: "--label",
}


def _check_machine_type(cluster: Cluster, source: str) -> None:
    """The cluster's machine type is one the catalog knows, checked once here, before any command
    checks its workload against the nodes (their GPU count, the memory plan, the NICs): one line
    naming the source and the known types, never a traceback from the first code to look it up."""
    from gpufleet.catalog import UnknownMachineType, lookup

    if cluster.machine_type is None or cluster.local:
        return
    try:
        lookup(cluster.machine_type)
    except UnknownMachineType as e:
        known = str(e).partition("; ")[2]
        raise UserError(f"{source}: machineType {cluster.machine_type!r} is unknown; {known}") from None


def _ssh_options(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("-o"):
            v = v[2:].strip()
        key, sep, val = v.partition("=")
        if not sep and " " in v:
            key, _, val = v.partition(" ")
            sep = "="
        if not sep or not key.isalnum():
            raise UserError(f"--ssh-option {v!r} is not an OpenSSH Key=Value option")
        out.append(f"{key}={val}")
    return tuple(out)


def recover_request(o: dict[str, Any]) -> RecoverRequest:
    """--recover and its settings, as given (launcher.jobs.recovery.recover_policy checks them)."""
    return RecoverRequest(
        recover=bool(o.get("recover")),
        max_recoveries=o.get("max_recoveries"),
        recover_timeout=o.get("recover_timeout"),
        restart_stopped=o.get("restart_stopped"),
        no_restart_exit_codes=o.get("no_restart_exit_codes"),
        min_nodes=o.get("min_nodes"),
        api_endpoint=o.get("api_endpoint"),
        max_restarts=o.get("max_restarts"),
        spares=o.get("spares"),
    )


_SAID: set[str] = set()  # what this process said once already (the route to a cluster)
_LOGINS: dict[tuple, str] = {}  # the OS Login user this process read, by what it asked


def ssh_config(o: dict[str, Any], cluster: Cluster) -> SshConfig:
    """The ssh options from the CLI options: all a command that only reaches node 0 needs. The
    route (IAP or straight, launcher.cluster.reach) is said once; the user name comes from OS Login
    where the nodes use it (launcher.cluster.oslogin), unless --ssh-user or User= names one."""
    options = _ssh_options(o.get("ssh_options", ()))
    reach = decide_reach(cluster, o.get("iap"), bool(o.get("external_ip")), options)
    if reach.why and reach.why not in _SAID:
        _SAID.add(reach.why)
        click.echo(reach.why, err=True)
    ssh = SshConfig(
        user=o.get("ssh_user"),
        key=o.get("ssh_key"),
        options=options,
        known_hosts=o.get("known_hosts"),
        iap=reach.iap,
        zone=o.get("zone") or cluster.zone,
    )
    return oslogin_user(o, cluster, ssh)


def oslogin_user(o: dict[str, Any], cluster: Cluster, ssh: SshConfig) -> SshConfig:
    """`ssh` with the user OS Login knows this account by, and its key checked (or, with
    --register-key, added): for a cluster of Compute Engine instances (the stack's nodes turn OS
    Login on), when neither --ssh-user nor `--ssh-option User=` nor a `user@host` names the user.
    A dry run asks nothing, and says what it would log in as."""
    from launcher.cluster import oslogin

    if not oslogin.applies(cluster, ssh) or o.get("dry_run"):
        return ssh
    asked = (cluster.project, ssh.key, bool(o.get("register_key")), o.get("oslogin_endpoint"))
    if asked not in _LOGINS:  # once per command, however many times it builds its ssh options
        login = oslogin.login_user(asked[0], asked[1], register=asked[2], endpoint=asked[3])
        if login.added is not None:
            click.echo(f"added {login.added} to {login.account}'s OS Login profile", err=True)
        _LOGINS[asked] = login.user
    return replace(ssh, user=_LOGINS[asked])


def build_config(o: dict[str, Any], workload: Workload, cluster: Cluster) -> LaunchConfig:
    """Map the CLI options into a LaunchConfig (validation happens in the dataclasses). What can
    be refused offline is, before ssh_config asks OS Login anything."""
    image = o.get("image") or cluster.image
    if not image and cluster.boot_os == "cos" and workload.kind == "torchrun":
        # COS has no Python to build the job's environment with (the stack's `bootImage` says
        # what the nodes boot): torchrun's ranks can only run in a container image.
        raise UserError(
            f"the nodes of {cluster.name} boot Container-Optimized OS, which has no Python for the job: "
            "pass --image IMAGE (a container with torch), or set gpufleet:containerImage in the stack"
        )
    if image and o.get("python"):
        raise UserError(
            f"--image runs the image's own python3, so --python {o['python']!r} does not apply; "
            "drop --python (or drop --image to run it on the nodes themselves)"
        )
    ssh = ssh_config(o, cluster)
    hang = o.get("hang_timeout")  # a duration as --recover-timeout takes it, or off
    hang_timeout_s = None if hang in (None, HANG_OFF) else parse_duration(hang, "--hang-timeout")
    config = LaunchConfig(
        workload=workload,
        nproc_per_node=o.get("nproc_per_node"),
        max_restarts=o.get("max_restarts", 0),
        # --local without --rdzv-port takes a free port, so two local runs (or anything else
        # on 29500 here) never collide; on a cluster, torchrun's documented default.
        rdzv_port=o.get("rdzv_port") or (_free_port() if cluster.local else 29500),
        workdir=o.get("workdir"),
        env=parse_env_pairs(o.get("env", ()), o.get("env_file", ())),
        nccl_debug=o.get("nccl_debug", False),
        # The stack's bootImage names the OS; --image-os overrides it (None: the machine type's).
        image_os=o.get("image_os") or cluster.boot_os,
        # --local runs on this machine: the launcher's own interpreter has torch if workloads do.
        python=o.get("python") or (sys.executable if cluster.local and not image else "python3"),
        job_id=_job_id(o),
        runs_dir=o.get("runs_dir") or Path("runs"),
        dry_run=bool(o.get("dry_run")),
        ssh=ssh,
        rank_order=o.get("rank_order"),
        hang_timeout_s=hang_timeout_s,
        progress=parse_progress(o.get("progress"), hang_timeout_s),
        image=image or None,
        **({"stop_grace_s": _term_grace(o["term_grace"])} if o.get("term_grace") is not None else {}),
    )
    return replace(config, ssh=trusted_ssh(o, cluster, config.ssh))


def _job_id(o: dict[str, Any]) -> str:
    """A new job ID; a dry run's placeholder (or --job-id)."""
    given = o.get("dry_run_job_id")
    if given and not o.get("dry_run"):
        raise UserError("--job-id names the job ID a --dry-run shows; a real launch makes its own: drop --job-id")
    if not o.get("dry_run"):
        return new_job_id()
    from launcher.jobs.record import check_job_id

    return check_job_id(given) if given else DRY_RUN_JOB_ID


def trusted_ssh(o: dict[str, Any], cluster: Cluster, ssh: SshConfig) -> SshConfig:
    """`ssh` with how it checks the cluster's host keys, its known_hosts made ready before the
    first connection (launcher.cluster.host_keys.host_key_checking); a dry run reads nothing."""
    if o.get("dry_run") or cluster.local:
        return ssh
    from launcher.cluster.host_keys import host_key_checking

    return replace(ssh, host_key_checking=host_key_checking(cluster, ssh, o.get("api_endpoint")))


def _term_grace(text: str) -> float:
    from launcher.jobs.recovery import parse_duration

    return parse_duration(text, "--term-grace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_fanout(given: int | str | None, cluster: Cluster, detach: bool = False) -> int | None:
    """The fan-out a launch goes down its tree with, or None (the star): --fanout's K; off;
    without it, for an attached launch, DEFAULT_FANOUT above OUTPUT_ALL_UP_TO SSH nodes (where
    the star's cost to this machine starts to show, as --output's default turns to rank0), else
    the star. A detached job's controller, on the controller host inside the VPC, keeps the star
    unless --fanout is given."""
    if given == "off" or cluster.local:
        return None
    if given is not None:
        return int(given)
    return DEFAULT_FANOUT if len(cluster.nodes) > OUTPUT_ALL_UP_TO and not detach else None
