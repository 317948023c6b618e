"""Checkpoints: where they live (`store`: a local directory or gs://, with an atomic `latest`),
the node-local tier (`local`: each rank's own copy on its node, in gpufleet.local_tier's layout)
and the trainer's component that saves and loads them (`manager`: CheckpointManager). Import
from the module that holds a name."""
