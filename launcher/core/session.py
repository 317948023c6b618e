"""One node's SSH session (or local bash under `--local`) for one launch.

The session carries the node-side program of launcher.core.program: its check half (`key=value`
facts up to CHECKED_MARKER), then, once told `go`, the workload's output, which it writes to the
node's log and reports line by line. It reports what it sees as `Report`s on the launch's queue,
from its reader threads; the `Launch` reading that queue is the only one that decides what
state the node is in (launcher.core.launch).
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import IO, NamedTuple, Protocol

from gpufleet.contracts import is_error_line
from launcher.core.access import diagnose
from launcher.core.output import Sorted, StreamSorter, shown_live
from launcher.core.preflight import Probe, clock_skew
from launcher.core.types import Node, NodeOutcome
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER

__all__ = ["Report", "NodeSession", "Tree"]


class Report(NamedTuple):
    """What a session's reader threads saw: `checked` (the check half is done), `line` (an
    output line for the live stream), `log` (a line of torchrun's own, kept in the node's log
    and out of the live stream), `traceback` (a user traceback, its lines joined by newlines:
    the launch shows it unless another rank's was shown) or `exit` (text: the transport's exit
    status)."""

    kind: str
    rank: int
    text: str = ""


class Tree(Protocol):
    """Sessions that one connection carries (launcher.code.launch_tree.TreeLaunch, `--fanout`):
    `start` sends every node's program and what it reads first; `proc(rank)` is then that
    node's session, shaped as an ssh process; `run_all` runs other programs to their end (a
    hang's stacks) down a tree of their own."""

    def start(self, scripts: Mapping[int, str], stdin: bytes) -> None: ...

    def proc(self, rank: int) -> subprocess.Popen: ...

    def run_all(self, scripts: Mapping[int, str], stdin: bytes, timeout: float) -> dict[int, tuple[str, str]]: ...


class NodeSession:
    """One node's session: the process, its output, and what its check found. `stdin`: what the
    program reads first (its --env values: launcher.core.program.env_stdin), written at once;
    it fits a pipe's buffer (launcher.core.wire.ENV_BLOCK_MAX), so the write never waits."""

    def __init__(
        self,
        node: Node,
        argv: list[str],
        reports: queue.Queue,
        stdin: bytes = b"",
        tunnel_log: Path | None = None,
        proc: subprocess.Popen | None = None,
    ):
        self.node = node
        self.tunnel_log = tunnel_log  # where its IAP tunnel writes why it could not open (transport.tunnel_log)
        self.facts: dict[str, str] = {}
        self.asked_at = time.time()  # with checked_at, the window for the clock-skew bound
        self.checked_at: float | None = None
        self.timed_out: float | None = None  # the check's timeout, when it ran out
        self.tail: deque[str] = deque(maxlen=20)
        self.err: deque[str] = deque(maxlen=5)
        self.error_lines: deque[str] = deque(maxlen=3)
        self.error_at: float | None = None  # when the first error line arrived
        self.marker: int | None = None
        self.start = time.monotonic()
        self.stop_sent_at: float | None = None
        self._log: IO[bytes] | None = None  # opened by go(): until then, output is the check's
        # A detached run's stream (launcher.core.supervise): bytes of the node's output read so
        # far, kept in a file after each line, from which a re-adopting controller resumes.
        self.offset = 0
        self._offset_fd: int | None = None
        self._offset_tag = 0
        self._reports = reports
        # `proc`: the session opened already (a tree launch's node, launcher.code.launch_tree),
        # else the transport's argv, run here.
        self.proc = proc or subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches only the launcher, which stops in order
        )
        if stdin:
            try:
                self.proc.stdin.write(stdin)
                self.proc.stdin.flush()
            except OSError:
                pass  # the transport has gone already: its exit report says so
        self._readers: list[threading.Thread] = []
        self._start_reading()

    def _start_reading(self) -> None:
        if hasattr(self.proc, "attach"):
            # A tree launch's node (launcher.code.launch_tree.TreeProc): its frames come to this
            # session from the one thread that reads node 0's, so a launch on N nodes runs no
            # reader threads or pipes per node (3N threads and 4N descriptors on a laptop).
            self._partial = {False: b"", True: b""}
            self._sorters = {False: StreamSorter(), True: StreamSorter()}
            self.proc.attach(self._data, self._ended)
            return
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, False, StreamSorter()), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, True, StreamSorter()), daemon=True),
        ]
        for t in self._readers:
            t.start()
        threading.Thread(target=self._reap, daemon=True).start()

    # ---- reader threads, or a tree's frames ----

    def _read(self, stream: IO[bytes], is_err: bool, sorter: StreamSorter) -> None:
        for raw in iter(stream.readline, b""):
            self._line(raw, is_err, sorter)
        self._report(sorter.flush(), is_err)

    def _line(self, raw: bytes, is_err: bool, sorter: StreamSorter) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if self._log is None:
            self._check_line(text, is_err)
        else:
            self._output_line(text, is_err, sorter, len(raw))

    def _data(self, is_err: bool, data: bytes) -> None:
        """Bytes of the node's stdout or stderr, as they came up the tree: each whole line read
        as a reader thread reads it."""
        *lines, self._partial[is_err] = (self._partial[is_err] + data).split(b"\n")
        for raw in lines:
            self._line(raw + b"\n", is_err, self._sorters[is_err])

    def _ended(self, rc: int) -> None:
        """The node's session ended (after its last bytes): a last line without its newline, as
        readline gives it, then what `_reap` does."""
        for is_err in (False, True):
            if self._partial[is_err]:
                self._line(self._partial[is_err], is_err, self._sorters[is_err])
                self._partial[is_err] = b""
            self._report(self._sorters[is_err].flush(), is_err)
        self._close(rc)

    def _check_line(self, text: str, is_err: bool) -> None:
        # The check half: facts on stdout (anything else there, e.g. a banner printed by the
        # login shell, is not ours); stderr kept for the error message.
        if is_err:
            self.err.append(text)
        elif text == CHECKED_MARKER:
            self.checked_at = time.time()
            self._reports.put(Report("checked", self.node.rank))
        else:
            key, eq, value = text.partition("=")
            if eq:
                self.facts[key] = value

    def _output_line(self, text: str, is_err: bool, sorter: StreamSorter, size: int = 0) -> None:
        if not is_err and EXIT_MARKER in text:
            before, _, after = text.partition(EXIT_MARKER)
            try:
                self.marker = int(after.split()[0])
            except (ValueError, IndexError):
                pass
            if not before:
                return
            text = before
        self._log.write(text.encode() + b"\n")
        self._log.flush()
        if self._offset_fd is not None and not is_err:
            self.offset += size
            # One pwrite of a fixed-width line: a controller killed at any moment leaves a whole one.
            os.pwrite(self._offset_fd, f"{self._offset_tag:06d} {self.offset:020d}\n".encode(), 0)
        if shown_live(text):
            self._report(sorter.feed(text), is_err)

    def _report(self, pieces: list[Sorted], is_err: bool) -> None:
        for kind, text in pieces:
            if kind != "log":
                for line in text.split("\n"):
                    self.tail.append(line)
                    if is_err:
                        self.err.append(line)
                    if is_error_line(line):
                        self.error_lines.append(line)
                        if self.error_at is None:
                            self.error_at = time.monotonic()
            self._reports.put(Report("line" if kind == "live" else kind, self.node.rank, text))

    def _reap(self) -> None:
        rc = self.proc.wait()
        for t in self._readers:
            t.join()
        self._close(rc)

    def _close(self, rc: int) -> None:
        if self._log is not None:
            self._log.close()
        if self._offset_fd is not None:
            os.close(self._offset_fd)
        self._reports.put(Report("exit", self.node.rank, str(rc)))

    # ---- what the launch asks of it ----

    def probe(self) -> Probe:
        """What the check half found. A node that exited after its check has a reason in its
        facts (a busy rendezvous port) or is as good as unreachable."""
        rc = self.proc.poll()
        busy = self.facts.get("port", "").startswith("busy")
        if self.checked_at is None or (rc is not None and not busy):
            if self.timed_out is not None:
                why = f"no answer within {self.timed_out:.0f} s"
            else:
                why = self.err[-1] if self.err else f"exit {rc}" if rc is not None else "no answer"
            return Probe(self.node, False, why, access=diagnose([*self.err, *self._tunnel_errors()]))
        return Probe(
            self.node, True, facts=dict(self.facts), skew_s=clock_skew(self.facts, self.asked_at, self.checked_at)
        )

    def _tunnel_errors(self) -> list[str]:
        try:
            return self.tunnel_log.read_text(errors="replace").splitlines()[-5:] if self.tunnel_log else []
        except OSError:
            return []

    def go(self, logfile: Path, offset_file: Path | None = None, tag: int = 0, offset: int = 0) -> None:
        """Start the workload: the node has passed its check and every other node has too.
        `offset_file`: a detached run's, where the bytes read so far (from `offset` on) are kept
        after each line, tagged with `tag` (the attempt) (launcher.core.supervise)."""
        if offset_file is not None:
            self.offset, self._offset_tag = offset, tag
            self._offset_fd = os.open(offset_file, os.O_WRONLY | os.O_CREAT, 0o600)
            os.pwrite(self._offset_fd, f"{tag:06d} {offset:020d}\n".encode(), 0)
        self._log = open(logfile, "ab")
        self.start = time.monotonic()
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the connection is gone: its exit report says so

    def cancel(self) -> None:
        """Before `go`: end the session without running anything. A node still in its
        handshake is cut off (nothing runs there yet); one waiting for `go` reads end of input
        and exits."""
        if self.checked_at is None:
            self.force()
        self._close_stdin()

    def request_stop(self, grace_line: bytes = b"") -> None:
        """After `go`: close stdin; the node-side watchdog reads EOF and stops the tree.
        `grace_line` (launcher.core.wire.grace_line), written first, is this stop's own grace."""
        if self.stop_sent_at is None:
            self.stop_sent_at = time.monotonic()
            if grace_line:
                try:
                    self.proc.stdin.write(grace_line)
                    self.proc.stdin.flush()
                except (OSError, ValueError):
                    pass  # the connection is gone: its exit report says so
            self._close_stdin()

    def force(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def _close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def outcome(self, transport_rc: int) -> NodeOutcome:
        """What happened on the node, once its session has ended with `transport_rc`."""
        stopping = self.stop_sent_at is not None
        o = NodeOutcome(
            self.node,
            duration_s=time.monotonic() - self.start,
            stopped=stopping,
            tail=list(self.tail),
            error_lines=list(self.error_lines),
        )
        o.reported_error_before_stop = self.error_at is not None and (
            self.stop_sent_at is None or self.error_at <= self.stop_sent_at
        )
        # The trailing blank line the wrapper prints before its marker is not output.
        if o.tail and o.tail[-1] == "":
            o.tail.pop()
        # A tree's node (launcher.code.launch_tree.TreeProc) that the tree lost, or cut off with the
        # node that passed the launch on to it: lost whether or not a stop was on its way.
        lost_via = getattr(self.proc, "lost_via", None)
        if self.marker is not None:
            o.exit_code = self.marker
        elif lost_via is not None:  # lost, not stopped, whichever of its exit and the stop came first
            o.connection_lost, o.exit_code, o.stopped = True, transport_rc, False
            o.cut_off_by = None if lost_via == self.node.rank else lost_via
            o.error = self.err[-1] if self.err else "the tree lost it"
        elif transport_rc != 255 or stopping:
            # No marker but no transport error either: the wrapper itself failed to start, or
            # we stopped a node whose connection we then cut.
            o.exit_code = transport_rc
        else:
            o.connection_lost = True
            o.exit_code = transport_rc
            o.error = self.err[-1] if self.err else "the connection closed without an exit status"
        return o
