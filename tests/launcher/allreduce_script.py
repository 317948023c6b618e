"""Run by the launcher tests under torchrun on every node: a gloo all_reduce whose sum every rank
checks, plus a line naming the world size, the interface gloo was told and the node."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        expected = world * (world + 1) / 2
        line = (
            f"rank={rank} world={world} sum={t.item():g} expected={expected:g} "
            f"gloo_if={os.environ.get('GLOO_SOCKET_IFNAME', '')} node={os.environ['GPUFLEET_NODE_RANK']}\n"
        )
        # One write(2) per line: two ranks of a node share its stdout pipe, and a write below
        # PIPE_BUF is atomic, whereas print() may write the text and the newline separately.
        os.write(1, line.encode())
        return 0 if t.item() == expected else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
