"""What the rest of gpufleet may rely on from a fleet this program declares: moved to
`gpufleet.contracts`, which infra (the producer) and the launcher (the consumer) both import.

Kept as a re-export only while launcher modules outside this change still import it
(launcher/nccl_cmd.py: NCCL_TESTS_DIR, launcher/prestart.py: LOCAL_SSD_MOUNT, launcher/doctor.py:
READY_MARKER); infra's own modules and new code import gpufleet.contracts.
"""

from __future__ import annotations

from gpufleet.contracts import (
    LABEL_CLUSTER,
    LABEL_NODE,
    LOCAL_SSD_MOUNT,
    NCCL_TESTS_DIR,
    OUTPUT_KEYS,
    READY_MARKER,
)

__all__ = ["LABEL_CLUSTER", "LABEL_NODE", "READY_MARKER", "NCCL_TESTS_DIR", "LOCAL_SSD_MOUNT", "OUTPUT_KEYS"]
