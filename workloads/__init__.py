"""The node side of gpufleet: what runs under torchrun on every node.

- `workloads.train`: GPT training (DDP/FSDP, checkpoints to disk or GCS, MFU), entry point
  `python -m workloads.train`; its pieces are `config` (flags, validation), `model`, `data`,
  `checkpoint` and `metrics`.
- `workloads.sweep`: an nccl-tests style collective sweep (busbw tables and a `#gpufleet-json`
  line for the launcher), entry point `python -m workloads.sweep`.

This file imports nothing, so `import workloads` stays cheap and torch-free.
"""
