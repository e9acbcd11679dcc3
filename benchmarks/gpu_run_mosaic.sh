#!/usr/bin/env bash
# One command for a GPU run of the Mosaic GPU attention kernels on one H200: install the package
# (as benchmarks/gpu_run.sh does; skipped when this checkout is installed already), then the
# stages named, each under its own time limit inside one budget (RUN_BUDGET_S, default 570 s, for
# a 600 s command). Everything is logged to $OUT/run.log (tee); the tests' measured errors go to
# $OUT/mosaic_errors.jsonl, each benchmark's JSON and PNG beside it, and the GPU's clocks and power
# once a second to $OUT/smi.csv. OUT defaults to benchmarks/results/mosaic_run.
#
#   bash benchmarks/gpu_run_mosaic.sh              # tests, then bench: the first run
#   bash benchmarks/gpu_run_mosaic.sh bench_rest   # the rest of the benchmark's grid: a second run
#   STAGE_ARGS_bench="--seq 8k 16k" bash benchmarks/gpu_run_mosaic.sh bench   # arguments appended
#   bash benchmarks/gpu_run_mosaic.sh layer_tests              # the layer's GPU tests (halo_tests: the rest)
#   bash benchmarks/gpu_run_mosaic.sh bench_det                # against cuDNN's deterministic backward
#   PYTEST_ADDOPTS="-k first_call" bash benchmarks/gpu_run_mosaic.sh tests    # a selection
#
# Stages:
# - tests: tests/test_gpu_mosaic.py with JAX_CPGRAD_REQUIRE_GPU=1 (a skip is a failure), -s so that
#   every case's errors are in the log; 200 s at most per test (a kernel that hangs ends it);
# - bench: benchmarks/mosaic_attention.py at head dim 128 and 8 KV heads (causal 8k-128k, the
#   window and the documents at 64k), with --budget-s so that it stops in time by itself;
# - bench_rest: the rest of the default grid and the head-dim-64 grid: 32 KV heads at head dim
#   128, then head dim 64 with 8 and 32 KV heads, each in what is left of the budget (points that
#   do not fit are listed in the JSON's "skipped").
# - bench_det: bench with XLA_FLAGS=--xla_gpu_deterministic_ops=true (cuDNN's deterministic
#   backward, the fair match for ours, which is deterministic always);
# - layer_tests: tests/test_gpu_attention.py but its halo and cuDNN window tests (the layer on the
#   GPU: plain, documents and windows, R = 1 and 2 and 4 processes sharing the GPU), about 400 s;
# - cudnn_window_tests: its cuDNN window tests (causal windows through cuDNN's plain calls, R = 1,
#   2 and 4); needs the CUDA build;
# - attention_tests: layer_tests, cudnn_window_tests and halo_tests at once, as XDIST (default 6)
#   pytest workers sharing the GPU (the tests' processes compile on the host's cores side by side;
#   all twelve, negative controls and the missing neighbour included, passed so in 261 s on an
#   H200; on an H100 11 had passed at 279 s: give it the whole command there; each test's name
#   and result in the log as it ends; without pytest-xdist, one at a time, which may not fit one
#   command);
# - halo_tests: its halo tests (the window's halo transfer at 2 and 4 processes, the negative
#   control, a missing neighbour), 348-455 s one at a time: give it a whole command (or run
#   attention_tests). Both need the CUDA build.
# - per_rank: benchmarks/attention.py --ideal layer --rank-implementation mosaic at S = 32k, 8 KV
#   heads, R = 1-8, with a window of 512, of 4096, and documents of 4096 (about 90 s each);
#   per_rank_mixes: the same with document_balance.py's short, long and mixed documents
#   (PER_RANK_SEQ: another length, e.g. 128k, its files named _s128k; PER_RANK_LIMIT_S: each
#   mask's limit, default 200 s);
#   per_rank_balanced: the mixes again in jax_cpgrad.balanced_document_order's order (--balanced-order);
#   per_rank_bounded: documents of 4096 with the layer told their length (--bounded: the window it
#   implies, the halo from 8k-token chunks), then without, at S = 128k unless PER_RANK_SEQ;
#   per_rank_window_kernels: the window of 512 (WINDOW=4096: of 4096, a chunk or more from R = 4)
#   on cuDNN's plain calls, then on ours (one after the other in the same command; STAGE_ARGS
#   "--seq 64k" for another length);
#   per_rank_plain_kernels: plain causal attention per rank, cuDNN's split calls then ours (one
#   masked call per pass), both against cuDNN's unsharded call (--ideal dense), S = 32k;
# - rank_timeline: experiments/rank_timeline.py at 32k (TIMELINE_N: the ranks, default 4 8;
#   TIMELINE_CASES: default window512 window4096) with the default backward config, then with each
#   of BWD_CHANGES (BackwardConfig changes, default narrow_small_grids=false: the small grids not
#   narrowed to one consumer; pingpong=true: the consumers taking turns), then the default again
#   (the readings' drift);
# - cp_step_window: benchmarks/cp_step.py with 5 window layers (1024) to 1 global at 16k, R = 1,
#   XLA's collectives and the peer transport (plain, overlapped) against none; needs the CUDA build.
# - patch_tests, patch_ab: an experiments patch (PATCH=experiments/<name>.patch, required)
#   applied to the tree: the Mosaic GPU tests that cover a rank's calls with it (first call,
#   planted off-by-one, two runs, a rank with a halo and with documents, rows in place;
#   PATCH_TESTS: another -k selection); then, side by side in one command, the rank's timeline
#   at 32k, R = 8 (window 512 and causal;
#   PATCH_CASES: other cases) with it, without it and with it again, and the per-rank reading of
#   the 512 window (PATCH_MASK: another mask's arguments) with it and without it (PATCH_N: the
#   timeline's ranks, default 8). The tree is left without it.
# MOSAIC_BUILD=cuda (implied by layer_tests, halo_tests and cp_step_window) builds the CUDA extension with the
# test hooks, as gpu_run.sh does; otherwise the extension is built without CUDA (faster; the
# Pallas kernels need nothing of it).
# NCCL_NVLS_ENABLE=0 always: never NVLink multicast on the shared machines.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/mosaic_run}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log="$OUT/run.log"
started=$(date +%s)
budget=${RUN_BUDGET_S:-570}
stages=("$@")
((${#stages[@]})) || stages=(tests bench)

say() { echo "$*" | tee -a "$log"; }
elapsed() { echo $(($(date +%s) - started)); }
left() { echo $((budget - $(elapsed) - 10)); }
args_of() { local var="STAGE_ARGS_$1"; echo "${!var:-}"; }

# stage NAME LIMIT_S CMD...: CMD under min(LIMIT_S, what is left), its output teed to the log.
stage() {
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  if ((l < 30)); then say "=== $name skipped: ${l}s left of ${budget}s"; return; fi
  ((limit > l)) && limit=$l
  say "=== $name (limit ${limit}s, at $(elapsed)s): $*"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "=== $name rc=$rc at $(elapsed)s"
}

# bench NAME SHARE ARGS...: the benchmark in SHARE % of what is left, stopping itself (--budget-s)
# 25 s before that limit.
bench() {
  local name=$1 share=$2
  shift 2
  local l
  l=$(($(left) * share / 100))
  stage "$name" "$l" env ${BENCH_ENV:-} python3 benchmarks/mosaic_attention.py --out "$OUT/$name" \
    --budget-s $((l - 25)) "$@"
}

{
  echo "== $(date -u +%FT%TZ) stages: ${stages[*]}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1
} | tee -a "$log"

want_cuda=0
[ "${MOSAIC_BUILD:-cpu}" = cuda ] || [[ " ${stages[*]} " == *_tests* || " ${stages[*]} " == *cp_step* ]] && want_cuda=1
# The checkout installed already (a warm machine) is kept, unless it was built without CUDA and
# this run needs CUDA.
installed=$(cd /tmp && python3 -c 'import os, jax_cpgrad; print(os.path.dirname(os.path.dirname(os.path.realpath(jax_cpgrad.__file__))), int(jax_cpgrad.HAS_CUDA))' 2>/dev/null)
if [ "$installed" = "$(pwd -P) 1" ] || { [ "$installed" = "$(pwd -P) 0" ] && ((!want_cuda)); }; then
  say "== jax_cpgrad is installed from this checkout: no build"
elif ((want_cuda)); then
  stage build 300 env JAX_CPGRAD_TEST_HOOKS=ON python3 -m pip install --no-build-isolation --no-deps -e .
else
  stage build 300 env JAX_CPGRAD_CUDA=OFF python3 -m pip install --no-build-isolation --no-deps -e .
fi

smi_pid=
for s in "${stages[@]}"; do
  case $s in
    tests)
      stage tests 330 env JAX_CPGRAD_REQUIRE_GPU=1 JAX_CPGRAD_MOSAIC_ERRORS="$OUT/mosaic_errors.jsonl" \
        python3 -m pytest -q -s -rs -p no:cacheprovider -o timeout=200 -o timeout_method=thread \
        tests/test_gpu_mosaic.py $(args_of tests)
      ;;
    bench | bench_rest)
      if [ -z "$smi_pid" ]; then
        nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu \
          --format=csv -l 1 >"$OUT/smi.csv" 2>&1 &
        smi_pid=$!
      fi
      if [ "$s" = bench ]; then
        bench bench 100 --head-dim 128 --kv-heads 8 $(args_of bench)
      else  # 7 points, then 14
        bench bench_rest_h128_kv32 35 --head-dim 128 --kv-heads 32 $(args_of bench_rest)
        bench bench_rest_h64 100 --head-dim 64 --kv-heads 8 32 $(args_of bench_rest)
      fi
      ;;
    bench_det)  # cuDNN with XLA's deterministic ops (its deterministic backward), ours unchanged
      BENCH_ENV=XLA_FLAGS=--xla_gpu_deterministic_ops=true bench bench_det 100 --head-dim 128 --kv-heads 8 \
        $(args_of bench_det)
      ;;
    attention_tests)  # all three at once, XDIST (default 6) pytest workers sharing the GPU
      workers=(-n "${XDIST:-6}")
      python3 -c 'import xdist' 2>/dev/null || { say "=== no pytest-xdist: one test at a time"; workers=(); }
      stage attention_tests 560 env JAX_CPGRAD_REQUIRE_GPU=1 python3 -m pytest -v -rs -p no:cacheprovider \
        "${workers[@]}" tests/test_gpu_attention.py $(args_of attention_tests)
      ;;
    layer_tests | halo_tests | cudnn_window_tests)  # about 400 s, about 300 s, about 200 s
      case $s in
        halo_tests) select=halo ;;
        cudnn_window_tests) select=cudnn_windows ;;
        *) select="not halo and not cudnn_windows" ;;
      esac
      stage "$s" 560 env JAX_CPGRAD_REQUIRE_GPU=1 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_gpu_attention.py -k "$select" $(args_of "$s")
      ;;
    per_rank | per_rank_mixes | per_rank_balanced | per_rank_bounded)  # a rank's work with masks, against its share
      masks=("--window 512" "--window 4096" "--documents 4096")
      seq=${PER_RANK_SEQ:-32k}
      [ "$s" = per_rank_mixes ] || [ "$s" = per_rank_balanced ] && masks=("--documents short" "--documents long" "--documents mixed")
      [ "$s" = per_rank_balanced ] && masks=("${masks[@]/%/ --balanced-order}")
      if [ "$s" = per_rank_bounded ]; then
        masks=("--documents 4096 --bounded" "--documents 4096")
        seq=${PER_RANK_SEQ:-128k}
      fi
      for mask in "${masks[@]}"; do
        name=per_rank_$(echo "$mask" | tr -d ' -')$([ "$seq" != 32k ] && echo "_s$seq")
        # shellcheck disable=SC2086  # $mask is two words
        stage "$name" "${PER_RANK_LIMIT_S:-200}" python3 benchmarks/attention.py --seq "$seq" --kv-heads 8 --n 1 2 4 8 $mask \
          --rank-implementation mosaic --ideal layer --json "$OUT/$name.json" --png "$OUT/$name.png" \
          $(args_of "$s")
      done
      ;;
    per_rank_window_kernels)  # a window (512, or WINDOW) on cuDNN's plain calls and on ours
      for impl in cudnn mosaic; do
        name=per_rank_window${WINDOW:-512}_$impl
        stage "$name" 200 python3 benchmarks/attention.py --seq 32k --kv-heads 8 --n 1 2 4 8 --window "${WINDOW:-512}" \
          --rank-implementation "$impl" --ideal layer --json "$OUT/$name.json" --png "$OUT/$name.png" \
          $(args_of "$s")
      done
      ;;
    per_rank_plain_kernels)  # plain causal per rank: cuDNN's split calls, then ours
      for impl in cudnn mosaic; do
        name=per_rank_causal_$impl
        stage "$name" 200 python3 benchmarks/attention.py --seq 32k --kv-heads 8 --n 1 2 4 8 \
          --implementation cudnn --rank-implementation "$impl" --ideal dense \
          --json "$OUT/$name.json" --png "$OUT/$name.png" $(args_of "$s")
      done
      ;;
    rank_timeline)  # a rank's kernels (experiments/rank_timeline.py): default, each change, default again
      for side in default ${BWD_CHANGES:-narrow_small_grids=false} default_again; do
        config=()  # the default sides: no --bwd-config at all
        [[ $side == *=* ]] && config=(--bwd-config "$side")
        name=rank_timeline_${side%%=*}  # no "=" in a file's name
        # shellcheck disable=SC2046,SC2086  # the lists are words
        stage "$name" 200 python3 experiments/rank_timeline.py --seq 32k --n ${TIMELINE_N:-4 8} \
          --cases ${TIMELINE_CASES:-window512 window4096} --list 25 --json "$OUT/$name.json" \
          "${config[@]}" $(args_of "$s")
      done
      ;;
    cp_step_window)  # 5 window layers (1024) to 1 global, the transports against none, R = 1
      stage cp_step_window 400 python3 benchmarks/cp_step.py --layers 6 --seq 16k --hidden 4096 \
        --kv-heads 8 --local-window-size 1024 1024 1024 1024 1024 none --transport xla peer none \
        --protocol device device+overlap --steps 10 --time-budget-s 300 \
        --json "$OUT/cp_step_window.json" --png "$OUT/cp_step_window.png" $(args_of cp_step_window)
      ;;
    patch_tests | patch_ab)  # an experiments patch against the tree (see the header)
      patch=${PATCH:-}
      if [ -z "$patch" ]; then say "=== $s: set PATCH to the patch to apply"; continue; fi
      if ! git apply "$patch"; then say "=== $s: $patch does not apply to this tree"; continue; fi
      if [ "$s" = patch_tests ]; then
        stage patch_tests 330 env JAX_CPGRAD_REQUIRE_GPU=1 JAX_CPGRAD_MOSAIC_ERRORS="$OUT/mosaic_errors_patch.jsonl" \
          python3 -m pytest -q -s -rs -p no:cacheprovider -o timeout=200 -o timeout_method=thread \
          tests/test_gpu_mosaic.py -k "${PATCH_TESTS:-first_call or planted or two_runs or rank_against or first_rows}"
        git apply -R "$patch"
        continue
      fi
      for side in with without with_again; do  # the patch is applied on entry
        [ "$side" = without ] && git apply -R "$patch"
        [ "$side" = with_again ] && git apply "$patch"
        # shellcheck disable=SC2086  # the cases are words
        stage "timeline_$side" 110 python3 experiments/rank_timeline.py --seq 32k --n ${PATCH_N:-8} --cases ${PATCH_CASES:-window512 causal} \
          --list 12 --json "$OUT/patch_timeline_$side.json"
      done
      for side in with without; do
        [ "$side" = without ] && git apply -R "$patch"
        # shellcheck disable=SC2086  # the mask's arguments are words
        stage "per_rank_$side" 120 python3 benchmarks/attention.py --seq 32k --kv-heads 8 --n 2 4 8 ${PATCH_MASK:---window 512} \
          --ideal layer --rank-implementation mosaic --rounds 2 --json "$OUT/patch_per_rank_$side.json"
      done
      ;;
    *) say "unknown stage $s (tests, bench, bench_rest, bench_det, attention_tests, layer_tests, halo_tests, cudnn_window_tests, per_rank, per_rank_mixes, per_rank_balanced, per_rank_bounded, per_rank_window_kernels, per_rank_plain_kernels, rank_timeline, cp_step_window, patch_tests, patch_ab)" ;;
  esac
done
[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
say "== done after $(elapsed)s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
