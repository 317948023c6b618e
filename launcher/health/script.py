"""`launch doctor`'s node program (`node_script`): the read-only bash that reports on a node as
`key=value` lines. Pure: building it touches no network.

It only reads: it runs `nvidia-smi` queries, reads the kernel log, /sys/class/net, `docker ps`,
`df`, the ready marker and the metadata server, prints `key=value` lines and the launcher's
CHECKED_MARKER, then waits for end of input, like the check half of a launch
(launcher.core.program), so it rides the same SSH sessions. Nothing it runs writes a file. The
GPU, NIC and receive-datapath-manager statements are the pre-start check's own
(launcher.core.prestart), so a launch and `launch doctor` ask the same questions.

Test hooks, read on the node, each defaulting to the real thing: GCE_METADATA_HOST (the metadata
server's host:port, as google-auth honours it), GPUFLEET_READY_MARKER (the ready marker's path,
gpufleet.contracts.READY_MARKER) and GPUFLEET_LOCAL_SSD_MOUNT (the local-SSD RAID's mount point,
gpufleet.contracts.LOCAL_SSD_MOUNT for the image OS). The simulated nodes share one filesystem and
have no metadata server, so the tests give each node its own through these.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Sequence

from gpufleet.contracts import READY_MARKER
from gpufleet.nccl_env import PREPEND_PATH_VARS
from launcher.cluster.topology import metadata_statement
from launcher.core.prestart import Expectation, gpu_statement, nic_statements, rxdm_statement
from launcher.core.types import Node
from launcher.core.wire import CHECKED_MARKER, read_env_statements

__all__ = ["node_script"]

_READY_ENV = "GPUFLEET_READY_MARKER"
_LSSD_ENV = "GPUFLEET_LOCAL_SSD_MOUNT"


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        return False


def node_script(
    node: Node,
    expect: Expectation,
    python: str = "python3",
    workdir: str | None = None,
    env: Sequence[tuple[str, str]] = (),
) -> str:
    """The read-only bash program that reports on `node` as `key=value` lines, then prints
    CHECKED_MARKER and waits for end of input (one line: launcher.core.wire.join's form).
    `env` is the user's --env (launcher.core.program.stdin_env), exported first as a launch does,
    so `--env PATH=...` picks the same python3 here as in the run (PATH-like values are
    prepended): as in a launch, the values are read from stdin (launcher.core.wire.env_block,
    which the caller writes first), never put in the program."""
    q = shlex.quote
    s = [st for k, _ in env for st in read_env_statements(k, prepend=k in PREPEND_PATH_VARS)]
    s += [
        "echo host=$(hostname)",
        "echo time=$(date +%s.%N)",
        # The three slow probes (nvidia-smi, the interpreter, the metadata server) run at once, in
        # the background; the rest reads files meanwhile, and `wait` joins them before the marker.
        # Each line is one write of a few hundred bytes, so lines from different probes never mix
        # (POSIX: writes of at most PIPE_BUF bytes to a pipe are atomic).
        # GPUs, and the driver's CUDA version (launcher.core.prestart.gpu_statement).
        gpu_statement(cuda=True),
        # python and torch: torch's version from its dist-info directory on the interpreter's own
        # path, the first one found in sys.path order as importlib.metadata would find it, without
        # importing torch (seconds on a busy node) or importlib.metadata (a scan of every package).
        f"{q(python)} -c 'import sys, glob; print(\"python=\" + sys.version.split()[0]); "
        "d = [g for p in sys.path for g in sorted(glob.glob((p or \".\") + \"/torch-*.dist-info\"))]; "
        "print(\"torch=\" + (d[0].rsplit(\"/\", 1)[1][6:-10] if d else \"missing\"))' "
        "2>/dev/null || echo python=missing &",
        # Where the VM sits (launcher.cluster.topology.metadata_statement).
        f"{{ {metadata_statement()}; }} &",
        # XIDs since boot: the kernel log (dmesg needs root where kernel.dmesg_restrict=1; the
        # journal's kernel messages of this boot are the fallback).
        "if K=$(dmesg 2>/dev/null); then echo klog=dmesg; elif K=$(journalctl -k -b -q --no-pager 2>/dev/null); "
        "then echo klog=journal; else K=; echo klog=unreadable; fi",
        "printf '%s\\n' \"$K\" | grep -F 'NVRM: Xid' | tail -n 20 | awk '{print \"xid.\" n++ \"=\" $0}'",
    ]
    s += nic_statements(expect)
    if _is_ip(node.address):
        # The interface that holds the address we reached the node at (`ip -o` prints one line
        # per address: "2: eth0    inet 10.0.0.2/24 ...").
        s.append(
            f"echo addr_iface=$(ip -o addr show 2>/dev/null | awk -v a={q(node.address)} "
            "'{split($4,p,\"/\"); if (p[1]==a) {print $2; exit}}')"
        )
    if expect.rdma_devices:
        s.append("n=0; for d in /sys/class/infiniband/*; do [ -e \"$d\" ] && n=$((n+1)); done; echo rdma=$n")
    if expect.rxdm:
        # docker needs root or the docker group; sudo -n never asks for a password.
        s.append(rxdm_statement())
    if expect.plugin_dir:
        d = q(expect.plugin_dir)
        s.append(f"set -- {d}/libnccl-net*.so*; if [ -e \"$1\" ]; then echo plugin=$1; else echo plugin=missing; fi")
        # NCCL's version: the plugin installers put their own libnccl.so.2.X.Y next to the plugin
        # (infra/templates/*.sh nccl_version); else the libnccl2 package.
        s.append(
            f"v=; for f in {d}/libnccl.so.2.*; do [ -e \"$f\" ] && v=${{f##*/libnccl.so.}}; done; "
            "[ -n \"$v\" ] || v=$(dpkg-query -W -f='${Version}' libnccl2 2>/dev/null); echo nccl=$v"
        )
    # The ready marker the startup script writes last (gpufleet.contracts.READY_MARKER), and the
    # error file it leaves beside it when a boot failed (infra/templates/base.sh).
    s.append(
        f"M=${{{_READY_ENV}:-{q(READY_MARKER)}}}; if [ -f \"$M\" ]; then echo \"ready=$(head -c 4096 \"$M\" "
        "| tr -d '\\n')\"; else echo ready=missing; fi; "
        "if [ -f \"${M%/*}/startup-error.txt\" ]; then "
        "echo \"startup_error=$(head -n 1 \"${M%/*}/startup-error.txt\")\"; fi"
    )
    # Free space where the workload writes (its working directory) and on the local SSDs.
    wd = ("~/" + q(workdir[2:])) if workdir and workdir.startswith("~/") else q(workdir) if workdir else "~"
    s.append(f"echo disk.work=$(df -Pk {wd} 2>/dev/null | awk 'NR==2 {{print $4, $6}}')")
    if expect.local_ssd_mount:
        s.append(
            f"L=${{{_LSSD_ENV}:-{q(expect.local_ssd_mount)}}}; if mountpoint -q \"$L\"; then echo lssd=mounted; "
            "echo disk.lssd=$(df -Pk \"$L\" 2>/dev/null | awk 'NR==2 {print $4, $6}'); else echo lssd=not-mounted; fi; "
            "echo lssd_path=$L"
        )
    s += ["wait", f"echo {CHECKED_MARKER}", "IFS= read -r G", "exit 0"]
    # `a &; b` is a syntax error: a statement ending in `&` is already terminated.
    return " ".join(st if st.endswith("&") else st + ";" for st in s).rstrip(";")
