"""Every worker's Python stack on every node at once, and the verdict they give on a hang.

`collect` runs one program per node (`collect_script`: launcher.core.node_run's `stacks`, in
Python, with a small spec as JSON), all nodes in parallel, over the launch's own transport (the
SSH ControlMaster connections its sessions opened, or bash for `--local`). On the node the
program finds the job's workers by the `GPUFLEET_RUN` token the run half put in their
environment (launcher.core.program): of the processes carrying it, the workers are the ones with
a RANK (torchrun's agent has none) whose parent has none (a DataLoader worker forked from a rank
inherits it). It dumps each with `py-spy dump` (every worker of the node in parallel) and prints
the dumps between marker lines, then any flight-recorder dumps of an NCCL job
(launcher.core.hang.flight_recorder_env), which it first asks every rank to write.

py-spy comes from beside the nodes' python (gpufleet[workloads] has it), else from the tools
environment launcher.code builds on a node whose job environment lacks it (`PYSPY_TOOLS`, a
user's --sync requirements), else from PATH. The launch's --env PATH, which decides the python,
travels on the program's stdin (`collect_stdin`), as the run's --env values do: never in argv.

A dump is Python frames only (about 0.1 s a process); a rank whose main thread is not in
torch.distributed's Python is dumped again, in the same program, with `--native` (seconds: py-spy
unwinds the C++ frames too), because a rank blocked in `work.wait()` shows no Python frame of
torch.distributed, only `c10d::Work::wait` below the caller's line.

Parsing, classifying (`classify`) and the verdict (`verdict`) are pure functions over py-spy's
text, so the attached CLI and the detached controller (which run the same Launch) say the same.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shlex
import subprocess
import time
from collections import Counter
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from launcher.core.hang import flight_recorder_prefix
from launcher.core.program import node_run_command
from launcher.core.session import Tree
from launcher.core.transport import Transport
from launcher.core.types import Cluster, Hang, LaunchConfig, Node
from launcher.core.wire import env_block, run_token

__all__ = [
    "STACK_MARKER",
    "Frame",
    "Place",
    "RankStack",
    "NodeStacks",
    "PYSPY_VERSION",
    "PYSPY_TOOLS",
    "collect_script",
    "collect_stdin",
    "parse_node_output",
    "main_thread_frames",
    "classify",
    "verdict",
    "collect",
]

log = logging.getLogger("launcher")

STACK_MARKER = "__GPUFLEET_STACK__"  # `MARKER rank pid status`, then that rank's dump
_FR_MARKER = "__GPUFLEET_FR__"  # `MARKER rank base64`: one rank's flight-recorder dump
_NO_PYSPY = "__GPUFLEET_NO_PYSPY__"
_END = "__GPUFLEET_STACKS_END__"
# How long one py-spy may take on a node, and the whole collection from the launcher's side.
_DUMP_TIMEOUT_S = 30
_COLLECT_TIMEOUT_S = 90
# The py-spy a node gets when its job's environment has none (launcher.code.prepare asks the node
# agent to build it, with uv, from the job's own package index), at $HOME/PYSPY_TOOLS/bin/py-spy:
# one directory per pinned version, so it is built once per node. Its wheels are manylinux
# binaries that need no particular Python (https://pypi.org/project/py-spy/#files).
PYSPY_VERSION = "0.4.3"
PYSPY_TOOLS = f".gpufleet/tools/py-spy-{PYSPY_VERSION}"


# ---- the node-side program ----


def _path(config: LaunchConfig) -> str | None:
    return dict(config.env).get("PATH")


def collect_stdin(config: LaunchConfig) -> bytes:
    """What `collect_script`'s program reads on stdin first: the launch's PATH, when it has one
    (launcher.core.wire.env_block)."""
    path = _path(config)
    return env_block([("PATH", path)]) if path is not None else b""


def collect_script(config: LaunchConfig, node: Node, fr: bool = False) -> str:
    """The node-side program (launcher.core.node_run's `stacks`, one line) that prints the stacks
    of the job's workers on `node` and, with `fr`, their flight-recorder dumps; it reads
    `collect_stdin(config)` first. No --env value is in it: a --env PATH travels on stdin."""
    spec = {
        "token": run_token(config.job_id, node.rank),
        "python": config.python,
        "read_path": _path(config) is not None,
        "tools": PYSPY_TOOLS,
        "timeout": _DUMP_TIMEOUT_S,
        "fr_prefix": flight_recorder_prefix(config.job_id) if fr else None,
    }
    return node_run_command(f"stacks {shlex.quote(json.dumps(spec))}")


# ---- what came back ----


@dataclass
class RankStack:
    """One worker's dump: `text` is py-spy's output (or its error, when `ok` is false)."""

    node: Node
    rank: int  # the global rank (RANK)
    pid: int
    ok: bool
    text: str
    status: int = 0  # py-spy's exit status (124: it timed out)


@dataclass
class NodeStacks:
    """What one node's program returned."""

    node: Node
    ranks: list[RankStack] = field(default_factory=list)
    flight_recorder: dict[int, bytes] = field(default_factory=dict)  # by global rank
    error: str = ""  # why nothing (or not everything) came back


def parse_node_output(node: Node, text: str) -> NodeStacks:
    """`collect_script`'s output as the ranks' dumps (and flight-recorder files)."""
    out = NodeStacks(node)
    current: RankStack | None = None
    lines: list[str] = []

    def close() -> None:
        if current is not None:
            current.text = "\n".join(lines).strip("\n") + "\n"
            out.ranks.append(current)

    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head in (STACK_MARKER, _FR_MARKER, _NO_PYSPY, _END):
            close()
            current, lines = None, []
        if head == STACK_MARKER:
            rank, pid, status = rest.split()
            current = RankStack(node, int(rank), int(pid), status == "0", "", int(status))
        elif head == _FR_MARKER:
            rank, _, data = rest.partition(" ")
            out.flight_recorder[int(rank)] = base64.b64decode(data)
        elif head == _NO_PYSPY:
            out.error = (
                "py-spy is not installed beside the nodes' python, nor on PATH: pip install py-spy there (gpufleet "
                "builds it on the nodes where it builds the job's environment)"
            )
        elif current is not None:
            lines.append(line)
    close()
    if not out.error and not out.ranks:
        out.error = "no worker of the job found (they had exited, or not started)"
    return out


@dataclass(frozen=True)
class Frame:
    """One frame of a py-spy dump: Python (`file`, `line`) or native (`file` is the library)."""

    function: str
    file: str
    line: int | None = None

    @property
    def native(self) -> bool:
        return not (self.file.endswith(".py") or self.file.startswith("<"))

    def __str__(self) -> str:
        where = self.file.rsplit("/", 1)[-1] + (f":{self.line}" if self.line is not None else "")
        return f"{self.function} ({where})"


# `    function (file:line)` or `    function (library)`; a C++ name may hold parentheses itself.
_FRAME_RE = re.compile(r"^\s+(?P<fn>.+) \((?P<loc>[^()]*)\)\s*$")
_THREAD_RE = re.compile(r'^Thread (?P<id>\S+) \([^)]*\)(?::\s*"(?P<name>[^"]*)")?')


def main_thread_frames(dump: str) -> list[Frame]:
    """The frames of the dump's main thread (the one named MainThread, else the first),
    innermost first, as py-spy prints them."""
    threads: list[tuple[str, list[Frame]]] = []
    for line in dump.splitlines():
        t = _THREAD_RE.match(line)
        if t:
            threads.append((t.group("name") or "", []))
            continue
        f = _FRAME_RE.match(line)
        if f and threads:
            file, _, num = f.group("loc").rpartition(":")
            if file and num.isdigit():
                threads[-1][1].append(Frame(f.group("fn"), file, int(num)))
            else:
                threads[-1][1].append(Frame(f.group("fn"), f.group("loc")))
    if not threads:
        return []
    named = [frames for name, frames in threads if name == "MainThread"]
    return named[0] if named else threads[0][1]


@dataclass(frozen=True)
class Place:
    """Where a rank's main thread is: in a collective (`collective`: its name, e.g. all_reduce)
    or not; `frames`: the user's frames from where it waits outwards."""

    in_collective: bool
    collective: str = ""
    frames: tuple[Frame, ...] = ()

    def at(self, depth: int = 2) -> str:
        return " <- ".join(str(f) for f in self.frames[:depth]) or "an unknown place"


# torch.distributed's own Python (distributed_c10d.py, c10d_logger.py, functional collectives,
# FSDP's); not the elastic agent's code a worker's @record wraps it in, nor checkpoint file I/O.
_COLLECTIVE_PY = re.compile(r"(^|/)torch/distributed/(?!elastic/|checkpoint/)")
# Native frames of c10d, NCCL and gloo (py-spy --native): `c10d::Work::wait`, `ncclAllReduce`.
_COLLECTIVE_NATIVE = re.compile(r"\bc10d::|\bgloo::|nccl", re.IGNORECASE)


def _native_name(function: str) -> str:
    """`c10d::ProcessGroupGloo::AsyncWork::wait(...)` -> `wait`."""
    return re.split(r"[(<]", function, maxsplit=1)[0].rsplit("::", 1)[-1]


def classify(dump: str) -> Place:
    """Whether the dump's main thread waits in a collective. From the innermost frame outwards,
    native frames that are not c10d/NCCL/gloo (libc, pthread, the interpreter) are passed over;
    the first frame that is either torch.distributed's or the user's decides."""
    frames = main_thread_frames(dump)
    for i, f in enumerate(frames):
        collective = (f.native and _COLLECTIVE_NATIVE.search(f.function)) or (
            not f.native and _COLLECTIVE_PY.search(f.file)
        )
        if collective:
            name = _native_name(f.function) if f.native else f.function
            return Place(True, name, tuple(_users(frames[i:])))
        if not f.native:
            return Place(False, "", tuple(_users(frames[i:])))
    return Place(False, "", ())


def _users(frames: list[Frame]) -> list[Frame]:
    """The Python frames that are not torch.distributed's (the user's call sites)."""
    return [f for f in frames if not f.native and not _COLLECTIVE_PY.search(f.file)]


# ---- the verdict ----


def _who(s: RankStack) -> str:
    return f"{s.node.label} rank {s.rank}"


def _collective_part(waiting: list[tuple[RankStack, Place]], everyone: bool) -> tuple[str, list[RankStack]]:
    """What the ranks in collectives say, and the ranks it names: where every rank waits,
    the one(s) whose collective (or call site) differs from the most common."""
    sig = Counter((p.collective, p.at(1)) for _, p in waiting)
    names = Counter(p.collective for _, p in waiting)
    if not everyone:
        n = len(waiting)
        ranks = f"{n} rank{'s' * (n != 1)} wait{'s' * (n == 1)}"
        if len(names) == 1:
            return f"{ranks} in {waiting[0][1].collective}", []
        return f"{ranks} in collectives: " + ", ".join(f"{k} in {c}" for c, k in names.most_common()), []
    if len(sig) == 1:
        (coll, site), n = sig.most_common(1)[0]
        return (
            f"every rank ({n}) waits in {coll} at {site}: none is missing from it, so the collective itself is "
            "stuck (a lost peer or the network; see the flight recorder's dumps on NCCL jobs)",
            [],
        )
    (common, common_n), *_ = sig.most_common()
    odd = [(s, p) for s, p in waiting if (p.collective, p.at(1)) != common]
    shown = "; ".join(f"{_who(s)} waits in {p.collective} at {p.at(1)}" for s, p in odd[:3])
    more = f" and {len(odd) - 3} more ranks elsewhere" if len(odd) > 3 else ""
    return (
        f"every rank waits in a collective, but not the same one: {shown}{more}, while {common_n} "
        f"rank{'s' * (common_n != 1)} wait{'s' * (common_n == 1)} in {common[0]} at {common[1]}",
        [s for s, _ in odd],
    )


def _no_stack_why(s: RankStack) -> str:
    """Why py-spy gave no stack of `s`: its error line (it may come before the header it printed
    to stdout: `Process N: ...`, `Python v3.11.2 (...)`), that it timed out, or its last line."""
    lines = [ln.strip() for ln in s.text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    if errors:
        return errors[0]
    if s.status == 124:
        return f"py-spy got no stack in {_DUMP_TIMEOUT_S} s (the process is stopped, or stuck in the kernel)"
    return lines[-1] if lines else f"py-spy exit {s.status}"


def verdict(silent_s: float, nodes: list[NodeStacks], stacks_dir: str) -> tuple[str, list[RankStack]]:
    """The one line that names the culprit, and the ranks it names: ranks outside every
    collective first (up to 3, with where they are), then what the others wait in, then the
    ranks or nodes that gave no stack. Named, in that order: the ranks outside any collective,
    the ranks whose stack could not be read (a stopped, dying or unreadable process: the others
    wait for it), and only when every rank's stack was read, the one in another collective."""
    placed = [(s, classify(s.text)) for n in nodes for s in n.ranks if s.ok]
    failed = sorted((s for n in nodes for s in n.ranks if not s.ok), key=lambda s: s.rank)
    outside = sorted(((s, p) for s, p in placed if not p.in_collective), key=lambda sp: sp[0].rank)
    waiting = sorted(((s, p) for s, p in placed if p.in_collective), key=lambda sp: sp[0].rank)
    parts, named = [], [s for s, _ in outside] + failed
    for s, p in outside[:3]:
        parts.append(f"{_who(s)} is outside any collective at {p.at()}")
    if len(outside) > 3:
        parts.append(f"{len(outside) - 3} more ranks are outside any collective")
    if waiting:
        # A rank whose stack is missing may be the one the others wait for: then "every rank
        # waits" is not known, and a waiting rank at another call site is not the culprit.
        text, odd = _collective_part(waiting, everyone=not outside and not failed)
        parts.append(text)
        named += odd
    for s in failed[:3]:
        parts.append(f"no stack from {_who(s)}: {_no_stack_why(s)}")
    for n in nodes:
        if n.error:
            parts.append(f"{n.node.label}: {n.error}")
    if not placed:
        parts.insert(0, "no stack could be read")
    return f"hang: no progress for {silent_s:.0f} s; " + "; ".join(parts) + f"; stacks: {stacks_dir}/", named


# ---- collecting ----


def _run(transport: Transport, node: Node, script: str, stdin: bytes) -> tuple[str, str]:
    """(stdout, error) of one node's program, `stdin` written to it."""
    try:
        r = subprocess.run(transport.argv(node, script), capture_output=True, timeout=_COLLECT_TIMEOUT_S, input=stdin)
    except subprocess.TimeoutExpired:
        return "", f"no answer within {_COLLECT_TIMEOUT_S} s"
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    if _END not in out:
        return out, (err.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return out, ""


def _gather(
    transport: Transport, scripts: dict[Node, str], stdin: bytes, tree: Tree | None = None
) -> dict[Node, NodeStacks]:
    """Every node's program at once (each reads `stdin` first); what each returned. `tree`: the
    launch's (launcher.core.session.Tree, --fanout), which carries them down a tree of their own."""
    if tree is not None:
        by_rank = tree.run_all({n.rank: s for n, s in scripts.items()}, stdin, _COLLECT_TIMEOUT_S)
        answers = {node: by_rank[node.rank] for node in scripts}
    else:
        with ThreadPoolExecutor(max_workers=min(64, len(scripts)) or 1) as pool:
            futures = {node: pool.submit(_run, transport, node, script, stdin) for node, script in scripts.items()}
        answers = {node: fut.result() for node, fut in futures.items()}
    out = {}
    for node, (text, error) in answers.items():
        if error == "" and _END not in text:
            error = "its program ended before it was done"
        out[node] = parse_node_output(node, text)
        if error and not out[node].ranks:
            out[node].error = f"could not collect stacks: {error}"
    return out


def _write(dest: Path, nodes: list[NodeStacks]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for n in nodes:
        for s in n.ranks:
            (dest / f"node-{n.node.rank}-rank-{s.rank}.txt").write_text(s.text)
        for rank, data in n.flight_recorder.items():
            (dest / f"node-{n.node.rank}-nccl_trace_rank_{rank}").write_bytes(data)


def collect(
    cluster: Cluster,
    config: LaunchConfig,
    transport: Transport,
    silent_s: float,
    nodes: Collection[int] | None = None,
    flight_recorder: bool = False,
    tree: Tree | None = None,
) -> Hang:
    """Collect the stacks of the job's workers on `nodes` (node ranks; default all), write
    them to `<run dir>/stacks/node-<i>-rank-<r>.txt` (with the flight-recorder dumps), and
    return the verdict. `tree`: the launch's tree (--fanout), which the collection goes down too."""
    chosen = [n for n in cluster.nodes if nodes is None or n.rank in nodes]
    t0 = time.monotonic()
    scripts = {n: collect_script(config, n, fr=flight_recorder) for n in chosen}
    got = _gather(transport, scripts, collect_stdin(config), tree)
    log.info(
        "stacks of %d ranks on %d nodes in %.1f s",
        sum(len(ns.ranks) for ns in got.values()),
        len(chosen),
        time.monotonic() - t0,
    )
    dest = config.run_dir / "stacks"
    found = [got[n] for n in chosen]
    _write(dest, found)
    line, named = verdict(silent_s, found, str(dest))
    return Hang(line, node=named[0].node.rank if named else None, stacks_dir=dest)
