"""The node-local checkpoint tier (--local-checkpoint-every): every rank writes its own DCP
checkpoint to a directory on its node, in the layout of gpufleet.local_tier (the contract a peer
replicator and a user's own script share), and reads it back, or a verified peer copy, on resume.

A save blocks training only while the state is copied off the device (torch.distributed.checkpoint's
`async_save` with a blocking stager, as the durable tier's --async-checkpoint); the files are
written, hashed into the manifest and the old steps pruned in DCP's writer thread. A save still in
flight when the next one is due is waited for, never overlapped. Each rank's checkpoint is its own
(`no_dist`: no collective, no file of another rank), so a node's disk holds everything its ranks
need, and a rank restores only what its own rank wrote on a run of the same world size.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from gpufleet.contracts import LOCAL_SSD_MOUNT
from gpufleet.local_tier import (
    COPIES_VAR,
    ENV_VAR,
    MANIFEST,
    OWN,
    PEER,
    LocalTierError,
    check_private,
    complete_steps,
    forget_after,
    rank_dir,
    read_manifest,
    verify,
    was_sent,
    write_manifest,
)
from workloads.checkpoint.safe import SafeLoadPlanner, metadata_problem
from workloads.checkpoint.store import CheckpointError, failure_line
from workloads.collective import Ranks, every_rank
from workloads.config import ConfigError
from workloads.metrics import format_bytes

__all__ = ["LocalTier", "JOB_VAR", "local_root", "on_local_ssd"]

JOB_VAR = "GPUFLEET_JOB_ID"  # launcher.core.wire.JOB_ID_VAR: the same on every attempt of a job
_NO_JOB = "run"  # the job directory of a run not started by gpufleet's launch
# The longest a save waits for the previous one's copy to a peer node (gpufleet.replica's sender
# passes over a peer that cannot be reached and copies to the next one within seconds): seconds,
# from COPY_WAIT_VAR when set.
COPY_WAIT_VAR = "GPUFLEET_LOCAL_COPY_WAIT_S"
COPY_WAIT_S = 120.0
# DCP warns that a no_dist save "assumes the intent is to save in a single process": it is ours.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def local_root(given: str | None, environ: dict[str, str] | None = None) -> Path:
    """The tier's root on this node: --local-checkpoint-dir, else $GPUFLEET_LOCAL_CHECKPOINT_DIR,
    checked to be this account's own (gpufleet.local_tier.check_private). ConfigError otherwise."""
    env = os.environ if environ is None else environ
    path, flag = (given, "--local-checkpoint-dir") if given else (env.get(ENV_VAR), ENV_VAR)
    if not path:
        raise ConfigError(
            f"--local-checkpoint-every needs a node-local directory: pass --local-checkpoint-dir DIR, "
            f"or launch with gpufleet's `launch`, which sets {ENV_VAR} on every node"
        )
    try:
        return check_private(path, flag=flag)
    except LocalTierError as e:
        raise ConfigError(str(e)) from None


def _same_dir(root: Path, given: str | None) -> bool:
    """Whether the tier's root is the directory the replicator copies from ($GPUFLEET_LOCAL_CHECKPOINT_DIR):
    a run given another --local-checkpoint-dir writes where no copy is made, and waits for none."""
    try:
        return given is not None and root.resolve() == Path(given).resolve()
    except OSError:
        return False


def _seconds(var: str, default: float) -> float:
    """A number of seconds from the environment variable `var`; ConfigError when it is not one."""
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{var}={raw!r} is not a number of seconds; unset it or pass one like 120")
    return value


@dataclass
class _Save:
    """This rank's local save under way."""

    step: int
    where: Path
    future: Future
    started: float
    blocked_s: float
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    nbytes: int = 0  # this rank's files


class _ReusedHostCopy(BlockingAsyncStager):
    """BlockingAsyncStager's cached host copy (torch/distributed/checkpoint/staging.py), on CPU
    runs too, where torch's pins it and so needs an accelerator: one copy of the state made at
    the first save and refilled in place at each later one. Fresh memory at every save costs a
    page fault per 4 KiB page of the state, seconds for GBs on the step that waits for it. Safe to
    reuse: a save starts only after the previous one finished writing (LocalTier.wait)."""

    def __init__(self, pin: bool) -> None:
        super().__init__(cache_staged_state_dict=True)
        self.pin = pin

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self.pin)
        # Tensors are copied into the cache; other values (the trainer's bytes) are this save's own.
        return _copy_state_dict(state_dict, self.state_dict_cache, type_check=False)


class LocalTier:
    """This rank's part of the local tier. Collective where said: every rank calls it alike."""

    def __init__(self, given: str | None, keep: int, ranks: Ranks) -> None:
        self.ranks, self.keep = ranks, keep
        # Each node checks its own directory: a bad one stops every rank before the model is built.
        self.root, self.copy_wait_s = ranks.on_every_rank(
            lambda: (local_root(given), _seconds(COPY_WAIT_VAR, COPY_WAIT_S))
        )
        self.job = os.environ.get(JOB_VAR) or _NO_JOB
        self._warn_boot_disk()
        # DCP needs a CPU group even for a save without collectives (async_save checks it).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
        self.stager = _ReusedHostCopy(pin=ranks.device.type == "cuda")
        self._pending: _Save | None = None
        self.saved_step: int | None = None  # the step of this run's newest save, done or under way
        # Under gpufleet.replica's sidecar: each step's copy to a peer node is waited for before the
        # next save, and the newest step whose copies are out for every rank is never pruned.
        self.copies = os.environ.get(COPIES_VAR) == "1" and _same_dir(self.root, os.environ.get(ENV_VAR))
        self.pinned: int | None = None
        self._copies_late = False

    @property
    def where(self) -> Path:
        return self.root / self.job

    def _warn_boot_disk(self) -> None:
        """Collective: one warning line when some node has no local SSD under the tier, with
        the free space of the boot disk that holds it instead."""
        free = shutil.disk_usage(self.root).free
        here = (socket.gethostname(), on_local_ssd(self.root), free)
        said: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(said, here)
        boot = {host: size for host, ssd, size in said if not ssd}
        if boot:
            host, size = min(boot.items(), key=lambda kv: kv[1])
            nodes = len({host for host, _, _ in said})
            self.ranks.log(
                f"warning: no local SSD under the local checkpoint tier on {len(boot)} of {nodes} nodes: it is on "
                f"the boot disk ({host}: {self.root}, {format_bytes(size)} free)",
                stream=sys.stderr,
            )

    # ---- save ---------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int, wait: bool = False) -> None:
        """Collective (the wait for the previous save): write `state` as this rank's checkpoint
        of `step`. Returns once the state is staged off the device; `wait` also waits for the
        files and the manifest (the preemption save)."""
        self.wait(copied=not wait)  # a preemption's save never waits for a copy: its grace is short
        rank = self.ranks.rank
        where = rank_dir(self.root, self.job, OWN, step, rank)
        started = time.perf_counter()
        try:
            if where.exists():  # left by a run that died mid-save (no manifest), or redone
                shutil.rmtree(where)
            where.mkdir(parents=True, mode=0o700)
        except OSError as e:
            raise CheckpointError(f"cannot write the local checkpoint {where}: {e.strerror or e}") from None
        writer = FileSystemWriter(where, sync_files=True)
        future = dcp.async_save(
            state, storage_writer=writer, process_group=self.group, async_stager=self.stager, no_dist=True
        )
        save = _Save(step, where, future, started, time.perf_counter() - started)
        self._pending, self.saved_step = save, step
        future.add_done_callback(lambda _: self._finish(save))
        if wait:
            self.wait()

    def _finish(self, save: _Save) -> None:
        """DCP's writer thread, once the files are written: the manifest (last), then pruning."""
        try:
            try:
                save.future.result()
            except BaseException as e:  # CheckpointException is a BaseException
                save.error = failure_line(e)
                return
            try:
                manifest = write_manifest(save.where, save.step, self.ranks.rank, self.ranks.world)
                save.nbytes = sum(size for size, _ in manifest.files.values())
                self._prune(save.step)
            except OSError as e:
                save.error = f"{e.strerror or e} ({getattr(e, 'filename', None) or save.where})"
                return
            self.ranks.log(
                f"local checkpoint step {save.step} -> {save.where.parent} ({format_bytes(save.nbytes)} "
                f"per rank; training blocked {save.blocked_s:.2f} s, written in the background in "
                f"{time.perf_counter() - save.started:.2f} s)"
            )
        finally:
            save.done.set()

    def _prune(self, newest: int) -> None:
        """This rank's own directories: all but the newest `keep` complete steps, and any
        incomplete one older than the newest (a save that died); never the newest complete, nor
        the newest step every rank's copy is out for (`pinned`: a node lost now resumes there)."""
        rank = self.ranks.rank
        complete = complete_steps(self.root, self.job, OWN, rank)
        keep = set(complete[-self.keep :]) | {newest, self.pinned}
        base = self.where / OWN
        for step_dir in base.iterdir():
            step = _step_of(step_dir.name)
            if step is None or step in keep or step > newest:
                continue
            mine = rank_dir(self.root, self.job, OWN, step, rank)
            if mine.exists():
                (mine / MANIFEST).unlink(missing_ok=True)  # first: a cut prune leaves no complete-looking copy
                shutil.rmtree(mine, ignore_errors=True)
            try:
                step_dir.rmdir()  # empty once the node's last rank pruned it
            except OSError:
                pass

    def wait(self, copied: bool = False) -> None:
        """Collective: let the save under way finish; every rank stops if any rank's failed.
        `copied`, under a replicator: and wait for its copy to a peer node (`_await_copy`). Once
        every rank's copy of a step is out, that step is `pinned`."""
        save, self._pending = self._pending, None
        error, copy = None, (False, 0.0, False)
        if save is not None:
            save.done.wait()
            error = save.error
            if error is None and self.copies:
                copy = self._await_copy(save, copied)
        said: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(said, (error, copy), group=self.group)
        if save is not None and self.copies:
            if all(sent for _, (sent, _, _) in said):
                self.pinned = save.step
            self._say_copies(save.step, [c for _, c in said])
        failed = [(r, e) for r, (e, _) in enumerate(said) if e]
        if failed:
            rank, why = failed[0]
            raise every_rank(
                CheckpointError(
                    f"cannot write the local checkpoint on rank {rank}: {why}; free space there or pass "
                    "another --local-checkpoint-dir"
                )
            )

    def _await_copy(self, save: _Save, patient: bool) -> tuple[bool, float, bool]:
        """Whether this rank's copy of `save` is out (gpufleet.local_tier.was_sent), the seconds
        waited for it, and whether the wait gave up. Up to `copy_wait_s` when `patient` (training
        holds still meanwhile, so the sender's next step is this one: no step is skipped, and every
        rank's copy of it is out before any rank writes the next); not at all when not. After a
        wait that gave up, saves no longer wait until a copy is out again."""
        started = time.monotonic()
        waiting = patient and not self._copies_late
        while waiting and not was_sent(save.where) and time.monotonic() - started < self.copy_wait_s:
            time.sleep(0.05)
        sent = was_sent(save.where)
        if patient:
            self._copies_late = not sent
        return sent, time.monotonic() - started, waiting and not sent

    def _say_copies(self, step: int, said: list[tuple[bool, float, bool]]) -> None:
        """Rank 0: one line when training waited a second or more for the copies of `step`, or
        when a wait for one gave up."""
        late = [r for r, (_, _, gave_up) in enumerate(said) if gave_up]
        slowest = max(w for _, w, _ in said)
        if late:
            ranks = ", ".join(map(str, late[:8])) + (" ..." if len(late) > 8 else "")
            fallback = f"local step {self.pinned}" if self.pinned is not None else "the durable tier"
            self.ranks.log(
                f"warning: the copy of local step {step} to a peer node is not out for rank(s) {ranks} after "
                f"{slowest:.0f} s; training goes on without waiting for copies until they are out again: a node "
                f"lost meanwhile resumes from {fallback}",
                stream=sys.stderr,
            )
        elif slowest >= 1.0:
            self.ranks.log(
                f"local checkpoint step {step}: training waited {slowest:.1f} s for its copies to peer nodes "
                "(copying takes longer than the --local-checkpoint-every interval)"
            )

    # ---- restore ------------------------------------------------------------------------------

    def restorable(self) -> dict[int, tuple[str, Path]]:
        """The steps this rank can restore from this node: its own complete copies (sizes
        checked), then peer copies of newer steps whose every hash matches. A peer copy that
        does not match is skipped with one warning line naming it."""
        rank, world = self.ranks.rank, self.ranks.world
        found: dict[int, tuple[str, Path]] = {}
        for step in complete_steps(self.root, self.job, OWN, rank):
            d = rank_dir(self.root, self.job, OWN, step, rank)
            m = read_manifest(d)
            if m is not None and m.world_size == world and m.rank == rank and verify(d, m, hashes=False) is None:
                found[step] = (OWN, d)
        newest_own = max(found, default=-1)
        for step in complete_steps(self.root, self.job, PEER, rank):
            if step <= newest_own:
                continue
            d = rank_dir(self.root, self.job, PEER, step, rank)
            m = read_manifest(d)
            if m is None or m.world_size != world or m.rank != rank:
                continue
            wrong = verify(d, m, hashes=True) or metadata_problem(d)
            if wrong:
                print(
                    f"warning: rank {rank}: skipping the peer copy {d}: {wrong}; using the next tier",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            found[step] = (PEER, d)
        return found

    def forget_after(self, step: int) -> None:
        """Once the job resumed from `step`, on each node's first rank (LOCAL_RANK 0, before its
        first step's collective, so no rank of the node saves meanwhile): the node's steps newer
        than it (its ranks' own and its peer copies, gpufleet.local_tier.forget_after) are the
        replaced attempt's, never to be mixed with this one's. One line when there were any."""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return
        gone = forget_after(self.root, self.job, step)
        if gone:
            print(
                f"local tier on {socket.gethostname()}: removed steps {', '.join(map(str, gone))}, newer than step "
                f"{step} this attempt resumed from (they were the previous attempt's)",
                file=sys.stderr,
                flush=True,
            )

    def load(self, state: dict[str, Any], where: Path) -> None:
        """This rank alone: read its own checkpoint at `where` into `state` (in place), its
        metadata and items through workloads.checkpoint.safe's allowlists (CheckpointError
        naming what it refused: a copy may have come from a peer node)."""
        why = metadata_problem(where)
        if why:
            raise CheckpointError(f"{where}: {why}")
        dcp.load(state, storage_reader=FileSystemReader(where), planner=SafeLoadPlanner(), no_dist=True)


def on_local_ssd(path: Path, environ: dict[str, str] | None = None) -> bool:
    """Whether `path` is on a local SSD: the mount that holds it is one of the image's local-SSD
    mount points (gpufleet.contracts.LOCAL_SSD_MOUNT; GPUFLEET_LOCAL_SSD_MOUNT, the test hook of
    launch doctor's node script, in their place when set)."""
    env = os.environ if environ is None else environ
    hook = env.get("GPUFLEET_LOCAL_SSD_MOUNT")
    mounts = {hook} if hook else set(LOCAL_SSD_MOUNT.values())
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p) in mounts


def _step_of(name: str) -> int | None:
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None
