"""GPT and Llama-3 training under torchrun: `python -m torch.distributed.run ... -m workloads.train [flags]`.

Ranks come from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK); NCCL on GPUs,
gloo on CPU. Only rank 0 logs; every rank writes its own shards of a checkpoint through
torch.distributed.checkpoint (workloads.checkpoint). The run is deterministic given --seed:
weights from the seed (built whole, or on the meta device and materialized shard by shard:
--init-device), data order from (seed, step), optimizer/scheduler/RNG states from the
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
import os
import signal
import socket
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from gpufleet.catalog import peak_flops_for_device
from gpufleet.contracts import ERROR_PREFIX
from workloads.checkpoint.manager import CheckpointManager, run_meta
from workloads.checkpoint.store import CheckpointError
from workloads.collective import Ranks, StoppedElsewhere, every_rank, is_every_rank
from workloads.components import (
    MetricsLogger,
    Optimizers,
    Preemption,
    Profiler,
    StepClock,
    Stragglers,
    build_lr_scheduler,
    build_optimizer,
    check_writable_file,
    trace_range,
)
from workloads.components.float8 import (
    device_capability,
    fp8_refusal,
    high_precision_state,
    precompute_scales,
    torchao_version,
)
from workloads.config import EXIT_BAD_ARGS, ConfigError, TrainConfig, config_from_args
from workloads.data import BatchStream, SyntheticTokens, TokenFile
from workloads.llama import flops_per_token as llama_flops_per_token
from workloads.metrics import RankInfo
from workloads.model import flops_per_token
from workloads.parallel.build import ModelBuilder, build_line
from workloads.parallel.grads import clip_grad_norm
from workloads.parallel.parallelize import (
    build_mesh,
    local,
)

__all__ = ["Trainer", "main"]

# Full (unsharded) state dicts gathered on rank 0, in CPU memory: what --save-params writes.
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Trainer:
    """One process's share of the run. Named steps: build, train_step, fit, save_params; the side
    jobs (checkpoints, preemption, timing, metrics, profiler, optimizer) are components."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self._place()
        self.ranks = self._where_ranks_run()
        self.comms = Ranks(self.rank, self.world, self.device)
        self.checkpoint = CheckpointManager(cfg, self.comms, self.ranks)
        # Output paths are proven writable now, not at the first log line or after the last step.
        if cfg.checkpoint.save_params:
            self.comms.on_rank0(lambda: check_writable_file("--save-params", cfg.checkpoint.save_params))
        self.metrics = MetricsLogger(self.comms, cfg.metrics.metrics_file, self.device)
        self.profiler = Profiler(cfg.profiling, self.rank, self.cuda)
        if cfg.profile_range is not None:
            self.comms.on_every_rank(self.profiler.check_dir)  # every rank writes its own trace
        self.preemption = Preemption(self.world, self.device)
        self.stragglers = Stragglers(cfg.metrics, self.ranks, self.device)
        self.dims = cfg.dims
        self.coords = self.dims.coordinates(self.rank)
        # One loss per data-parallel replica: the last pipeline stage's, from its first TP rank.
        self.reports_loss = self.coords["pp"] == self.dims.pp - 1 and self.coords["tp"] == 0
        self.mesh = None if self.dims.is_ddp else build_mesh(self.dims, self.device.type)
        self._warn_tp_across_nodes()
        self.built = ModelBuilder(cfg, self.dims, self.mesh, self.coords, self.device, self.world, self.ptdtype).build()
        self.model, self.raw_model, self.tied = self.built.model, self.built.raw, self.built.tied
        self.build_growths: list[Any] = [None] * self.world
        dist.all_gather_object(self.build_growths, self.built.build_growth)
        self.optimizers = self._build_optimizers()
        self.batches = self.comms.on_every_rank(self._open_data)  # --data may be missing on one node only
        self.metrics.flops_token = self._flops_per_token()
        self.metrics.peak_flops = peak_flops_for_device(torch.cuda.get_device_name(self.device)) if self.cuda else None
        self.step = 0
        meta = {**run_meta(cfg, self.world), "layout": self.dims.describe()}
        self.checkpoint.track(self.raw_model, self.optimizers.optimizer, self, meta)

    # ---- build ---------------------------------------------------------------------------

    def _place(self) -> None:
        """This rank, its device and its precision (torchrun's environment)."""
        cfg = self.cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{self.local_rank}" if self.cuda else "cpu")
        asked = cfg.model_spec.precision
        self.precision = asked if asked != "auto" else ("bf16" if self.cuda else "fp32")
        # fp8: the converted Linear layers compute in float8 (workloads.components.float8), the
        # rest under bf16 autocast, as torchtitan pairs float8 with bf16 mixed precision.
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
        self.ptdtype = dtypes[self.precision]
        if self.precision == "fp8":
            why = fp8_refusal(
                torch_version=torch.__version__,
                torchao_version=torchao_version(),
                capability=device_capability(self.device),
                device_name=torch.cuda.get_device_name(self.device) if self.cuda else None,
            )
            if why:
                raise every_rank(ConfigError(why))
        if cfg.ddp.compression == "bf16" and not self.cuda:
            raise every_rank(
                ConfigError(
                    "--compression bf16 needs CUDA and NCCL 2.10+ (torch's "
                    "bf16_compress_hook); on CPU use fp16 or powersgd"
                )
            )
        if self.cuda:
            torch.cuda.set_device(self.device)
            # TF32 matmuls/convs on Ampere+: ~free speed for fp32 parts (PyTorch CUDA semantics docs).
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _flops_per_token(self) -> float:
        cfg, size = self.cfg, self.cfg.size
        if cfg.is_llama:
            return llama_flops_per_token(cfg.model_spec.model, cfg.tokens_per_sample)
        head_dim = size.n_embd // size.n_head
        return flops_per_token(self.built.n_params, size.n_layer, size.n_head, head_dim, cfg.tokens_per_sample)

    def _where_ranks_run(self) -> list[RankInfo]:
        me = RankInfo(self.rank, int(os.environ.get("GROUP_RANK", "0")), socket.gethostname())
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, me)
        return everyone

    def _open_data(self) -> BatchStream:
        cfg = self.cfg
        seq_len, vocab = cfg.tokens_per_sample, cfg.size.vocab_size
        dataset = (
            TokenFile(cfg.training.data, seq_len, vocab)
            if cfg.training.data
            else SyntheticTokens(cfg.training.synthetic_samples, seq_len, vocab, cfg.training.seed)
        )
        # By data-parallel rank: the TP and PP ranks of one replica train on the same samples, and
        # the samples of a step are the same whatever the layout.
        dp_rank = self.dims.dp_rank(self.rank)
        return BatchStream(dataset, dp_rank, self.dims.dp, cfg.training.micro_batch, cfg.grad_accum, cfg.training.seed)

    def _warn_tp_across_nodes(self) -> None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if self.dims.tp > local_world:
            self.log(
                f"warning: --tp {self.dims.tp} is more than the {local_world} ranks of a node: tensor "
                "parallelism's per-layer all-reduces cross the network; keep --tp <= --nproc-per-node",
                stream=sys.stderr,
            )

    def _build_optimizers(self) -> Optimizers:
        cfg, dims = self.cfg, self.dims
        optimizer = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad],
            cfg.optimizer,
            dp=dims.dp,
            mixed_tensors=dims.tp > 1 or dims.pp > 1,
            cuda=self.cuda,
        )
        scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        return Optimizers(optimizer, scheduler, scaler)

    # ---- what a checkpoint holds besides model and optimizer (CheckpointManager's TrainState) ----

    def state_dict(self) -> dict[str, Any]:
        epoch, in_epoch = self.batches.position(self.step)
        return {
            **self.optimizers.state_dict(),
            "step": self.step,
            "data": {
                "epoch": epoch,
                "step_in_epoch": in_epoch,
                "samples_seen": self.step * self.cfg.training.global_batch,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizers.load_state_dict(state)
        self.step = state["step"]

    # ---- training ------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.ptdtype)

    def _range(self, name: str) -> contextlib.AbstractContextManager[None]:
        return trace_range(name, self.cuda)

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient all-reduce on all but the last micro-step: one all-reduce per optimizer step."""
        if last or self.dims.dp == 1:
            return contextlib.nullcontext()
        if not self.dims.is_ddp:
            return _fsdp_no_sync(self.raw_model)
        return self.model.no_sync()  # type: ignore[operator]

    def train_step(self) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches; returns this rank's mean loss, or 0
        on a rank that does not report one (see `reports_loss`)."""
        if self.built.schedule is not None:
            return self._pipeline_step()
        total = torch.zeros((), device=self.device)
        for micro in range(self.cfg.grad_accum):
            total += self._micro_step(micro)
        self._optimizer_step()
        return total if self.reports_loss else torch.zeros_like(total)

    def _micro_step(self, micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; its share of the step's loss."""
        accum = self.cfg.grad_accum
        x, y = self.batches.micro_batch_at(self.step, micro)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self._sync_context(micro == accum - 1):
            # Forward has no collectives under DDP, so its time is this rank's own speed
            # (the straggler signal); under FSDP it includes the parameter all-gathers.
            with self.stragglers.timed(), self._range("forward"), self._autocast():
                loss = self.model(x, y) / accum
            with self._range("backward"):
                self.optimizers.backward(loss)
        return loss.detach()

    def _pipeline_step(self) -> torch.Tensor:
        """One optimizer step through the pipeline: this rank's whole batch (its grad_accum
        micro-batches, the same samples as without a pipeline) in --pp-microbatches pieces."""
        cfg = self.cfg
        pieces = [self.batches.micro_batch_at(self.step, m) for m in range(cfg.grad_accum)]
        x = torch.cat([p[0] for p in pieces]).to(self.device)
        y = torch.cat([p[1] for p in pieces]).to(self.device)
        losses: list[torch.Tensor] = []
        with self._range("pipeline"), self._autocast():
            if self.built.pp_first:
                self.built.schedule.step(x, target=y, losses=losses)
            else:
                self.built.schedule.step(target=y, losses=losses)
        if self.built.tied_group is not None:
            self._reduce_tied_grads()
        self._optimizer_step()
        if self.built.pp_last and self.reports_loss:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=self.device)

    def _reduce_tied_grads(self) -> None:
        """The head's share of the tied embedding's gradient, and the embedding's, summed."""
        for p in self.tied:
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # DTensor's embedding backward leaves the gradient of a row-wise sharded
                # embedding replicated; take the parameter's own shard, as the head has.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(local(p.grad), group=self.built.tied_group)

    def _optimizer_step(self) -> None:
        with self._range("optimizer"):
            self.optimizers.step(self._clip_grads if self.cfg.optimizer.grad_clip else None)
            if self.built.fp8 is not None and self.built.fp8.precompute:
                precompute_scales(self.raw_model)
        self.step += 1

    def _clip_grads(self) -> None:
        """The global gradient norm clipped to --grad-clip (across pipeline stages under PP)."""
        if self.dims.is_ddp:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
            return
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        clip_grad_norm(list(self.raw_model.parameters()), self.cfg.optimizer.grad_clip, pp_group, self.built.clip_skip)

    def fit(self) -> None:
        """Train to --steps (from the checkpoint with --resume), then the final save; a SIGTERM
        ends it early with a checkpoint of the last whole step."""
        cfg = self.cfg
        if cfg.checkpoint.resume:
            self.checkpoint.restore()
        self.log(self._banner())
        self.log(build_line(self.built, not self.dims.is_ddp, self.build_growths))
        if self.built.fp8 is not None:
            self.log(self.built.fp8.describe())
        try:
            with self.preemption.watching(), self.profiler.running(self.step):
                if self._train_loop():
                    return
        finally:
            self.metrics.close()
        self.checkpoint.wait_local()
        if self.checkpoint.enabled:
            self.checkpoint.save()
        if cfg.checkpoint.save_params:
            self.save_params(cfg.checkpoint.save_params)
        self.log(f"done: {self.step} steps")

    def _train_loop(self) -> bool:
        """The steps left; True when a SIGTERM stopped them (its checkpoint saved)."""
        cfg = self.cfg
        clock = StepClock(self.step)
        while self.step < cfg.training.steps:
            loss = self.train_step()
            self.profiler.step()
            if self.step % cfg.metrics.log_every == 0 or self.step == cfg.training.steps:
                self._log_step(loss, clock)
            self.stragglers.check(self.step, lambda line: self.log(line, stream=sys.stderr))
            if self._preempted():
                return True
            if self._local_checkpoint_due():
                self.checkpoint.save_local()
            if self._checkpoint_due():
                self.checkpoint.save(asynchronous=cfg.checkpoint.async_checkpoint)
        return False

    def _local_checkpoint_due(self) -> bool:
        """A node-local save (--local-checkpoint-every) after this step, the last one included."""
        every = self.cfg.checkpoint.local_checkpoint_every
        return bool(every) and self.step % every == 0

    def _checkpoint_due(self) -> bool:
        """A periodic save (--checkpoint-every) after this step; the last step's is fit's own."""
        every, last = self.cfg.checkpoint.checkpoint_every, self.cfg.training.steps
        return self.checkpoint.enabled and bool(every) and self.step % every == 0 and self.step < last

    def _preempted(self) -> bool:
        """Collective: whether any rank had a SIGTERM; if so, the checkpoint of this step saved."""
        notice_s = self.preemption.notice_age()
        if notice_s is None:
            return False
        self.log(f"SIGTERM: saving a checkpoint at step {self.step} and exiting; rerun with --resume to continue")
        if self.checkpoint.local is not None:
            # The node's own disk first: the fastest copy to write inside the notice.
            self.checkpoint.save_local(wait=True)
        if self.checkpoint.enabled:
            self.checkpoint.save_on_preemption(notice_s)
        return True

    def save_params(self, path: str) -> None:
        """Rank 0 writes the final parameters (full state_dict) for comparison between runs."""
        sd = high_precision_state(get_model_state_dict(self.model, options=_SAVE))

        def write() -> None:
            try:
                torch.save(sd, path)
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"cannot write --save-params {path}: {e}") from None

        self.comms.on_rank0(write)

    # ---- reporting -----------------------------------------------------------------------------

    def _banner(self) -> str:
        cfg, dims = self.cfg, self.dims
        peak_flops = self.metrics.peak_flops
        peak = f"{peak_flops:.3g} FLOP/s (gpufleet.catalog)" if peak_flops else "n/a"
        # "ddp x 4 ranks", "fsdp x 4 ranks", or the mesh: "dp_shard 2 x tp 2 = 4 ranks".
        if self.world == 1 or dims.is_ddp or dims.dp_shard == self.world:
            kind = cfg.layout.parallelism if self.world == 1 else "ddp" if dims.is_ddp else "fsdp"
            layout = f"{kind} x {self.world} ranks"
        else:
            layout = f"{dims.describe()} = {self.world} ranks"
        params = f"{self.built.n_params / 1e6:.2f}M params"
        return (
            f"train: model {cfg.model_spec.model} ({params}) | {layout} on {self.device.type} "
            f"({dist.get_backend()}) | {self.precision} | {cfg.batch_summary()} | seq "
            f"{cfg.tokens_per_sample} | steps {self.step}->{cfg.training.steps} | "
            f"{self.metrics.flops_token:.3g} FLOP/token (6N+12LHQT) | peak {peak} | init {self.built.init_device}"
        )

    def _log_step(self, loss: torch.Tensor, clock: StepClock) -> None:
        """Collective: the replicas' mean loss, then rank 0's step line."""
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss_value = loss.item() / self.dims.dp  # .item() waits for the GPU: times are real
        step_s = clock.lap(self.step)
        cfg = self.cfg
        tokens_per_s = cfg.training.global_batch * cfg.tokens_per_sample / step_s
        self.metrics.log_step(self.step, cfg.training.steps, loss_value, self.optimizers.last_lr, step_s, tokens_per_s)

    def log(self, line: str, stream: Any = None) -> None:
        self.comms.log(line, stream)


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


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


def _print_plan(cfg: TrainConfig) -> int:
    """--plan: the memory plan on stdout, no process group; exit 2 for a layout that cannot run."""
    from workloads.plan import format_plan, plan_for

    try:
        lines = format_plan(plan_for(cfg, machine_type=cfg.plan_machine_type, nodes=cfg.plan_nodes))
    except ConfigError as e:
        print(f"{ERROR_PREFIX}{e}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGS
    print("\n".join(lines), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse, train, and always leave the process group; returns the exit code."""
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # the launcher prefixes lines as they come
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def error(err: Exception) -> None:
        if isinstance(err, StoppedElsewhere):
            return  # the rank that failed printed why
        if is_every_rank(err):
            if rank == 0:
                print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
            return
        # Met by this rank alone: only it can say so, and says where it runs.
        where = f"rank {rank} (host {socket.gethostname()}): " if world > 1 else ""
        print(f"{ERROR_PREFIX}{where}{err}", file=sys.stderr, flush=True)

    try:
        cfg = config_from_args(argv)
    except ConfigError as e:
        error(every_rank(e))  # every rank parses the same flags
        return EXIT_BAD_ARGS
    if cfg.planning.plan:
        return _print_plan(cfg) if rank == 0 else 0
    _init_distributed()
    # Trainer.fit turns SIGTERM into a stop flag while it trains. Outside the loop (the final
    # save, --save-params, the exit barrier, interpreter exit) a SIGTERM must not kill the
    # process either: Spot VMs are often reclaimed a moment apart, and a second notice arriving
    # while rank 0 saves or leaves would turn a clean preemption into a failure. So it
    # is ignored until the process exits (main is the program's entry point; nothing runs after
    # it). SIG_IGN, not a Python no-op: CPython resets Python-level handlers to SIG_DFL while the
    # interpreter finalizes, and a notice landing then still killed the worker. Bounded: torchrun
    # and the launcher follow SIGTERM with SIGKILL after their grace period.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer, done = None, False
    try:
        trainer = Trainer(cfg)
        trainer.fit()
        # All ranks leave together: a rank that tears its gloo pairs down while a peer is still
        # in the last collective can abort in C++ at exit ("terminate called without an active
        # exception", seen with torch 2.13 on CPU).
        dist.barrier()
        done = True
        return 0
    except ConfigError as e:
        error(e)
        return EXIT_BAD_ARGS
    except CheckpointError as e:
        error(e)
        return 1
    finally:
        if not done:
            # Failed (a peer lost, an error): nothing is left to save, and tearing down a group
            # whose peer is gone takes seconds. A stop's SIGTERM ends this rank at once instead
            # of after its grace, so the job trains again sooner (issue 42: time to train again).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Free the model (DDP's reducer, FSDP's state: they hold the process group and its
        # threads) before the group goes, not during interpreter shutdown, where a C++ thread
        # still joinable aborts the process with that same message.
        del trainer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
