"""Starting the cluster's stopped Spot VMs again (`--restart-stopped`): our Spot nodes
stop, not delete, on preemption (instanceTerminationAction STOP), so a preempted node is an
instance in TERMINATED that `instances.start` boots with its disk as it was
(https://cloud.google.com/compute/docs/instances/spot#preemption-process).

Called by the controller on node 0 (launcher.jobs.recovery) for the nodes a relaunch's check found
unreachable, when the cluster came from the stack outputs or labels (so the job's request knows
the project, the zone and each node's instance name). It asks `instances.get` first and starts
only an instance that is TERMINATED: one that is RUNNING, STAGING or being repaired is left to
come back on its own. The nodes' service account may do exactly this (infra grants
compute.instances.get and compute.instances.start on the cluster's own instances).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["instances_client", "start_terminated"]

log = logging.getLogger("launcher")


def instances_client(api_endpoint: str | None = None) -> Any:
    """google-cloud-compute's InstancesClient (REST): on a node, the VM's own service account
    (Application Default Credentials from the metadata server); with `api_endpoint` (tests), that
    endpoint without credentials."""
    try:
        from google.cloud import compute_v1
    except ImportError:
        # The controller runs with `python -S` (launcher.jobs.handoff): site-packages only when needed.
        import site

        site.main()
        from google.cloud import compute_v1
    if not api_endpoint:
        return compute_v1.InstancesClient(transport="rest")
    from google.auth.credentials import AnonymousCredentials

    return compute_v1.InstancesClient(
        credentials=AnonymousCredentials(), transport="rest", client_options={"api_endpoint": api_endpoint}
    )


def start_terminated(client: Any, project: str, zone: str, names: list[str]) -> dict[str, str]:
    """For each instance name: `instances.get`, and `instances.start` when it is TERMINATED.
    Returns what happened to each, in one line (an API error is reported, never raised)."""
    done = {}
    for name in names:
        try:
            status = client.get(project=project, zone=zone, instance=name).status
            if status != "TERMINATED":
                done[name] = f"left alone ({status})"
                continue
            client.start_unary(project=project, zone=zone, instance=name)
            done[name] = "started (it was TERMINATED)"
        except Exception as e:  # google.api_core's errors, or the network: the wait goes on
            done[name] = f"could not be started: {type(e).__name__}: {e}"
        log.warning("instance %s in %s/%s: %s", name, project, zone, done[name])
    return done
