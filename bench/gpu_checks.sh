#!/usr/bin/env bash
# The GPU path of gpufleet, run on a GPU machine; bench/RESULTS.md records what it printed.
#   bash bench/gpu_checks.sh [STAGE...]    stages: env train compile plan paths fp8 sweep smi doctor top (default: all)
# Needs python3 with a CUDA torch, click and rich; writes metrics and logs under $OUT (default
# /tmp/gpufleet-gpu). Nothing here runs in the test suite or CI: they have no GPU.
set -uo pipefail
out=${OUT:-/tmp/gpufleet-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
launch() { python3 -m launcher "$@"; }
stages=${*:-env train compile plan paths fp8 sweep smi doctor top}

# One node, one process: the GPU's own throughput (the launcher adds nothing per step).
train() {  # model micro_batch steps [extra train args...]
    local model=$1 mb=$2 steps=$3 tag; shift 3
    tag="$model-mb$mb$(printf '%s' "$*" | tr -c 'a-zA-Z0-9' '_')"
    launch train --local --nodes 1 --runs-dir "$out/runs" -- --model "$model" --steps "$steps" \
        --micro-batch "$mb" --global-batch "$mb" --warmup-steps 5 --log-every 10 \
        --metrics-file "$out/train-$tag.jsonl" "$@" 2>&1 | tail -n 8
}

for stage in $stages; do
    echo "== $stage"
    case $stage in
        env)
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
            python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
            ;;
        train)
            train 124M 16 60
            train 350M 16 60
            ;;
        compile)
            train 124M 16 60 --compile
            train 350M 16 60 --compile
            train 350M 32 60 --compile
            ;;
        plan)
            # The memory plan against the peaks it models: llama3-1b, micro-batch 4, seq 2048, one
            # rank, eager, checkpointed, compiled, and both; then FSDP2 with meta init on one rank.
            # The log's peak memory is torch.cuda.max_memory_allocated; the plan's (a 1-GPU machine
            # type: the bytes do not depend on it) is its total less the 2 GiB reserve.
            for mode in "" "--activation-checkpointing" "--compile" "--compile --activation-checkpointing"; do
                # shellcheck disable=SC2086  # $mode is zero to two flags
                train llama3-1b 4 40 --seq-len 2048 $mode
                # shellcheck disable=SC2086
                python3 -m workloads.train --plan --plan-machine-type a3-highgpu-1g --model llama3-1b \
                    --micro-batch 4 --seq-len 2048 $mode | grep -E "^mode|  total"
            done
            train llama3-1b 4 40 --seq-len 2048 --parallelism fsdp --init-device meta
            ;;
        paths)
            # The other GPU-only paths once each: FSDP2, fp16 with its GradScaler, the profiler
            # (CUDA activities, NVTX ranges), the straggler check's CUDA events, checkpoints on a
            # CUDA model saved and resumed, and `launch run` of a script using NCCL.
            train 350M 16 30 --parallelism fsdp --compile --straggler-every 10
            train 124M 16 20 --precision fp16
            train 124M 16 20 --profile-steps 10:12 --profile-dir "$out/profile"
            find "$out/profile" -type f | head -n 3
            train 124M 16 20 --checkpoint-dir "$out/ckpt" --checkpoint-every 10
            train 124M 16 30 --checkpoint-dir "$out/ckpt" --resume
            train 124M 16 40 --checkpoint-dir "$out/ckpt" --resume --checkpoint-every 5 --async-checkpoint
            ls "$out/ckpt"
            cat >"$out/nccl_check.py" <<'PY'
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
t = torch.ones(1 << 20, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
print(f"nccl all_reduce ok={bool((t == n * (n + 1) / 2).all())} world={n} nccl={torch.cuda.nccl.version()}")
dist.destroy_process_group()
PY
            launch run --local --nodes 1 --runs-dir "$out/runs" -- "$out/nccl_check.py" 2>&1 | tail -n 3
            ;;
        fp8)
            # --precision fp8 (torchao.float8) against bf16 on this one GPU, in the same run:
            # llama3-1b compiled, micro-batch 4, seq 2048, 200 steps, the same seed. Checks (issue
            # 43): fp8 rowwise >= 1.15x bf16's tokens/s and tensorwise >= 1.2x (the median of the
            # logged steps after step 20, compilation done); loss at step 200 within 1% of bf16's;
            # peak memory (torch.cuda.max_memory_allocated) within 10% of --plan's total less its
            # 2 GiB reserve (a 1-GPU machine type: the bytes do not depend on it).
            nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
            python3 -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__, torch.cuda.get_device_name(), "SM", torch.cuda.get_device_capability())'
            fp8_args=(--seq-len 2048 --compile --seed 1337)
            for precision in bf16 "fp8 --fp8-recipe rowwise" "fp8 --fp8-recipe tensorwise"; do
                # shellcheck disable=SC2086  # $precision is one to three words
                train llama3-1b 4 200 "${fp8_args[@]}" --precision $precision
                # shellcheck disable=SC2086
                python3 -m workloads.train --plan --plan-machine-type a3-highgpu-1g --model llama3-1b \
                    --micro-batch 4 --seq-len 2048 --compile --precision $precision \
                    | grep -E "^mode|^fp8|  total" | tee "$out/plan-fp8-$(printf '%s' "$precision" | tr -c 'a-z0-9' '_').txt"
            done
            python3 - "$out" <<'PY'
import glob, json, re, statistics, sys
out = sys.argv[1]
def run(tag):
    [path] = glob.glob(f"{out}/train-llama3-1b-mb4*{tag}*.jsonl")
    rows = [json.loads(line) for line in open(path)]
    steady = [r["tokens_per_s"] for r in rows if r["step"] > 20]
    return statistics.median(steady), rows[-1]["loss"], max(r["peak_mem_gib"] for r in rows), rows[-1]["step"]
def plan(tag):
    [path] = glob.glob(f"{out}/plan-fp8-{tag}*.txt")
    return float(re.search(r"total\s+([0-9.]+) GiB", open(path).read()).group(1)) - 2.0
bf16 = run("precision_bf16")
print(f"bf16: {bf16[0]:,.0f} tok/s, loss {bf16[1]:.4f} at step {bf16[3]}, peak {bf16[2]:.2f} GiB (plan {plan('bf16'):.2f})")
for recipe, need in (("rowwise", 1.15), ("tensorwise", 1.2)):
    tps, loss, mem, step = run(f"fp8___fp8_recipe_{recipe}")
    want = plan(f"fp8___fp8_recipe_{recipe}")
    speed, dloss, dmem = tps / bf16[0], abs(loss - bf16[1]) / bf16[1], abs(mem - want) / want
    print(f"fp8 {recipe}: {tps:,.0f} tok/s = {speed:.2f}x bf16 (need >= {need}) {'PASS' if speed >= need else 'FAIL'}; "
          f"loss {loss:.4f} at step {step}, {dloss:.2%} from bf16 (need <= 1%) {'PASS' if dloss <= 0.01 else 'FAIL'}; "
          f"peak {mem:.2f} GiB vs plan {want:.2f} ({dmem:.1%}, need <= 10%) {'PASS' if dmem <= 0.10 else 'FAIL'}")
PY
            ;;
        sweep)
            launch nccl-tests --local --nodes 1 --runs-dir "$out/runs" -b 8M -e 1G -f 4 --ops all_reduce,all_gather 2>&1 | tail -n 20
            ;;
        smi)
            # The documented CSV query that a node health check reads (kept as a test fixture).
            nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,driver_version,persistence_mode,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.pending,temperature.gpu,power.draw,utilization.gpu \
                --format=csv,noheader,nounits | tee "$out/nvidia-smi-query.csv"
            nvidia-smi | tee "$out/nvidia-smi.txt"
            ;;
        doctor)
            # The node health check against the real nvidia-smi and kernel log of this machine.
            launch doctor --local --nodes 1 --runs-dir "$out/runs" 2>&1 | tail -n 12
            launch doctor --local --nodes 1 --runs-dir "$out/runs" --json >"$out/doctor.json"; echo "doctor exit $?"
            ;;
        top)
            # The live view's GPU columns from the real nvidia-smi while a training runs.
            train 124M 16 400 >/dev/null 2>&1 &
            sleep 20
            launch top --local --nodes 1 --duration 8 --record "$out/top.jsonl" 2>&1 | tail -n 8
            wait
            head -c 1500 "$out/top.jsonl"; echo
            ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done
