"""Run by the `launch top` tests under torchrun, one process per node: every pair of ranks runs
its own gloo all_reduce loop (a process group per pair, a thread per group) for SECONDS, so a
slow link slows only the pairs that cross it, as a slow NIC does to the rings through it.

    python top_pairs_script.py SECONDS [FLOATS]

Each pair stops together: after every all_reduce of the data it all_reduces a "go on" flag (the
minimum of both sides' "before the deadline"), so neither side waits on a partner that left.
Prints `pairs done rank=R iters=A:N,B:M` (iterations per partner) at the end.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def main() -> int:
    seconds = float(sys.argv[1])
    floats = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = {}
        for a in range(world):
            for b in range(a + 1, world):
                g = dist.new_group([a, b])  # every rank creates every group, in the same order
                if rank in (a, b):
                    groups[b if a == rank else a] = g
        deadline = time.monotonic() + seconds
        iters = {peer: 0 for peer in groups}

        def loop(peer: int, group) -> None:
            data = torch.ones(floats)
            flag = torch.ones(1)
            while True:
                dist.all_reduce(data, group=group)
                data.fill_(1.0)
                iters[peer] += 1
                flag.fill_(1.0 if time.monotonic() < deadline else 0.0)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
                if flag.item() == 0.0:
                    return

        threads = [threading.Thread(target=loop, args=(p, g)) for p, g in groups.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts = ",".join(f"{p}:{n}" for p, n in sorted(iters.items()))
        os.write(1, f"pairs done rank={rank} iters={counts}\n".encode())
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
