"""The trainer's checkpointing component, as torchtitan's Trainer hands its own to
`CheckpointManager` (pytorch/torchtitan, torchtitan/components/checkpoint.py).

It owns the store (workloads.checkpoint.store), the DCP save, synchronous or in the background
(`dcp.async_save`), the SIGTERM save checked against the preemption budget, and the load, which
reshards whatever layout and world size wrote the checkpoint (DCP with the state-dict API of
torch.distributed.checkpoint.state_dict, which handles FSDP2 and DTensor parameters).

What it saves besides model and optimizer comes from the trainer's `TrainState`
(`state_dict()`/`load_state_dict()`: scheduler, scaler, step, data position), plus every rank's
RNG state and the run's `meta` (model, shape, batch, layout), which a resume checks first.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from gpufleet.local_tier import OWN, common_step
from workloads.checkpoint.local import LocalTier
from workloads.checkpoint.safe import SafeLoadPlanner, metadata_problem
from workloads.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    LocalStore,
    checkpoint_name,
    decode_state,
    encode_state,
    failure_cause,
    failure_line,
    has_os_error,
    is_full_state,
    open_store,
    step_of,
)
from workloads.collective import Ranks, every_rank
from workloads.components.float8 import high_precision_state
from workloads.config import ConfigError, TrainConfig
from workloads.metrics import RankInfo, format_bytes, preemption_report

__all__ = ["CheckpointManager", "TrainState", "rng_state", "run_meta"]

# How the previous release's full-state checkpoints are read: rank 0 reads, all receive.
_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
# What the trainer's own part of a checkpoint holds, next to the model and optimizer shards.
_TRAINER_KEYS = ("scheduler", "scaler", "step", "rng", "data", "meta")


class TrainState(Protocol):
    """The trainer's small state besides model and optimizer, the same on every rank."""

    step: int

    def state_dict(self) -> dict[str, Any]:
        """scheduler, scaler, step and data ({epoch, step_in_epoch, samples_seen})."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states (CPU, and this GPU's)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@dataclass
class _Save:
    """A checkpoint save under way in the background (--async-checkpoint)."""

    step: int
    name: str
    token: str
    future: Future
    started: float
    blocked_s: float
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None  # rank 0: why it failed, for every rank at the next wait


class CheckpointManager:
    """--checkpoint-dir of one run. Built before the model (a bad place fails at start-up), then
    given what it saves with `track`. Collective: every method runs on every rank."""

    def __init__(self, cfg: TrainConfig, ranks: Ranks, where: list[RankInfo]) -> None:
        self.cfg, self.ranks, self.where = cfg, ranks, where
        self.cuda = ranks.device.type == "cuda"
        # Every rank writes and reads its own checkpoint shards, so every rank opens the store
        # (and, for gs://, needs credentials); rank 0 checks it first and alone moves `latest`.
        self.store: CheckpointStore | None = None
        self.url: str | None = None
        self._pending: _Save | None = None
        self._latest_name: str | None = None  # the checkpoint `latest` names, when this run knows it
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.train_state: TrainState | None = None
        self.meta: dict[str, Any] = {}
        # The node-local tier (--local-checkpoint-every): each node checks its own directory now.
        self.local: LocalTier | None = None
        if cfg.checkpoint.local_checkpoint_every:
            self.local = LocalTier(cfg.checkpoint.local_checkpoint_dir, cfg.checkpoint.keep_local_checkpoints, ranks)
        if not cfg.checkpoint.checkpoint_dir:
            return
        self.url = ranks.on_rank0(lambda: self._open_store().url)
        self.store = ranks.on_every_rank(self._open_store)
        self._check_shared_dir()
        # DCP's own collectives (plans, write results) go through a gloo group of their own:
        # an async save runs them from a background thread while training uses the default
        # group, and async_save needs a CPU backend (torchtitan does the same).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
        # A CUDA run reuses one pinned host copy of the state across async saves; pinning
        # needs an accelerator, so a CPU run stages into fresh memory each time.
        self.stager = BlockingAsyncStager(cache_staged_state_dict=self.cuda)

    @property
    def enabled(self) -> bool:
        return self.url is not None

    def track(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: TrainState, meta: dict[str, Any]
    ) -> None:
        """What a checkpoint holds: the model's and optimizer's shards, the train state, and
        `meta`, the run's description a resume must match (model, size, seq_len, global_batch)."""
        self.model, self.optimizer, self.train_state, self.meta = model, optimizer, train_state, meta

    # ---- the store ----------------------------------------------------------------------------

    def _open_store(self) -> CheckpointStore:
        """Open the checkpoint place (rank 0 first, alone: it also proves the place writable)."""
        assert self.cfg.checkpoint.checkpoint_dir is not None
        if self.store is not None:
            return self.store
        try:
            store = open_store(self.cfg.checkpoint.checkpoint_dir)
            if self.ranks.rank == 0:
                store.check()
        except CheckpointError as e:
            # At start-up a place that cannot be opened or written is a bad --checkpoint-dir
            # (exit 2), not a failure found hours later.
            raise ConfigError(str(e)) from None
        self.store = store
        return store

    def _check_shared_dir(self) -> None:
        """A local --checkpoint-dir of a multi-node run must be one directory every node sees:
        each rank writes its own shards there, and any rank may read any of them back."""
        store = self.store
        nodes = {r.node for r in self.where}
        if not isinstance(store, LocalStore) or len(nodes) < 2:
            return
        probe = store.root / f".shared-{uuid.uuid4().hex[:12]}"
        name = self.ranks.on_rank0(lambda: _touch(probe))
        sees: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(sees, (store.root / name).exists())
        if self.ranks.rank == 0:
            (store.root / name).unlink(missing_ok=True)
        blind = [r for r in self.where if not sees[r.rank]]
        if blind:
            raise every_rank(
                ConfigError(
                    f"--checkpoint-dir {store.url} is not shared between the nodes: node {blind[0].node} "
                    f"(host {blind[0].host}) does not see what node 0 writes there. Every rank writes its "
                    "own checkpoint shards, so use gs://BUCKET/PREFIX or a directory every node mounts "
                    "(Filestore, NFS)"
                )
            )

    # ---- save ---------------------------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        """Collective: the train state, every rank's RNG states and the run's meta."""
        assert self.train_state is not None
        rngs: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(rngs, rng_state(self.ranks.device))
        return {**self.train_state.state_dict(), "rng": rngs, "meta": self.meta}

    def _state(self) -> dict[str, Any]:
        """Collective: what a checkpoint holds, as DCP saves it. Plain high-precision tensors
        whatever the run computes in: an fp8 run's checkpoint resumes a bf16 run and the reverse."""
        model_sd, optim_sd = high_precision_state(get_state_dict(self.model, self.optimizer))
        return {"model": model_sd, "optimizer": optim_sd, "trainer": encode_state(self._trainer_state())}

    def save_local(self, wait: bool = False) -> None:
        """Collective: this step to the node-local tier (in the background unless `wait`)."""
        assert self.local is not None and self.train_state is not None
        if self.local.saved_step == self.train_state.step:  # e.g. a SIGTERM right after a periodic save
            if wait:
                self.local.wait()
            return
        self.local.save(self._state(), self.train_state.step, wait=wait)

    def wait_local(self) -> None:
        """Collective: the local save under way, finished (before the process exits)."""
        if self.local is not None:
            self.local.wait()

    def save(self, asynchronous: bool = False) -> tuple[str, int] | None:
        """Collective: every rank writes its own shards (DCP); rank 0 publishes the checkpoint as
        `latest` once all are written. Asynchronous: returns once the state is copied to host
        memory, and the shards are written in the background; the next save (or the end of the
        run) waits for it. Synchronous: returns (where, bytes written), or None when the step is
        already the latest checkpoint."""
        assert self.train_state is not None
        self.wait()
        store, step = self.store, self.train_state.step
        name = checkpoint_name(step)
        assert store is not None
        if name == self._latest_name:  # e.g. --resume at the last step: nothing new to save
            return None
        started = time.perf_counter()
        state = self._state()
        token = self.ranks.on_rank0(lambda: store.begin(name))
        writer = store.storage_writer(name, token)
        if asynchronous:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=self.stager)
            save = _Save(step, name, token, future, started, time.perf_counter() - started)
            self._pending = save
            if self.ranks.rank == 0:
                future.add_done_callback(lambda _: self._publish_async(save))
            return None
        try:
            metadata = dcp.save(state, storage_writer=writer, process_group=self.group)
        except CheckpointException as e:  # DCP hands every rank's failure to every rank
            line = self._write_failure(name, e, token)
            if self.ranks.rank == 0:
                store.abort(name, token)
            raise every_rank(CheckpointError(line)) from None
        keep = self.cfg.checkpoint.keep_checkpoints

        def publish() -> str:
            where = store.commit(name, token)
            store.prune(keep)
            return where

        where = self.ranks.on_rank0(publish)
        self._latest_name = name
        nbytes = _bytes_written(metadata)
        self.ranks.log(
            f"checkpoint step {step} -> {where} ({format_bytes(nbytes)} in {time.perf_counter() - started:.2f} s)"
        )
        return where, nbytes

    def _write_failure(self, name: str, err: BaseException, token: str) -> str:
        """The one line for a failed save; call it before the store's abort frees the space."""
        fix = (
            "check the bucket name, your credentials and the network"
            if (self.url or "").startswith("gs://")
            else "free space or fix permissions there"
        )
        rank, cause = failure_cause(err)
        if not has_os_error(err) and self.store is not None:
            cause = self.store.write_refused(name, token) or cause
        on = f" on rank {rank}" if rank is not None else ""
        return f"cannot write checkpoint {self.url}/{name}{on}: {cause}; {fix}, or pass another --checkpoint-dir"

    def _publish_async(self, save: _Save) -> None:
        """Rank 0, when an async save's future completes (in DCP's writer thread): commit it as
        latest right away, so a crash later still finds it; errors wait for the next wait()."""
        store = self.store
        assert store is not None
        try:
            try:
                metadata = save.future.result()
            except BaseException as e:  # CheckpointException is a BaseException
                save.error = self._write_failure(save.name, e, save.token)
                store.abort(save.name, save.token)
                return
            try:
                where = store.commit(save.name, save.token)
                store.prune(self.cfg.checkpoint.keep_checkpoints)
            except CheckpointError as e:
                save.error = str(e)
                return
            self.ranks.log(
                f"checkpoint step {save.step} -> {where} ({format_bytes(_bytes_written(metadata))}; "
                f"training blocked {save.blocked_s:.2f} s, written in the background in "
                f"{time.perf_counter() - save.started:.2f} s)"
            )
        finally:
            save.done.set()

    def wait(self) -> None:
        """Collective: let the async save under way finish, and stop every rank if it failed."""
        save, self._pending = self._pending, None
        if save is None:
            return
        with contextlib.suppress(BaseException):  # rank 0 says what happened, below
            save.future.result()

        def outcome() -> None:
            save.done.wait()
            if save.error:
                raise CheckpointError(save.error)

        self.ranks.on_rank0(outcome)
        self._latest_name = save.name

    def save_on_preemption(self, notice_s: float) -> None:
        """The SIGTERM save: synchronous (an async save would still be writing when the VM
        stops), timed, and checked against --preemption-budget."""
        assert self.train_state is not None
        started = time.perf_counter()
        saved = self.save()  # waits for an async save under way first: the budget covers both
        save_s = time.perf_counter() - started
        where, nbytes = saved or (f"{self.url}/{self._latest_name}", 0)
        fits, line = preemption_report(
            self.train_state.step, save_s, notice_s, self.cfg.preemption_budget_s, nbytes, self.ranks.world, where
        )
        if fits:
            self.ranks.log(line)
        else:
            self.ranks.log("warning: " + line, stream=sys.stderr)

    # ---- load ---------------------------------------------------------------------------------

    def restore(self) -> None:
        """Collective (--resume): continue from the newest step that every rank can restore,
        from the fastest tier that holds it: the node's own local copies, a verified peer copy
        in the local directory's peer area, then --checkpoint-dir. Every rank restores the same
        step: the newest in every rank's set, so a rank with fewer local steps takes the others
        back to one it has (gpufleet.local_tier.common_step)."""
        ranks = self.ranks
        local = self.local.restorable() if self.local is not None else {}
        durable = ranks.on_rank0(self.store.latest) if self.store is not None else None
        durable_step = step_of(durable) if durable is not None else None
        mine = set(local) | ({durable_step} if durable_step is not None else set())
        sets: list[Any] = [None] * ranks.world
        dist.all_gather_object(sets, (sorted(mine), sorted(local)))
        step = common_step([s for s, _ in sets])
        if step is None:
            where = " or ".join(x for x in (self.local and str(self.local.where), self.url) if x)
            ranks.log(f"resume: no checkpoint in {where} yet; starting at step 0")
            return
        if not all(step in set(lo) for _, lo in sets):
            self.load(durable)  # the durable tier holds it for everyone (it is in every set)
        else:
            tier, path = local[step]
            tiers: list[Any] = [None] * ranks.world
            dist.all_gather_object(tiers, tier)
            self._load_local(path, step, tiers)
        if self.local is not None:  # what is newer than `step` belongs to the attempt this one replaces
            self.local.forget_after(step)

    def _load_local(self, path: Any, step: int, tiers: list[str]) -> None:
        """Collective: every rank reads its own local or peer copy of `step`, alone (no_dist)."""
        assert self.local is not None and self.train_state is not None
        ranks = self.ranks
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd, "trainer": b""}
        error, trainer = None, None
        try:
            self.local.load(state, path)
            trainer = decode_state(state["trainer"], str(path))
            self._check_trainer_state(trainer, str(path))
        except (CheckpointException, Exception) as e:  # noqa: BLE001 - every rank must hear of it
            error = f"{path} is not a readable checkpoint ({failure_line(e)})"
        said: list[Any] = [None] * ranks.world
        dist.all_gather_object(said, error)
        failed = [(r, e) for r, e in enumerate(said) if e]
        if failed:
            raise every_rank(
                CheckpointError(
                    f"rank {failed[0][0]}: {failed[0][1]}; remove it (the next tier is used) or resume without it"
                )
            )
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        own = sum(t == OWN for t in tiers)
        source = f"the local tier (own copies on {own} ranks, peer copies on {len(tiers) - own})"
        assert trainer is not None
        self._apply(trainer, source, "local" if own == len(tiers) else "peer")

    def load(self, name: str | None = None) -> None:
        """Continue from the latest checkpoint of --checkpoint-dir (`name`, when the caller read
        it), if there is one: every rank reads the pieces of its own shards, wherever and by
        however many ranks they were written (DCP reshards)."""
        store, ranks = self.store, self.ranks
        assert store is not None and self.train_state is not None
        if name is None:
            name = ranks.on_rank0(store.latest)
        if name is None:
            ranks.log(f"resume: no checkpoint in {self.url} yet; starting at step 0")
            return
        where = f"{store.url}/{name}"
        if is_full_state(name):
            trainer = self._load_full_state(name, where)
        else:
            # The trainer's small part first: it says whether the checkpoint fits this run before
            # the model and optimizer are read.
            head: dict[str, Any] = {"trainer": b""}
            self._dcp_load(head, name, where)
            trainer = decode_state(head["trainer"], where)
            self._check_trainer_state(trainer, where)
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            body = {"model": model_sd, "optimizer": optim_sd}
            self._dcp_load(body, name, where)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=body["model"], optim_state_dict=body["optimizer"]
            )
        self._latest_name = name
        self._apply(trainer, str(self.url), "durable")

    def _apply(self, trainer: dict[str, Any], source: str, tier: str) -> None:
        """The trainer's part of a loaded checkpoint: train state, this rank's RNG, the line. The
        line ends `restored step N from local|peer|durable` (`tier`: peer when any rank read a
        peer's copy), which `launch jobs` reads for each relaunch (launcher.jobs.goodput.RESTORED_RE)."""
        assert self.train_state is not None
        ranks = self.ranks
        self.train_state.load_state_dict(trainer)
        rngs = trainer["rng"]
        mine = rngs[ranks.rank] if len(rngs) == ranks.world else rngs[0]
        torch.set_rng_state(mine["cpu"])
        if self.cuda and "cuda" in mine:
            torch.cuda.set_rng_state(mine["cuda"], ranks.device)
        saved_by = trainer["meta"].get("world_size", ranks.world)
        resharded = f"; saved by {saved_by} ranks, read by {ranks.world}" if saved_by != ranks.world else ""
        # Plain data parallelism on another world size says enough with the rank counts.
        layout, mine = trainer["meta"].get("layout"), self.meta.get("layout")
        plain = all(str(x).startswith(("ddp x", "fsdp x")) for x in (layout, mine))
        if layout and mine and layout != mine and not plain:
            resharded += f"; saved as {layout}, read as {mine}"
        ranks.log(
            f"resumed from {source} at step {self.train_state.step} "
            f"(epoch {trainer['data']['epoch']}, {trainer['data']['samples_seen']} samples seen{resharded}); "
            f"restored step {self.train_state.step} from {tier}"
        )

    def _dcp_load(self, state: dict[str, Any], name: str, where: str) -> None:
        assert self.store is not None
        fix = f"point {self.url}/latest at an older step_*, or pass another --checkpoint-dir"
        # Every node writes the durable tier: metadata or an item naming a callable is refused, not
        # run (workloads.checkpoint.safe). Rank 0 reads the metadata, as DCP's coordinator does.
        reader = self.store.storage_reader(name)
        why = self.ranks.on_rank0(lambda: metadata_problem(reader)) if isinstance(reader, FileSystemReader) else None
        if why:
            raise every_rank(CheckpointError(f"{where} is not a readable checkpoint ({why}); {fix}"))
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self.group)
        except CheckpointException as e:  # every rank gets every rank's failure
            raise every_rank(
                CheckpointError(f"{where} is not a readable checkpoint ({failure_line(e)}); {fix}")
            ) from None

    def _check_trainer_state(self, state: dict[str, Any], where: str) -> None:
        """Every rank alike (rank 0 alone for a full-state file): fail on a checkpoint that is not
        this trainer's, or not of this run's model and batch."""
        missing = [k for k in _TRAINER_KEYS if k not in state]
        if missing or not isinstance(state["meta"], dict):
            why = f"no {', '.join(missing)}" if missing else "its meta is not a dict"
            raise every_rank(
                CheckpointError(
                    f"{where} is not a checkpoint of workloads.train ({why}); point {self.url}/latest "
                    "at an older step_*, or pass another --checkpoint-dir"
                )
            )
        self._check_fits(where, state["meta"])

    def _load_full_state(self, name: str, where: str) -> dict[str, Any]:
        """A full-state `step_*.pt` of the previous release: rank 0 reads it and broadcasts."""
        store = self.store
        assert store is not None and self.model is not None and self.optimizer is not None
        self.ranks.log(
            f"notice: {where} is a full-state checkpoint of the previous release, read for this "
            "release only; this run saves sharded (DCP) checkpoints, step_*/ directories"
        )
        # Rank 0 keeps the tensors here; only the small parts go through the object broadcast,
        # the tensors go through set_*_state_dict's broadcast.
        full: dict[str, Any] = {"model": {}, "optimizer": {}}

        def read() -> dict[str, Any]:
            state = store.load_full_state(name)
            missing = [k for k in ("model", "optimizer") if k not in state]
            if missing:
                raise CheckpointError(
                    f"{where} is not a checkpoint of workloads.train (no "
                    f"{', '.join(missing + [k for k in _TRAINER_KEYS if k not in state])}); "
                    f"point {store.url}/latest at an older step_*, or pass another "
                    "--checkpoint-dir"
                )
            self._check_trainer_state(state, where)
            full["model"], full["optimizer"] = state.pop("model"), state.pop("optimizer")
            return state

        state = self.ranks.on_rank0(read)
        # Two calls, not set_state_dict: with an empty model dict on ranks > 0 it skips the model
        # there (optim_only=not model_state_dict) and rank 0 waits forever in the broadcast.
        set_model_state_dict(self.model, full["model"], options=_LOAD)
        set_optimizer_state_dict(self.model, self.optimizer, full["optimizer"], options=_LOAD)
        full.clear()
        return state

    def _check_fits(self, where: str, meta: dict[str, Any]) -> None:
        mine = self.meta
        for key in ("model", "seq_len", "global_batch"):
            if meta.get(key) != mine[key]:
                raise every_rank(
                    ConfigError(
                        f"checkpoint {where} was written with {key} {meta.get(key)}, this run has {mine[key]}; "
                        f"use the same --{key.replace('_', '-')} or another --checkpoint-dir"
                    )
                )
        # The shape follows from --model; it differs only when MODEL_SIZES changed since the save.
        if meta.get("size") != mine["size"]:
            raise every_rank(
                ConfigError(
                    f"checkpoint {where} holds model {mine['model']} with shape {meta.get('size')}, "
                    f"but {mine['model']} is now {mine['size']}; pass another --checkpoint-dir"
                )
            )


def run_meta(cfg: TrainConfig, world: int) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (and a resume checks)."""
    return {
        "model": cfg.model_spec.model,
        "size": asdict(cfg.size),
        "seq_len": cfg.tokens_per_sample,
        "global_batch": cfg.training.global_batch,
        "world_size": world,
        "parallelism": cfg.layout.parallelism,
        "seed": cfg.training.seed,
    }


def _touch(path: Any) -> str:
    """Create an empty file; returns its name (ConfigError naming it if it cannot be written)."""
    try:
        path.touch()
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}; fix --checkpoint-dir") from None
    return path.name


def _bytes_written(metadata: Any) -> int:
    """What a DCP save wrote, over all ranks: the lengths its metadata records per item."""
    return sum(getattr(info, "length", 0) for info in (getattr(metadata, "storage_data", None) or {}).values())
