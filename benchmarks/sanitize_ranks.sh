#!/usr/bin/env bash
# compute-sanitizer (TOOL: memcheck or racecheck) on each of R ranks (default 2) running
# tests/gpu_worker.py SCENARIOS: the launcher's environment by hand, since the sanitizer wraps
# the interpreter. Rank r runs on GPU r mod (visible GPUs): with fewer GPUs than ranks, ranks
# share a GPU and the protocol defaults to the stream-memop protocol (docs/design.md); R = 1 is one
# process alone.
# Exits non-zero if any rank's sanitizer or worker failed.
#
#   bash benchmarks/sanitize_ranks.sh memcheck correctness,wrap,errors        # 2 ranks
#   bash benchmarks/sanitize_ranks.sh memcheck correctness,graphs 1           # one process, R = 1
set -uo pipefail
tool=$1 scenarios=$2 n=${3:-2}
gpus=$(nvidia-smi -L | grep -c '^GPU ')
protocol=${JAX_CPGRAD_TEST_PROTOCOL:-auto}
if [[ $protocol == auto ]]; then
  if ((n > 1 && gpus < n)); then protocol=memop; elif ((n == 1)); then protocol=device; fi
fi
if ((n == 1)); then  # one process alone: no coordinator
  JAX_CPGRAD_TEST_PROTOCOL=$protocol CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
    exec compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu_worker.py "$scenarios"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((r = 0; r < n; r++)); do
  JAX_CPGRAD_COORDINATOR=127.0.0.1:$port JAX_CPGRAD_NUM_PROCESSES=$n JAX_CPGRAD_PROCESS_ID=$r \
    JAX_CPGRAD_LOCAL_DEVICE=$((r % gpus)) JAX_CPGRAD_TEST_PROTOCOL=$protocol \
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu_worker.py "$scenarios" \
    > >(sed "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
