"""The node side of gpufleet: what runs under torchrun on every node.

- `workloads.train`: GPT training (DDP/FSDP, checkpoints to disk or GCS, MFU), entry point
  `python -m workloads.train`; its pieces are `config` (flags, validation), `model`, `data`,
  `checkpoint` and `metrics`.

This file imports nothing, so `import workloads` stays cheap and torch-free.
"""
