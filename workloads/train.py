"""GPT training under torchrun: `python -m torch.distributed.run ... -m workloads.train [flags]`.

Ranks come from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK); NCCL on GPUs,
gloo on CPU. Only rank 0 logs; every rank writes its own shards of a checkpoint through
torch.distributed.checkpoint (workloads.checkpoint). The run is deterministic given --seed:
weights from the seed, data order from (seed, step), optimizer/scheduler/RNG states from the
checkpoint, so a resumed or torchrun-restarted run ends with the parameters of an uninterrupted one.

Exit codes: 0 done (also after a SIGTERM, once its checkpoint is saved: a preempted run is
resumed with --resume, not restarted by torchrun); 1 a checkpoint could not be written or read;
2 bad arguments (or a checkpoint/bucket/output path that does not fit them).

Errors are one `error: ...` line on stderr. One that every rank meets alike (a bad flag, anything
rank 0 finds and hands to the others) is printed by rank 0 alone; one that a rank meets on its own
(--data missing on one node) is printed by that rank, as `error: rank R (host H): ...`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from gpufleet.catalog import peak_flops_for_device
from gpufleet.contracts import ERROR_PREFIX
from workloads.checkpoint import (
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
)
from workloads.config import EXIT_BAD_ARGS, ConfigError, TrainConfig, config_from_args
from workloads.data import BatchStream, SyntheticTokens, TokenFile
from workloads.metrics import RankInfo, format_bytes, format_log_line, preemption_report, straggler_warning
from workloads.model import GPT, flops_per_token, mfu

__all__ = ["Trainer", "main"]

T = TypeVar("T")
E = TypeVar("E", bound=Exception)
# Full (unsharded) state dicts gathered on rank 0, in CPU memory: what --save-params writes, and
# how the previous release's full-state checkpoints are read (rank 0 reads, all receive).
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
# What the trainer's own part of a checkpoint holds (Trainer._trainer_state), next to the model
# and optimizer shards.
_TRAINER_KEYS = ("scheduler", "scaler", "step", "rng", "data", "meta")
# Set on an error that every rank raises alike, so that rank 0 alone prints it (see main).
_EVERY_RANK = "_gpufleet_every_rank"


def _every_rank(err: E) -> E:
    setattr(err, _EVERY_RANK, True)
    return err


class _StoppedElsewhere(ConfigError):
    """This rank stops because another rank failed; that rank printed why."""


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


class Trainer:
    """One process's share of the run. Named steps: build, load, train_step, save, fit."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{self.local_rank}" if self.cuda else "cpu")
        self.precision = cfg.precision if cfg.precision != "auto" else ("bf16" if self.cuda else "fp32")
        self.ptdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]
        if cfg.compression == "bf16" and not self.cuda:
            raise _every_rank(
                ConfigError(
                    "--compression bf16 needs CUDA and NCCL 2.10+ (torch's "
                    "bf16_compress_hook); on CPU use fp16 or powersgd"
                )
            )
        self.stop_requested = False
        self.notice_at = 0.0  # time.monotonic() of this rank's first SIGTERM
        self._stop_posted: tuple[torch.Tensor, Any, float] | None = None  # CUDA: last step's flag
        self.forward_s = 0.0  # this rank's own compute time since the last straggler check
        self._forward_events: list[tuple[Any, Any]] = []
        if self.cuda:
            torch.cuda.set_device(self.device)
            # TF32 matmuls/convs on Ampere+: ~free speed for fp32 parts (PyTorch CUDA semantics docs).
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.ranks = self._where_ranks_run()
        # Every rank writes and reads its own checkpoint shards, so every rank opens the store
        # (and, for gs://, needs credentials); rank 0 checks it first and alone moves `latest`.
        self.store: CheckpointStore | None = None
        self.checkpoint_url: str | None = None
        self._pending: _Save | None = None
        self._latest_name: str | None = None  # the checkpoint `latest` names, when this run knows it
        if cfg.checkpoint_dir:
            self.checkpoint_url = self._on_rank0(lambda: self._open_store().url)
            self.store = self._on_every_rank(self._open_store)
            self._check_shared_dir()
            # DCP's own collectives (plans, write results) go through a gloo group of their own:
            # an async save runs them from a background thread while training uses the default
            # group, and async_save needs a CPU backend (torchtitan does the same).
            self.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))
            # A CUDA run reuses one pinned host copy of the state across async saves; pinning
            # needs an accelerator, so a CPU run stages into fresh memory each time.
            self.stager = BlockingAsyncStager(cache_staged_state_dict=self.cuda)
        # Output paths are proven writable now, not at the first log line or after the last step.
        self.metrics_out: IO[str] | None = None
        self._on_rank0(self._open_outputs)
        if cfg.profile_range is not None:
            self._on_every_rank(self._check_profile_dir)  # every rank writes its own trace
        self.model, self.raw_model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        seq_len = cfg.tokens_per_sample
        self.batches = self._on_every_rank(self._open_data)  # --data may be missing on one node only
        size = cfg.size
        self.n_params = self.raw_model.num_params()
        self.flops_token = flops_per_token(
            self.n_params, size.n_layer, size.n_head, size.n_embd // size.n_head, seq_len
        )
        self.peak_flops = peak_flops_for_device(torch.cuda.get_device_name(self.device)) if self.cuda else None
        self.step = 0

    # ---- build ---------------------------------------------------------------------------

    def _where_ranks_run(self) -> list[RankInfo]:
        me = RankInfo(self.rank, int(os.environ.get("GROUP_RANK", "0")), socket.gethostname())
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, me)
        return everyone

    def _open_store(self) -> CheckpointStore:
        """Open the checkpoint place (rank 0 first, alone: it also proves the place writable)."""
        assert self.cfg.checkpoint_dir is not None
        if self.store is not None:
            return self.store
        try:
            store = open_store(self.cfg.checkpoint_dir)
            if self.rank == 0:
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
        nodes = {r.node for r in self.ranks}
        if not isinstance(store, LocalStore) or len(nodes) < 2:
            return
        probe = store.root / f".shared-{uuid.uuid4().hex[:12]}"
        name = self._on_rank0(lambda: _touch(probe))
        sees: list[Any] = [None] * self.world
        dist.all_gather_object(sees, (store.root / name).exists())
        if self.rank == 0:
            (store.root / name).unlink(missing_ok=True)
        blind = [r for r in self.ranks if not sees[r.rank]]
        if blind:
            raise _every_rank(
                ConfigError(
                    f"--checkpoint-dir {store.url} is not shared between the nodes: node {blind[0].node} "
                    f"(host {blind[0].host}) does not see what node 0 writes there. Every rank writes its "
                    "own checkpoint shards, so use gs://BUCKET/PREFIX or a directory every node mounts "
                    "(Filestore, NFS)"
                )
            )

    def _open_outputs(self) -> None:
        """Rank 0: open --metrics-file for the whole run and prove --save-params writable."""
        cfg = self.cfg
        if cfg.save_params:
            _check_writable_file("--save-params", cfg.save_params)
        if cfg.metrics_file:
            try:
                self.metrics_out = open(cfg.metrics_file, "a")
            except OSError as e:
                raise ConfigError(_unwritable("--metrics-file", cfg.metrics_file, e)) from None

    def _check_profile_dir(self) -> None:
        where = Path(self.cfg.profile_dir)
        probe = where / f".probe-{os.getpid()}"
        try:
            where.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"--profile-dir {where}: cannot write traces there "
                f"({e.strerror or e}); fix its permissions or pass another --profile-dir"
            ) from None

    def _open_data(self) -> BatchStream:
        cfg = self.cfg
        seq_len, vocab = cfg.tokens_per_sample, cfg.size.vocab_size
        dataset = (
            TokenFile(cfg.data, seq_len, vocab)
            if cfg.data
            else SyntheticTokens(cfg.synthetic_samples, seq_len, vocab, cfg.seed)
        )
        return BatchStream(dataset, self.rank, self.world, cfg.micro_batch, cfg.grad_accum, cfg.seed)

    def _build_model(self) -> tuple[torch.nn.Module, GPT]:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # same initial weights on every rank, before any wrapping
        raw = GPT(cfg.size, activation_checkpointing=cfg.activation_checkpointing).to(self.device)
        if cfg.parallelism == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # bf16/fp16 compute with fp32 gradient reduction (torchtitan's default policy).
            mp = (
                MixedPrecisionPolicy(param_dtype=self.ptdtype, reduce_dtype=torch.float32)
                if self.precision in ("bf16", "fp16")
                else MixedPrecisionPolicy()
            )
            for block in raw.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(raw, mp_policy=mp)
            model: torch.nn.Module = raw
        elif self.world == 1:
            # Nothing to reduce with one rank: skip DDP's bucket copies (torchtitan also applies
            # data parallelism only when its degree is above 1).
            model = raw
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(
                raw,
                device_ids=[self.local_rank] if self.cuda else None,
                bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                static_graph=cfg.static_graph,
            )
            self._register_comm_hook(model)
        if cfg.compile:
            model = torch.compile(model)
        return model, raw

    def _register_comm_hook(self, ddp: torch.nn.Module) -> None:
        """Gradient compression through PyTorch's own DDP comm hooks."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        kind = self.cfg.compression
        if kind == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif kind == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif kind == "powersgd":
            # start_powerSGD_iter: plain all-reduce for the first steps, as the PowerSGD paper and
            # the hook's docs advise (error feedback needs a warmed-up model).
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.cfg.powersgd_rank,
                start_powerSGD_iter=max(2, self.cfg.warmup_steps),
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        # nanoGPT: decay the 2-D weights (matmuls, embeddings), not biases and LayerNorm gains.
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        lr = cfg.lr * (self.world if cfg.scale_lr else 1)
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=self.cuda)

    def _lr_factor(self, step: int) -> float:
        """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, (cfg.lr_decay_steps or cfg.steps) - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    # ---- collectives helpers ---------------------------------------------------------------

    def _on_rank0(self, fn: Callable[[], T]) -> T:
        """Run fn on rank 0 and hand its result, or its error, to every rank (so an error there
        stops all ranks at once instead of leaving them waiting in the next collective)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except (ConfigError, CheckpointError) as e:
                box[0] = (type(e).__name__, str(e))
        dist.broadcast_object_list(box, src=0, device=self.device if self.cuda else None)
        kind, value = box[0]
        if kind == "ConfigError":
            raise _every_rank(ConfigError(value))
        if kind == "CheckpointError":
            raise _every_rank(CheckpointError(value))
        return value

    def _on_every_rank(self, fn: Callable[[], T]) -> T:
        """Run fn on every rank; if it raises ConfigError on any, every rank stops together
        instead of waiting for the failed one in the next collective. A failing rank raises its
        own error (main prints it with the rank and host), the others stop quietly; when every
        rank failed alike, the error counts as shared and rank 0 alone prints it."""
        mine: ConfigError | None = None
        try:
            result = fn()
        except ConfigError as e:
            mine = e
        if self.world > 1:
            said: list[Any] = [None] * self.world
            dist.all_gather_object(said, None if mine is None else str(mine))
            if mine is None and any(m is not None for m in said):
                raise _StoppedElsewhere("another rank failed")
            if mine is not None and len(set(said)) == 1:
                raise _every_rank(mine)
        if mine is not None:
            raise mine
        return result

    def _stop_notice(self) -> float | None:
        """Collective: None while no rank has had a SIGTERM, else the age in seconds of the
        oldest notice any rank got (what the preemption budget has already spent).

        On CUDA the answer lags one step: this step's flag is reduced on the GPU and copied to
        pinned memory behind an event, and the previous step's is read, so the host never waits
        for the step it just queued (an `.item()` here would drain the GPU's queue every step).
        """
        age = time.monotonic() - self.notice_at if self.stop_requested else -1.0
        if self.world == 1:
            return age if age >= 0 else None
        t = torch.tensor([age], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if not self.cuda:
            age = t.item()
            return age if age >= 0 else None
        host = torch.empty(1, dtype=torch.float64, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        posted, self._stop_posted = self._stop_posted, (host, done, time.monotonic())
        if posted is None:
            return None
        host, done, at = posted
        done.synchronize()
        age = float(host[0])
        return age + (time.monotonic() - at) if age >= 0 else None

    # ---- checkpoints -------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model,
            "size": asdict(self.cfg.size),
            "seq_len": self.cfg.tokens_per_sample,
            "global_batch": self.cfg.global_batch,
            "world_size": self.world,
            "parallelism": self.cfg.parallelism,
            "seed": self.cfg.seed,
        }

    def _rng_state(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.cuda:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _trainer_state(self) -> dict[str, Any]:
        """Collective: the small state besides model and optimizer, the same on every rank."""
        rngs: list[Any] = [None] * self.world
        dist.all_gather_object(rngs, self._rng_state())
        epoch, in_epoch = self.batches.position(self.step)
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "rng": rngs,
            "data": {"epoch": epoch, "step_in_epoch": in_epoch, "samples_seen": self.step * self.cfg.global_batch},
            "meta": self._meta(),
        }

    def save(self, asynchronous: bool = False) -> tuple[str, int] | None:
        """Collective: every rank writes its own shards (DCP); rank 0 publishes the checkpoint as
        `latest` once all are written. Asynchronous: returns once the state is copied to host
        memory, and the shards are written in the background; the next save (or the end of the
        run) waits for it. Synchronous: returns (where, bytes written), or None when the step is
        already the latest checkpoint."""
        self._wait_pending()
        store, name = self.store, checkpoint_name(self.step)
        assert store is not None
        if name == self._latest_name:  # e.g. --resume at the last step: nothing new to save
            return None
        started = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "trainer": encode_state(self._trainer_state())}
        token = self._on_rank0(lambda: store.begin(name))
        writer = store.storage_writer(name, token)
        if asynchronous:
            future = dcp.async_save(
                state, storage_writer=writer, process_group=self.ckpt_group, async_stager=self.stager
            )
            save = _Save(self.step, name, token, future, started, time.perf_counter() - started)
            self._pending = save
            if self.rank == 0:
                future.add_done_callback(lambda _: self._publish_async(save))
            return None
        try:
            metadata = dcp.save(state, storage_writer=writer, process_group=self.ckpt_group)
        except CheckpointException as e:  # DCP hands every rank's failure to every rank
            line = self._write_failure(name, e, token)
            if self.rank == 0:
                store.abort(name, token)
            raise _every_rank(CheckpointError(line)) from None
        keep = self.cfg.keep_checkpoints

        def publish() -> str:
            where = store.commit(name, token)
            store.prune(keep)
            return where

        where = self._on_rank0(publish)
        self._latest_name = name
        nbytes = _bytes_written(metadata)
        self.log(
            f"checkpoint step {self.step} -> {where} ({format_bytes(nbytes)} in {time.perf_counter() - started:.2f} s)"
        )
        return where, nbytes

    def _write_failure(self, name: str, err: BaseException, token: str) -> str:
        """The one line for a failed save; call it before the store's abort frees the space."""
        fix = (
            "check the bucket name, your credentials and the network"
            if (self.checkpoint_url or "").startswith("gs://")
            else "free space or fix permissions there"
        )
        rank, cause = failure_cause(err)
        if not has_os_error(err) and self.store is not None:
            cause = self.store.write_refused(name, token) or cause
        on = f" on rank {rank}" if rank is not None else ""
        return (
            f"cannot write checkpoint {self.checkpoint_url}/{name}{on}: {cause}; {fix}, "
            "or pass another --checkpoint-dir"
        )

    def _publish_async(self, save: _Save) -> None:
        """Rank 0, when an async save's future completes (in DCP's writer thread): commit it as
        latest right away, so a crash later still finds it; errors wait for the next _wait_pending."""
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
                store.prune(self.cfg.keep_checkpoints)
            except CheckpointError as e:
                save.error = str(e)
                return
            self.log(
                f"checkpoint step {save.step} -> {where} ({format_bytes(_bytes_written(metadata))}; "
                f"training blocked {save.blocked_s:.2f} s, written in the background in "
                f"{time.perf_counter() - save.started:.2f} s)"
            )
        finally:
            save.done.set()

    def _wait_pending(self) -> None:
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

        self._on_rank0(outcome)
        self._latest_name = save.name

    def load(self) -> None:
        """Continue from the latest checkpoint, if there is one: every rank reads the pieces of
        its own shards, wherever and by however many ranks they were written (DCP reshards)."""
        store = self.store
        assert store is not None
        name = self._on_rank0(store.latest)
        if name is None:
            self.log(f"resume: no checkpoint in {self.checkpoint_url} yet; starting at step 0")
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
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.scaler.load_state_dict(trainer["scaler"])
        self.step = trainer["step"]
        rngs = trainer["rng"]
        mine = rngs[self.rank] if len(rngs) == self.world else rngs[0]
        torch.set_rng_state(mine["cpu"])
        if self.cuda and "cuda" in mine:
            torch.cuda.set_rng_state(mine["cuda"], self.device)
        saved_by = trainer["meta"].get("world_size", self.world)
        resharded = f"; saved by {saved_by} ranks, read by {self.world}" if saved_by != self.world else ""
        self.log(
            f"resumed from {self.checkpoint_url} at step {self.step} "
            f"(epoch {trainer['data']['epoch']}, {trainer['data']['samples_seen']} samples seen{resharded})"
        )

    def _dcp_load(self, state: dict[str, Any], name: str, where: str) -> None:
        assert self.store is not None
        try:
            dcp.load(state, storage_reader=self.store.storage_reader(name), process_group=self.ckpt_group)
        except CheckpointException as e:  # every rank gets every rank's failure
            raise _every_rank(
                CheckpointError(
                    f"{where} is not a readable checkpoint ({failure_line(e)}); point "
                    f"{self.checkpoint_url}/latest at an older step_*, or pass another --checkpoint-dir"
                )
            ) from None

    def _check_trainer_state(self, state: dict[str, Any], where: str) -> None:
        """Every rank alike (rank 0 alone for a full-state file): fail on a checkpoint that is not
        this trainer's, or not of this run's model and batch."""
        missing = [k for k in _TRAINER_KEYS if k not in state]
        if missing or not isinstance(state["meta"], dict):
            why = f"no {', '.join(missing)}" if missing else "its meta is not a dict"
            raise _every_rank(
                CheckpointError(
                    f"{where} is not a checkpoint of workloads.train ({why}); point {self.checkpoint_url}/latest "
                    "at an older step_*, or pass another --checkpoint-dir"
                )
            )
        self._check_fits(where, state["meta"])

    def _load_full_state(self, name: str, where: str) -> dict[str, Any]:
        """A full-state `step_*.pt` of the previous release: rank 0 reads it and broadcasts."""
        store = self.store
        assert store is not None
        self.log(
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

        state = self._on_rank0(read)
        # Two calls, not set_state_dict: with an empty model dict on ranks > 0 it skips the model
        # there (optim_only=not model_state_dict) and rank 0 waits forever in the broadcast.
        set_model_state_dict(self.model, full["model"], options=_LOAD)
        set_optimizer_state_dict(self.model, self.optimizer, full["optimizer"], options=_LOAD)
        full.clear()
        return state

    def _check_fits(self, where: str, meta: dict[str, Any]) -> None:
        mine = self._meta()
        for key in ("model", "seq_len", "global_batch"):
            if meta.get(key) != mine[key]:
                raise _every_rank(
                    ConfigError(
                        f"checkpoint {where} was written with {key} {meta.get(key)}, this run has {mine[key]}; "
                        f"use the same --{key.replace('_', '-')} or another --checkpoint-dir"
                    )
                )
        # The shape follows from --model; it differs only when MODEL_SIZES changed since the save.
        if meta.get("size") != mine["size"]:
            raise _every_rank(
                ConfigError(
                    f"checkpoint {where} holds model {mine['model']} with shape {meta.get('size')}, "
                    f"but {mine['model']} is now {mine['size']}; pass another --checkpoint-dir"
                )
            )

    # ---- training ------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.ptdtype)

    @contextlib.contextmanager
    def _range(self, name: str) -> Iterator[None]:
        """A named range for torch.profiler and, on GPUs, for Nsight (NVTX)."""
        with torch.profiler.record_function(name):
            if self.cuda:
                torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.nvtx.range_pop()

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce on all but the last micro-step (issue 5)."""
        if last or self.world == 1:
            return contextlib.nullcontext()
        if self.cfg.parallelism == "fsdp":
            return _fsdp_no_sync(self.raw_model)
        return self.model.no_sync()  # type: ignore[operator]

    def _mark(self) -> Any:
        if self.cuda:  # host timers would see only kernel launches; CUDA events see the GPU
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add_forward_time(self, start: Any) -> None:
        if self.cuda:
            self._forward_events.append((start, self._mark()))
        else:
            self.forward_s += time.perf_counter() - start

    def _take_forward_time(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.forward_s += sum(a.elapsed_time(b) for a, b in self._forward_events) / 1e3
            self._forward_events.clear()
        taken, self.forward_s = self.forward_s, 0.0
        return taken

    def train_step(self) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean loss."""
        cfg = self.cfg
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.batches.micro_batch_at(self.step, micro)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._sync_context(micro == cfg.grad_accum - 1):
                # Forward has no collectives under DDP, so its time is this rank's own speed
                # (the straggler signal); under FSDP it includes the parameter all-gathers.
                # Timed only when the check is on: its CUDA events pile up until a check reads them.
                t0 = self._mark() if cfg.straggler_every else None
                with self._range("forward"), self._autocast():
                    loss = self.model(x, y) / cfg.grad_accum
                if cfg.straggler_every:
                    self._add_forward_time(t0)
                with self._range("backward"):
                    self.scaler.scale(loss).backward()
            total += loss.detach()
        with self._range("optimizer"):
            if cfg.grad_clip:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.step += 1
        return total

    def fit(self) -> None:
        cfg = self.cfg
        if cfg.resume:
            self.load()
        self.log(self._banner())
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        profiler = self._profiler()
        tokens_per_step = cfg.global_batch * cfg.tokens_per_sample
        last_log, last_log_step = time.perf_counter(), self.step
        try:
            while self.step < cfg.steps:
                loss = self.train_step()
                if profiler:
                    profiler.step()
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                    loss_value = loss.item() / self.world  # .item() waits for the GPU: times are real
                    now = time.perf_counter()
                    step_s = (now - last_log) / (self.step - last_log_step)
                    last_log, last_log_step = now, self.step
                    self._log_step(loss_value, step_s, tokens_per_step / step_s)
                if cfg.straggler_every and self.step % cfg.straggler_every == 0:
                    self._check_stragglers(cfg.straggler_every)
                notice_s = self._stop_notice()
                if notice_s is not None:
                    self.log(
                        f"SIGTERM: saving a checkpoint at step {self.step} and exiting; rerun with --resume to continue"
                    )
                    if self.checkpoint_url:
                        self._preemption_save(notice_s)
                    return
                if (
                    self.checkpoint_url
                    and cfg.checkpoint_every
                    and self.step % cfg.checkpoint_every == 0
                    and self.step < cfg.steps
                ):
                    self.save(asynchronous=cfg.async_checkpoint)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if profiler:
                profiler.stop()
            if self.metrics_out:
                self.metrics_out.close()
                self.metrics_out = None
        if self.checkpoint_url:
            self.save()
        if cfg.save_params:
            self.save_params(cfg.save_params)
        self.log(f"done: {self.step} steps")

    def save_params(self, path: str) -> None:
        """Rank 0 writes the final parameters (full state_dict) for comparison between runs."""
        sd = get_model_state_dict(self.model, options=_SAVE)

        def write() -> None:
            try:
                torch.save(sd, path)
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"cannot write --save-params {path}: {e}") from None

        self._on_rank0(write)

    def _preemption_save(self, notice_s: float) -> None:
        """The SIGTERM save: synchronous (an async save would still be writing when the VM
        stops), timed, and checked against --preemption-budget."""
        started = time.perf_counter()
        saved = self.save()  # waits for an async save under way first: the budget covers both
        save_s = time.perf_counter() - started
        where, nbytes = saved or (f"{self.checkpoint_url}/{self._latest_name}", 0)
        fits, line = preemption_report(
            self.step, save_s, notice_s, self.cfg.preemption_budget_s, nbytes, self.world, where
        )
        if fits:
            self.log(line)
        else:
            self.log("warning: " + line, stream=sys.stderr)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag and the time: the save happens at the next step boundary, when all ranks agree.
        if not self.stop_requested:
            self.notice_at = time.monotonic()
        self.stop_requested = True

    def _profiler(self) -> torch.profiler.profile | None:
        rng = self.cfg.profile_range
        if rng is None or rng[1] <= self.step:
            return None
        a, b = max(rng[0], self.step), rng[1]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=a - self.step, warmup=0, active=b - a, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                self.cfg.profile_dir, worker_name=f"rank{self.rank}"
            ),
        )
        prof.start()
        return prof

    def _check_stragglers(self, steps: int) -> None:
        mine = self._take_forward_time() / steps
        times: list[Any] = [None] * self.world
        dist.all_gather_object(times, mine)
        for line in straggler_warning(times, self.ranks, self.cfg.straggler_threshold):
            self.log("warning: " + line, stream=sys.stderr)

    # ---- reporting -----------------------------------------------------------------------------

    def _banner(self) -> str:
        cfg = self.cfg
        peak = f"{self.peak_flops:.3g} FLOP/s (gpufleet.catalog)" if self.peak_flops else "n/a"
        return (
            f"train: model {cfg.model} ({self.n_params / 1e6:.2f}M params) | {cfg.parallelism} x "
            f"{self.world} ranks on {self.device.type} ({dist.get_backend()}) | {self.precision} | "
            f"{cfg.batch_summary()} | seq {cfg.tokens_per_sample} | steps {self.step}->{cfg.steps} | "
            f"{self.flops_token:.3g} FLOP/token (6N+12LHQT) | peak {peak}"
        )

    def _log_step(self, loss: float, step_s: float, tokens_per_s: float) -> None:
        per_gpu_mfu = mfu(self.flops_token, tokens_per_s / self.world, self.peak_flops)
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None
        lr = self.scheduler.get_last_lr()[0]
        self.log(format_log_line(self.step, self.cfg.steps, loss, lr, step_s, tokens_per_s, per_gpu_mfu, mem))
        if self.metrics_out:  # rank 0
            record = {
                "step": self.step,
                "loss": loss,
                "lr": lr,
                "step_s": step_s,
                "tokens_per_s": tokens_per_s,
                "mfu": per_gpu_mfu,
                "peak_mem_gib": mem,
                "time": time.time(),
            }
            self.metrics_out.write(json.dumps(record) + "\n")
            self.metrics_out.flush()  # whole lines, readable while the run goes on

    def log(self, line: str, stream: Any = None) -> None:
        if self.rank == 0:
            print(line, file=stream or sys.stdout, flush=True)


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _touch(path: Path) -> str:
    """Create an empty file; returns its name (ConfigError naming it if it cannot be written)."""
    try:
        path.touch()
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}; fix --checkpoint-dir") from None
    return path.name


def _bytes_written(metadata: Any) -> int:
    """What a DCP save wrote, over all ranks: the lengths its metadata records per item."""
    return sum(getattr(info, "length", 0) for info in (getattr(metadata, "storage_data", None) or {}).values())


def _unwritable(flag: str, path: str, err: OSError) -> str:
    return (
        f"{flag} {path}: cannot write it ({err.strerror or err}); create its directory, "
        f"fix its permissions or pass another {flag}"
    )


def _check_writable_file(flag: str, path: str) -> None:
    """Prove a file that is written at the end of the run writable now (ConfigError if not);
    a file that did not exist is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):  # append: an existing file is left as it is
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ConfigError(_unwritable(flag, path, e)) from None


def _init_distributed() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # NCCL: bind the group to this rank's GPU up front (barrier() and the first collective would
    # otherwise guess the device, and torch warns "using the device under current context").
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else None
    timeout = datetime.timedelta(minutes=10)
    env = os.environ
    restarted = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if "RANK" in env and restarted and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun the workers share the agent's TCPStore, and torch (2.13 rendezvous.py
        # `_create_c10d_store`) assumes a fresh store per restart. It is not always fresh: after
        # a --max-restarts restart, re-spawned ranks read the dead ranks' gloo addresses from the
        # previous attempt and fail "connectFullMesh ... Connection refused". A prefix per attempt
        # (what older torch did) keeps each attempt's keys apart.
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world, is_master=False, timeout=timeout
        )
        prefixed = dist.PrefixStore(f"gpufleet/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout, device_id=device)
    elif "RANK" in env:
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:  # plain `python -m workloads.train`: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device)


def main(argv: list[str] | None = None) -> int:
    """Parse, train, and always leave the process group; returns the exit code."""
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # the launcher prefixes lines as they come
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def error(err: Exception) -> None:
        if isinstance(err, _StoppedElsewhere):
            return  # the rank that failed printed why
        if getattr(err, _EVERY_RANK, False):
            if rank == 0:
                print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
            return
        # Met by this rank alone: only it can say so, and says where it runs.
        where = f"rank {rank} (host {socket.gethostname()}): " if world > 1 else ""
        print(f"{ERROR_PREFIX}{where}{err}", file=sys.stderr, flush=True)

    try:
        cfg = config_from_args(argv)
    except ConfigError as e:
        error(_every_rank(e))  # every rank parses the same flags
        return EXIT_BAD_ARGS
    _init_distributed()
    # Trainer.fit turns SIGTERM into a stop flag while it trains. Outside the loop (the final
    # save, --save-params, the exit barrier, interpreter exit) a SIGTERM must not kill the
    # process either: Spot VMs are often reclaimed a moment apart, and a second notice arriving
    # while rank 0 saves or leaves would turn a clean preemption into a failure (issue 7). So it
    # is ignored until the process exits (main is the program's entry point; nothing runs after
    # it). SIG_IGN, not a Python no-op: CPython resets Python-level handlers to SIG_DFL while the
    # interpreter finalizes, and a notice landing then still killed the worker. Bounded: torchrun
    # and the launcher follow SIGTERM with SIGKILL after their grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.fit()
        # All ranks leave together: a rank that tears its gloo pairs down while a peer is still
        # in the last collective can abort in C++ at exit ("terminate called without an active
        # exception", seen with torch 2.13 on CPU).
        dist.barrier()
        return 0
    except ConfigError as e:
        error(e)
        return EXIT_BAD_ARGS
    except CheckpointError as e:
        error(e)
        return 1
    finally:
        # Free the model (DDP's reducer, FSDP's state: they hold the process group and its
        # threads) before the group goes, not during interpreter shutdown, where a C++ thread
        # still joinable aborts the process with that same message.
        del trainer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
