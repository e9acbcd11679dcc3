"""What the GPU tests share: skipping (or, with JAX_CPGRAD_REQUIRE_GPU=1, failing) where there is
no GPU or no CUDA build, a worker's run of named scenarios, one ``RESULT {json}`` line each, and
the tests' reading of those lines."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import pytest

import jax_cpgrad
from jax_cpgrad import launch


def need(condition: bool, reason: str) -> None:
    """Skip with ``reason`` unless ``condition``; fail instead under JAX_CPGRAD_REQUIRE_GPU=1 (the GPU
    machine sets it, so a suite that should run cannot hide)."""
    if condition:
        return
    if os.environ.get("JAX_CPGRAD_REQUIRE_GPU") == "1":
        pytest.fail(f"JAX_CPGRAD_REQUIRE_GPU=1 but: {reason}")
    pytest.skip(reason)


def need_gpu() -> None:
    need(jax_cpgrad.HAS_CUDA, "jax_cpgrad was built without CUDA (no nvcc at build time)")
    need(launch.visible_gpu_count() > 0, "no NVIDIA GPU visible (nvidia-smi lists none)")


def run_scenarios(scenarios: dict, names: list[str], mesh) -> int:
    """Run each named scenario(mesh, n) in order, printing its result (a crash is a failed
    result with the traceback); returns the exit code: 1 if any failed."""
    from spmd import local_ranks

    code = 0
    for name in names:
        t0 = time.time()
        try:
            outcome = scenarios[name](mesh, mesh.size)
        except Exception:
            outcome = {"ok": False, "checks": {}, "error": traceback.format_exc()[-3000:]}
        outcome.update(
            scenario=name, n=mesh.size, ranks=local_ranks(mesh), seconds_total=round(time.time() - t0, 2)
        )
        print("RESULT " + json.dumps(outcome), flush=True)
        code |= 0 if outcome["ok"] else 1
    sys.stdout.flush()
    return code


def results(outputs: list[str]) -> dict:
    """{(scenario, rank): result} from the RESULT lines of each rank's output (rank = list index)."""
    found = {}
    for rank, output in enumerate(outputs):
        for line in output.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT ") :])
                found[(res["scenario"], rank)] = res
    return found


def assert_all_ok(outputs: list[str], scenarios: list[str], ranks: int | None = None) -> None:
    """Every rank (the first ``ranks``, default all) printed an ok result for every scenario (the
    failed checks and the output's tail in the message otherwise)."""
    found = results(outputs)
    for scenario in scenarios:
        for rank, output in enumerate(outputs[:ranks]):
            res = found.get((scenario, rank))
            assert res is not None, f"rank {rank} printed no result for {scenario}:\n{output[-3000:]}"
            failed = [name for name, held in res.get("checks", {}).items() if not held]
            assert res["ok"], f"{scenario}, rank {rank}: {failed or 'error'}: {json.dumps(res)[:3000]}"
