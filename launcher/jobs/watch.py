"""A detached job as `launch top` follows it, read from the job's record on node 0 (or the job
host) of its cluster (launcher.jobs.record): the job's nodes, ranked as in the job (`job_nodes`),
its state while the view runs (`JobWatch`), and the samples its controller took
(launcher.observe.job_metrics), copied here for `--plot JOB_ID` (`copy_samples`). Plain types
in, plain types out; the CLI (launcher.cli.cmd_top) parses the flags and renders.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from launcher.core.transport import Transport
from launcher.core.types import Cluster, Node, UserError
from launcher.jobs.goodput import goodput_of, summary
from launcher.jobs.node0 import Node0, job_host
from launcher.jobs.record import SAMPLES_FILE, JobRecord, samples_script
from launcher.observe.job_metrics import INTERVAL_S

__all__ = ["JobWatch", "copy_samples", "job_nodes"]


def job_nodes(cluster: Cluster, transport: Transport, job_id: str) -> Cluster:
    """`cluster` narrowed to the nodes of detached job `job_id`, ranked as in the job; a job that
    has ended, or one on nodes `cluster` does not name, is a UserError."""
    job = Node0(transport, job_host(cluster)).record(job_id)
    if job.state.final:
        raise UserError(
            f"job {job_id} has ended ({job.state.value}); `launch top --plot {job_id}` draws what "
            "its controller sampled"
        )
    by_host = {n.host: n for n in cluster.nodes}
    missing = [h for h in job.nodes if h not in by_host]
    if missing:
        raise UserError(
            f"job {job_id} runs on {', '.join(missing)}, which the node flags do not name; give the "
            "node flags the job was started with"
        )
    return replace(cluster, nodes=tuple(replace(by_host[h], rank=i) for i, h in enumerate(job.nodes)))


def copy_samples(cluster: Cluster, transport: Transport, job_id: str, runs_dir: Path) -> Path:
    """The samples job `job_id`'s controller took, copied from the job host to
    RUNS_DIR/JOB_ID/top.jsonl (as `launch logs` copies logs): the copy's path."""
    text = Node0(transport, job_host(cluster)).run(samples_script(job_id))
    if not text.strip():
        raise UserError(
            f"job {job_id} has no samples yet (its controller samples every {INTERVAL_S:g} s while it runs); "
            "try again later"
        )
    copy = runs_dir / job_id / SAMPLES_FILE
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text)
    return copy


class JobWatch:
    """Asks `head` (the job host) for a detached job's state every `every_s` seconds; `latest` is
    its latest record; `ended` is set, and `record` holds the job's record, once it has ended (the
    view of its nodes ends with it)."""

    def __init__(
        self,
        transport: Transport,
        head: Node,
        job_id: str,
        every_s: float = 5.0,
        on_nodes: Callable[[list[str]], None] | None = None,
    ):
        """`on_nodes(hosts)`: called with the job's nodes (its world, in rank order) at the first
        answer and whenever they change (a spare swapped in for a lost node)."""
        self.node0, self.job_id, self.every_s = Node0(transport, head), job_id, every_s
        self.on_nodes = on_nodes
        self._nodes: list[str] | None = None
        self.ended = threading.Event()
        self.record: JobRecord | None = None
        self.latest: JobRecord | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="top-job-watch")

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def goodput(self) -> str:
        """The job's goodput line for the view's title (empty until the job host has answered)."""
        return f"  {summary(goodput_of(self.latest))}" if self.latest else ""

    def _loop(self) -> None:
        while True:
            try:
                found = self.node0.records(self.job_id)
            except UserError:
                found = []  # the job host did not answer this time: the view goes on, as for any node
            if found:
                self.latest = found[0]
                if self.on_nodes and found[0].nodes != self._nodes:
                    self._nodes = list(found[0].nodes)
                    self.on_nodes(self._nodes)
            if found and found[0].state.final:
                self.record = found[0]
                self.ended.set()
                return
            if self._stop.wait(self.every_s):
                return
