"""nccl-tests outputs written from its documented format (NVIDIA/nccl-tests src/util.cu)."""

# nccl-tests 2.13+: #wrong, redop and root columns; 2 nodes × 8 ranks (16 rank lines); one row
# with 3 wrong elements in place; mpirun noise and an NCCL INFO line between the lines.
MODERN_ALL_GATHER = (
    """\
# nccl-tests version 2.13.9 nccl-headers=21903 nccl-library=21903
# Collective test starting: ./build/all_gather_perf
# nThread 1 nGpus 1 minBytes 8388608 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 200 agg iters: 1 validation: 1 graph: 0
#
# Using devices
"""
    + "".join(
        f"#  Rank {r:2d} Group  0 Pid {1000 + r:6d} on a3mega-{r // 8} device {r % 8:2d} [0000:{r:02x}:00] NVIDIA H100 80GB HBM3\n"
        for r in range(16)
    )
    + """\
#
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)        
     8388608         32768     float    none      -1    200.1   41.92   39.30       0    199.8   41.98   39.36       0
    16777216         65536     float    none      -1    197.8   84.82   79.52       0    197.0   85.16   79.84       0
a3mega-0:1234:1300 [0] NCCL INFO comm 0x55 rank 0 nranks 16 - Init COMPLETE
Warning: Permanently added 'a3mega-1' (ED25519) to the list of known hosts.
  8589934592      33554432     float    none      -1    42668  201.32  188.73       0    42654  201.39  188.80       3
# Out of bounds values : 3 FAILED
# Avg bus bandwidth    : 102.925 
#
# Collective test concluded: ./build/all_gather_perf
"""
)

# Before 2020: `error` (max abs error) instead of #wrong, no root column (all_reduce).
OLD_ALL_REDUCE = """\
# nThread 1 nGpus 8 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  12345 on     dgx1 device  0 [0x06] Tesla V100-SXM2-32GB
#
#                                                     out-of-place                       in-place          
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
           8             2   float     sum    35.12    0.00    0.00  0e+00    35.02    0.00    0.00  0e+00
     1048576        262144   float     sum    58.40   17.95   31.42  2e-07    58.00   18.08   31.64  2e-07
   134217728      33554432   float     sum   1480.2   90.68  158.69  5e-01   1478.9   90.76  158.83  0e+00
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 63.2633 
"""

# nccl-tests issue #82 era broadcast: `type root`, no redop.
OLD_BROADCAST = """\
#                                                 out-of-place                       in-place          
#       size         count    type    root     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       
     1048576        262144   float       0    65.11   16.10   16.10  0e+00    64.80   16.18   16.18  0e+00
"""

# Two binaries' outputs concatenated (the launcher runs one after the other), with -c 0 (N/A) in
# the second, and an in-place-only row (nccl-tests writeBenchMarkLineNullBody prints blanks).
TWO_TESTS = """\
# Collective test starting: all_reduce_perf
#  Rank  0 Group  0 Pid   1000 on     node-0 device  0 [0000:04:00] NVIDIA A100-SXM4-40GB
#  Rank  1 Group  0 Pid   1001 on     node-1 device  0 [0000:04:00] NVIDIA A100-SXM4-40GB
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
     1048576        262144     float     sum      -1    120.5    8.70    8.70       0    119.9    8.75    8.75       0
     2097152        524288     float     sum      -1                                      230.1    9.11    9.11       0
# Collective test starting: alltoall_perf
#  Rank  0 Group  0 Pid   1000 on     node-0 device  0 [0000:04:00] NVIDIA A100-SXM4-40GB
#  Rank  1 Group  0 Pid   1001 on     node-1 device  0 [0000:04:00] NVIDIA A100-SXM4-40GB
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
     1048576        131072     float    none      -1    250.0    4.19    2.10    N/A    251.0    4.18    2.09    N/A
"""
