#!/usr/bin/env bash
# compute-sanitizer (TOOL: memcheck or racecheck) on each of 2 ranks, one GPU per rank, running
# tests/gpu_worker.py SCENARIOS: the launcher's environment by hand, since the sanitizer wraps
# the interpreter. Exits non-zero if either rank's sanitizer or worker failed.
set -uo pipefail
tool=$1 scenarios=$2
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for r in 0 1; do
  JAX_CPGRAD_COORDINATOR=127.0.0.1:$port JAX_CPGRAD_NUM_PROCESSES=2 JAX_CPGRAD_PROCESS_ID=$r \
    JAX_CPGRAD_LOCAL_DEVICE=$r JAX_CPGRAD_TEST_PROTOCOL=${JAX_CPGRAD_TEST_PROTOCOL:-auto} \
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu_worker.py "$scenarios" \
    > >(sed "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
