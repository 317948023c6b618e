"""Checkpoints: where they live (`store`: a local directory or gs://, with an atomic `latest`)
and the trainer's component that saves and loads them (`manager`: CheckpointManager)."""

from workloads.checkpoint.manager import CheckpointManager, TrainState, rng_state, run_meta
from workloads.checkpoint.store import (
    METADATA,
    CheckpointError,
    CheckpointStore,
    GCSStore,
    LocalStore,
    checkpoint_name,
    decode_state,
    encode_state,
    failure_cause,
    failure_line,
    has_os_error,
    is_full_state,
    load_checkpoint,
    load_file,
    open_store,
)

__all__ = [
    "CheckpointManager",
    "TrainState",
    "rng_state",
    "run_meta",
    "CheckpointError",
    "CheckpointStore",
    "LocalStore",
    "GCSStore",
    "open_store",
    "checkpoint_name",
    "is_full_state",
    "load_file",
    "load_checkpoint",
    "encode_state",
    "decode_state",
    "failure_cause",
    "failure_line",
    "has_os_error",
    "METADATA",
]
