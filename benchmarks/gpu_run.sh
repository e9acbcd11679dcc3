#!/usr/bin/env bash
# One command for a multi-GPU machine: build the test build of the package, then run the
# stages named on the command line, each under its own time limit, and pack every log and JSON
# into one archive ($OUT/run.tgz; OUT defaults to benchmarks/results/run).
#
#   bash benchmarks/gpu_run.sh smoke overhead bench_1p        # stages, in order
#   STAGE_ARGS_bench_1p="--dtypes float32" bash benchmarks/gpu_run.sh bench_1p
#   STAGE_ENV_bench_1p2="XLA_FLAGS=--xla_gpu_enable_command_buffer=" bash benchmarks/gpu_run.sh bench_1p2
#   (STAGE_ENV_<stage>: one VAR=value for that stage only; the value may hold spaces)
#
# Stages: smoke (device protocol: one process and one per GPU), overhead, sweep (device protocol
# SM budgets), chain (benchmarks/chain_latency.py), ncu_fused (the fused kernel's duration on one
# GPU under Nsight Compute), bench_1p / bench_np (benchmarks/grad_return.py, one process / one per GPU),
# tests (the GPU test suite), cp_step (benchmarks/cp_step.py), memcheck (compute-sanitizer on 2
# ranks). NCCL_NVLS_ENABLE=0 always: never NVLink multicast on the shared machines.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/run}
work=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
gpus=$(nvidia-smi -L | grep -c '^GPU ')
started=$(date +%s)

budget=${RUN_BUDGET_S:-570}  # the whole command's limit: stages shrink to fit, the archive is kept current
mkdir -p "$OUT"

# stage NAME LIMIT_S CMD...: runs CMD with its output in NAME.log, prints its status and tail,
# and refreshes the archive (a command killed later still returns what ran).
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - ($(date +%s) - started) - 15))
  if ((left < 20)); then echo "=== $name skipped: ${left}s left"; return; fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s, at $(($(date +%s) - started))s)"
  timeout --signal=KILL "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"
  tail -n 25 "$work/$name.log"
  tar czf "$OUT/run.tgz" -C "$work" .
}

args_of() { local var="STAGE_ARGS_$1"; echo "${!var:-}"; }
# STAGE_ENV_<NAME>: one VAR=value (spaces allowed), passed to `env` as one word when set.
env_of() { local var="STAGE_ENV_$1"; echo "${!var:-}"; }

{
  nvidia-smi topo -m
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
} >"$work/machine.txt" 2>&1
echo "== $gpus GPUs: $(head -c 400 "$work/machine.txt" | tail -n +1 | head -n 4)"
stage build 300 env JAX_CPGRAD_TEST_HOOKS=ON python3 -m pip install --no-build-isolation --no-deps -e . || true

for s in "$@"; do
  case $s in
    smoke)
      stage smoke_1p 150 env JAX_CPGRAD_TEST_PROTOCOL=device python3 tests/gpu_worker.py correctness,race,race_small,wrap,errors,graphs
      stage smoke_np 200 env JAX_CPGRAD_TEST_PROTOCOL=device XLA_FLAGS="--xla_dump_to=$work/dump --xla_dump_hlo_module_re=.*cpgrad_graph_probe.*" \
        python3 -m jax_cpgrad.launch -n "$gpus" --timeout 190 tests/gpu_worker.py correctness,graphs,race_slow_owner,race_small,race_unprotected,race_small_unprotected
      stage smoke_memop 150 env JAX_CPGRAD_TEST_PROTOCOL=memop \
        python3 -m jax_cpgrad.launch -n "$gpus" --timeout 140 tests/gpu_worker.py race_slow_owner,race_unprotected
      ;;
    overhead)
      stage overhead 120 python3 benchmarks/overhead.py --n 1 2 4 8 --json "$work/overhead.json"
      ;;
    sweep)
      stage sweep 300 python3 benchmarks/grad_return.py --sizes 64K 1M 64M 1G --dtypes bfloat16 --reps 3 \
        --op grad_return --modes latency --calls 12 \
        --protocols device device:128:0.25 device:132:0.5 device:64:1 device:96:1 device:132:1 memop \
        --json "$work/sweep.json" --png "$work/sweep.png" $(args_of sweep)
      ;;
    chain)
      stage chain 300 python3 benchmarks/chain_latency.py --json "$work/chain.json" $(args_of chain)
      ;;
    ncu_fused)
      stage ncu_fused 200 ncu --clock-control none -k regex:fused_ -c 6 python3 -c \
        'from jax_cpgrad.benchmarking import bench_ext as b; b.chain_bench([0], global_bytes=65536, calls=3, reps=1, graph=False)'
      ;;
    bench_1p*)  # one process driving every GPU; bench_1p, bench_1p2, ...: STAGE_ARGS_<name>, STAGE_ENV_<name> each
      e=$(env_of "$s"); stage "$s" 540 env ${e:+"$e"} python3 benchmarks/grad_return.py --json "$work/$s.json" --png "$work/$s.png" $(args_of "$s")
      ;;
    bench_np*)  # one process per GPU
      e=$(env_of "$s"); stage "$s" 540 env ${e:+"$e"} python3 -m jax_cpgrad.launch -n "$gpus" --devices per-rank --timeout 530 \
        benchmarks/grad_return.py --json "$work/$s.json" --png "$work/$s.png" $(args_of "$s")
      ;;
    tests*)  # tests, tests2, ...: each with its own STAGE_ARGS_<name>, and STAGE_ENV_<name> (e.g.
      # PYTEST_ADDOPTS=-k n1 or overlapped: a selection with spaces)
      e=$(env_of "$s"); stage "$s" 560 env ${e:+"$e"} JAX_CPGRAD_REQUIRE_GPU=1 python3 -m pytest -q -rs tests/test_gpu.py $(args_of "$s")
      ;;
    cp_step*)  # cp_step, cp_step2, ...: each with its own STAGE_ARGS_<name> and STAGE_ENV_<name>
      e=$(env_of "$s"); stage "$s" 540 env ${e:+"$e"} python3 benchmarks/cp_step.py --json "$work/$s.json" --png "$work/$s.png" $(args_of "$s")
      ;;
    memcheck | racecheck)
      stage "$s" 300 bash benchmarks/sanitize_ranks.sh "$s" correctness,wrap,errors
      ;;
    *) echo "unknown stage $s" ;;
  esac
done

tar czf "$OUT/run.tgz" -C "$work" .
echo "== packed $(du -h "$OUT/run.tgz" | cut -f1) into $OUT/run.tgz after $(($(date +%s) - started))s"
