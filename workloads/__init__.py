"""The node side of gpufleet: what runs under torchrun on every node.

- `workloads.train`: GPT training (DDP/FSDP, checkpoints to disk or GCS, MFU), entry point
  `python -m workloads.train`; its pieces are `config` (flags, validation), `model`, `data`,
  `checkpoint`, `metrics` and `components` (the Trainer's side jobs: preemption, timing and
  stragglers, metrics, profiler, optimizer and LR schedule).
- `workloads.sweep`: an nccl-tests style collective sweep (busbw tables and a `#gpufleet-json`
  line for the launcher), entry point `python -m workloads.sweep`; a package by job (config,
  expected data, cases, bench, table, driver).

This file imports nothing, so `import workloads` stays cheap and torch-free.
"""
