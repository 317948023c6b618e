"""torchrun's command line for one node: processes per node and the rendezvous (static on node 0,
or c10d for in-place restarts). Pure functions: they build argv."""

from __future__ import annotations

from collections.abc import Sequence

from launcher.core.types import Cluster, LaunchConfig, Node

__all__ = ["join_timeout_s", "nproc_for", "torchrun_argv", "torchrun_argvs"]


def join_timeout_s(nnodes: int) -> int:
    """Rendezvous timeout: torch's default 600 s for small jobs, plus 5 s per node beyond 64, since
    the last node to boot and connect arrives later on a big cluster."""
    return 600 + 5 * max(0, nnodes - 64)


def nproc_for(node: Node, gpu_count: int | None, config: LaunchConfig) -> int:
    """--nproc-per-node, else the hostfile's slots, else the catalog's GPU count, else 1 (CPU)."""
    if config.nproc_per_node is not None:
        return config.nproc_per_node
    if node.slots is not None:
        return node.slots
    return gpu_count or 1


def torchrun_argv(
    cluster: Cluster, node: Node, config: LaunchConfig, nproc: int, workload_argv: Sequence[str]
) -> list[str]:
    """`python -m torch.distributed.run ...` for one node, with a static rendezvous on node 0:
    the node's group rank is its rank in the cluster's order, so RANK 0 runs on node 0."""
    head = cluster.nodes[0]
    n = len(cluster.nodes)
    # IPv6 in brackets, as torchrun's --master-addr help asks (torch/distributed/run.py).
    master = f"[{head.address}]" if ":" in head.address else head.address
    if config.max_restarts > 0:
        # torchrun's in-place restarts need the c10d rendezvous: under a static one each agent
        # restarts on its own count (static_tcp_rendezvous.py has no rounds, num_nodes_waiting is
        # always 0), so two nodes that restart a different number of times wait on different
        # stores for ever. c10d assigns the group ranks itself (the order line says so).
        rendezvous = [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master}:{config.rdzv_port}",
            f"--rdzv-id={config.job_id}",
            # is_host: node 0 hosts the store (torch's guess from hostnames fails in namespaces).
            f"--rdzv-conf=join_timeout={join_timeout_s(n)},is_host={1 if node.rank == 0 else 0}",
        ]
    else:
        # A static rendezvous (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py):
        # the group rank is --node-rank and node 0 hosts the TCPStore on --master-port. A c10d
        # rendezvous would assign group ranks by sorting the nodes' addresses
        # (dynamic_rendezvous.py, `_mark_rendezvous_complete`), throwing the order away.
        rendezvous = [
            "--rdzv-backend=static",
            f"--master-addr={master}",
            f"--master-port={config.rdzv_port}",
            f"--node-rank={node.rank}",
            f"--rdzv-id={config.job_id}",
            # How long the store waits for every node (the static handler's `timeout`).
            f"--rdzv-conf=timeout={join_timeout_s(n)}",
        ]
    return [
        config.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={n}",
        f"--nproc-per-node={nproc}",
        *rendezvous,
        # The address the other nodes reach this one at. Left out, torch uses socket.getfqdn(),
        # which on a node whose /etc/hosts maps its hostname to 127.0.0.1 is "localhost".
        f"--local-addr={node.address}",
        f"--max-restarts={config.max_restarts}",
        *workload_argv,
    ]


def torchrun_argvs(cluster: Cluster, config: LaunchConfig) -> dict[int, list[str]]:
    """Every node's torchrun command for `config.workload`, by rank."""
    gpus = cluster.gpus_per_node
    return {
        n.rank: torchrun_argv(cluster, n, config, nproc_for(n, gpus, config), config.workload.argv)
        for n in cluster.nodes
    }
