"""Putting --image on every node before a launch: one pull per node, every node at once, each
node's progress handed to a callback as it comes, and one verdict per node
(launcher.core.container.pull_script renders what runs there). Stdlib only.

A node where the image is already current (same digest) pulls nothing: the runtime's pull asks
the registry for the manifest and fetches no layer it has (a digest-pinned image already there
is not even asked about). A node that cannot pull (the image does not exist, the registry
refuses, no runtime) fails the launch before anything starts, with the registry's own reason.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launcher.core.container import parse_pull_line, pull_script
from launcher.core.transport import Transport
from launcher.core.types import Cluster, Node, UserError
from launcher.core.wire import env_block

__all__ = ["PullFailed", "Pulled", "pull_image", "refusal"]


@dataclass(frozen=True)
class Pulled:
    """One node's pull: `status` "pulled" (layers fetched), "present" (current already),
    "local" (the pull failed, the copy already there is used: `note` says why) or "error"
    (`note` the reason); `image_id` the image the node will run."""

    node: Node
    status: str
    image_id: str
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "error"


class PullFailed(UserError):
    """Some node cannot pull the image: str() is the one-line summary; `lines` one line per
    failed node, with the registry's reason."""

    def __init__(self, summary: str, lines: list[str]):
        super().__init__(summary)
        self.lines = lines


OnProgress = Callable[[Node, str], None]


def pull_image(
    cluster: Cluster,
    image: str,
    transport: Transport,
    on_progress: OnProgress | None = None,
    stop: threading.Event | None = None,
    env: Sequence[tuple[str, str]] = (),
) -> dict[int, Pulled]:
    """Pull `image` on every node of `cluster` at once; by rank, what each did. `stop` set, or
    an exception here (Ctrl-C), ends every pull still going."""
    script = pull_script(image, env)
    block = env_block(list(env))
    results: dict[int, Pulled] = {}
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()

    def one(node: Node) -> None:
        proc = subprocess.Popen(
            transport.argv(node, script),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with lock:
            procs.append(proc)
        assert proc.stdin is not None
        try:  # the --env values, on stdin (never on a command line)
            proc.stdin.write(block)
            proc.stdin.close()
        except OSError:
            pass  # the session ended already: its output says why
        results[node.rank] = _read_pull(node, proc, on_progress, stop)

    def kill_all() -> None:
        with lock:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in cluster.nodes]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)
            if stop is not None and stop.is_set():
                kill_all()
    except BaseException:  # Ctrl-C: no pull outlives the launcher (they run in sessions of their own)
        kill_all()
        raise
    return dict(sorted(results.items()))


def _read_pull(
    node: Node, proc: subprocess.Popen[bytes], on_progress: OnProgress | None, stop: threading.Event | None
) -> Pulled:
    """One node's pull output: progress lines to `on_progress`, then its verdict."""
    verdict, last = None, ""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        parsed = parse_pull_line(line)
        if parsed is not None:
            verdict = parsed
        elif line.strip():
            last = line.strip()
            if on_progress is not None:
                on_progress(node, last)
    rc = proc.wait()
    if verdict is None:  # the session itself failed (ssh's own message), or we stopped it
        why = "interrupted" if stop is not None and stop.is_set() else (last or f"exit {rc}")
        verdict = ("error", "", why)
    return Pulled(node, *verdict)


def refusal(image: str, pulled: dict[int, Pulled]) -> PullFailed | None:
    """None when every node has the image; else the error to stop on (one line per failed node)."""
    bad = [p for p in pulled.values() if not p.ok]
    if not bad:
        return None
    return PullFailed(
        f"{len(bad)} of {len(pulled)} nodes cannot pull {image}; nothing was started. Check the image name "
        "and that the nodes may read its registry (docs/containers.md)",
        [f"{p.node.label}: cannot pull {image}: {p.note}" for p in bad],
    )
