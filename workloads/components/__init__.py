"""The Trainer's side jobs, one component each (the layout of torchtitan's
torchtitan/components/): the Trainer builds them and calls them at named points of its loop.

- `preemption`: SIGTERM turned into a stop every rank agrees on at a step boundary.
- `timing`: seconds per step between log lines; each rank's compute time for the straggler check.
- `metrics`: rank 0's step line (loss, lr, step time, tokens/s, MFU, memory) and --metrics-file.
- `profiler`: the torch.profiler trace of --profile-steps and the named NVTX/profiler ranges.
- `optimizer`, `lr_scheduler`: AdamW, its warmup-cosine schedule, the loss scaler, the step.
- `float8`: --precision fp8, the Linear layers converted by torchao.float8 (imported on use only).

Checkpoints have a package of their own: `workloads.checkpoint` (CheckpointManager).
"""

from workloads.components.lr_scheduler import build_lr_scheduler, lr_factor
from workloads.components.metrics import MetricsLogger, check_writable_file, unwritable
from workloads.components.optimizer import Optimizers, build_optimizer
from workloads.components.preemption import Preemption
from workloads.components.profiler import Profiler, trace_range
from workloads.components.timing import StepClock, Stragglers

__all__ = [
    "MetricsLogger",
    "Optimizers",
    "Preemption",
    "Profiler",
    "StepClock",
    "Stragglers",
    "build_lr_scheduler",
    "build_optimizer",
    "check_writable_file",
    "lr_factor",
    "trace_range",
    "unwritable",
]
