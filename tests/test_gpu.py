"""The peer transport on real GPUs: multi-process (CUDA IPC) through the launcher, one process
per CP rank; several ranks share one GPU when there are fewer GPUs than ranks (DEVICE.md).

Skips, with the reason, where there is no GPU or no CUDA build. Set JAX_CPGRAD_REQUIRE_GPU=1 to
turn those skips into failures (the GPU machine does, so a suite that should run cannot hide).
"""

import json
import os
import sys

import pytest

import jax_cpgrad
from jax_cpgrad import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")
GPUS = launch.visible_gpu_count()


def _need(condition: bool, reason: str):
    if condition:
        return
    if os.environ.get("JAX_CPGRAD_REQUIRE_GPU") == "1":
        pytest.fail(f"JAX_CPGRAD_REQUIRE_GPU=1 but: {reason}")
    pytest.skip(reason)


@pytest.fixture
def gpu():
    _need(jax_cpgrad.HAS_CUDA, "jax_cpgrad was built without CUDA (no nvcc at build time)")
    _need(GPUS > 0, "no NVIDIA GPU visible (nvidia-smi lists none)")


def _results(out: list) -> dict:
    """{(scenario, rank): result} from every rank's RESULT lines."""
    found = {}
    for rank_result in out:
        for line in rank_result.output.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                found[(res["scenario"], rank_result.rank)] = res
    return found


def _run(n, scenarios, timeout_s=540, env=None, allow_failure=False):
    argv = [sys.executable, WORKER, ",".join(scenarios)]
    try:
        out = launch.launch(argv, n, timeout_s=timeout_s, env=env, echo=False)
    except launch.LaunchError as err:
        if not allow_failure:
            tails = "\n".join(f"--- rank {r.rank} (code {r.returncode}):\n{r.output[-3000:]}" for r in err.results)
            pytest.fail(f"{err}\n{tails}")
        out = err.results
    return _results(out)


def _assert_all_ok(found, n, scenarios):
    for scenario in scenarios:
        for rank in range(n):
            res = found.get((scenario, rank))
            assert res is not None, f"rank {rank} printed no result for {scenario}"
            assert res["ok"], f"{scenario} failed on rank {rank}: {json.dumps(res)[:3000]}"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_peer_transport_multiprocess(gpu, n):
    """Bitwise vs the oracle (all dtypes, both layouts, grad, vmap), >= 1,000-call race test,
    epoch wrap-around, handler-side rejections and use after close."""
    scenarios = ["correctness", "race", "wrap", "errors"]
    _assert_all_ok(_run(n, scenarios), n, scenarios)


@pytest.mark.parametrize("n", [2, 4])
def test_missing_peer_times_out_naming_it(gpu, n):
    """The last rank stalls; the others fail within the timeout, naming it. (Once they exit, the
    JAX coordination service takes the straggler down too: only the waiters report.)"""
    found = _run(n, ["missing_peer"], timeout_s=180, allow_failure=True)
    _assert_all_ok(found, n - 1, ["missing_peer"])


def test_slow_peer_within_timeout_is_fine(gpu):
    found = _run(2, ["slow_peer"], timeout_s=180)
    _assert_all_ok(found, 2, ["slow_peer"])


def test_dead_peer_process_times_out_naming_it(gpu):
    found = _run(2, ["dead_peer"], timeout_s=180, allow_failure=True)
    _assert_all_ok(found, 2, ["dead_peer"])


def test_soak_and_lifecycle(gpu):
    """100,000 checked calls on one workspace; 1,000 create/close cycles leak nothing."""
    scenarios = ["soak", "lifecycle"]
    _assert_all_ok(_run(2, scenarios, timeout_s=900), 2, scenarios)


def test_interpreter_exit_with_open_workspaces_is_clean(gpu):
    """Every rank exits 0 through the normal interpreter exit, with no crash or leak report."""
    out = launch.launch([sys.executable, WORKER, "exit_open"], 2, timeout_s=120, echo=False)
    _assert_all_ok(_results(out), 2, ["exit_open"])
    for r in out:
        assert r.returncode == 0
        for bad in ("leaked", "Segmentation", "terminate called", "Fatal Python error"):
            assert bad not in r.output, r.output[-2000:]


def test_workspace_arguments_that_differ_between_processes_are_reported(gpu):
    _assert_all_ok(_run(2, ["mismatch"], timeout_s=120), 2, ["mismatch"])


def test_allocation_failure_on_one_process_fails_every_process_at_once(gpu):
    _assert_all_ok(_run(2, ["allocation_failure"], timeout_s=120), 2, ["allocation_failure"])


def test_two_workspaces_on_two_axes_stay_independent(gpu):
    _assert_all_ok(_run(4, ["independent"], timeout_s=300), 4, ["independent"])


def _run_in_one_process(scenarios, timeout_s, **env):
    """The worker as a single process over every GPU it sees; fails unless every scenario is ok."""
    import subprocess

    proc = subprocess.run([sys.executable, WORKER, ",".join(scenarios)], capture_output=True, text=True,
                          timeout=timeout_s, env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env))
    found = {json.loads(line[7:])["scenario"]: json.loads(line[7:])
             for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    for scenario in scenarios:
        assert scenario in found, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert found[scenario]["ok"], json.dumps(found[scenario])[:3000]


def test_single_process_multi_gpu(gpu):
    """One process driving every visible GPU: raw peer pointers and peer access, no IPC."""
    if GPUS < 2:  # a property of the machine, not a missing build: skip even with REQUIRE_GPU
        pytest.skip(f"single-process multi-GPU needs >= 2 GPUs in one process; {GPUS} visible")
    _run_in_one_process(["correctness", "race", "wrap", "errors"], timeout_s=900)


def test_one_gpu_in_process_n1(gpu):
    """N = 1 on one GPU in one process: the FFI path, jit, vmap and grad without any peer."""
    _run_in_one_process(["correctness", "wrap", "errors"], timeout_s=600, CUDA_VISIBLE_DEVICES="0")
