"""Checkpoints: where they live (`store`: a local directory or gs://, with an atomic `latest`)
and the trainer's component that saves and loads them (`manager`: CheckpointManager). Import from
the module that holds a name."""
