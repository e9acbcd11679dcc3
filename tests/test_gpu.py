"""The peer transport on real GPUs: multi-process (memory passed as file descriptors over a private
socket) through the launcher, one process per CP rank; several ranks share one GPU when there are
fewer GPUs than ranks (the launcher's ``--devices share``). The security tests also need root
(they add a second user).

Skips, with the reason, where there is no GPU or no CUDA build. Set JAX_CPGRAD_REQUIRE_GPU=1 to
turn those skips into failures (the GPU machine does, so a suite that should run cannot hide).
"""

import os
import sys

import pytest

import intruder
import jax_cpgrad
import jax_cpgrad._native
from gpu_support import assert_all_ok, need, need_gpu, results
from jax_cpgrad import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")
GPUS = launch.visible_gpu_count()


@pytest.fixture
def gpu():
    need_gpu()


def _run(n, scenarios, timeout_s=540, env=None, allow_failure=False, protocol="auto"):
    argv = [sys.executable, WORKER, ",".join(scenarios)]
    env = dict(env or {}, JAX_CPGRAD_TEST_PROTOCOL=protocol)
    try:
        out = launch.launch(argv, n, timeout_s=timeout_s, env=env, echo=False)
    except launch.LaunchError as err:
        if not allow_failure:
            tails = "\n".join(
                f"--- rank {r.rank} (code {r.returncode}):\n{r.output[-3000:]}" for r in err.results
            )
            pytest.fail(f"{err}\n{tails}")
        out = err.results
    return [r.output for r in out]


def _need_own_gpus(n, protocol):
    """The device protocol needs a GPU per rank: a property of the machine, so this skips even
    with JAX_CPGRAD_REQUIRE_GPU=1 (and says so)."""
    if protocol == "device" and GPUS < n:
        pytest.skip(f"the device protocol needs {n} GPUs (one per rank); {GPUS} visible")


CORE = ["correctness", "race", "race_small", "wrap", "errors"]


@pytest.mark.parametrize("protocol", ["device", "memop"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_peer_transport_multiprocess(gpu, n, protocol):
    """Bitwise vs the oracle (all dtypes, four layouts including odd sizes and many tiles, grad,
    vmap), >= 1,000-call race test, epoch wrap-around, handler-side rejections, use after close;
    for the device protocol also calls recorded into CUDA graphs."""
    _need_own_gpus(n, protocol)
    need(jax_cpgrad._native.HAS_TEST_HOOKS, "the wrap test needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)")
    scenarios = CORE + (["graphs"] if protocol == "device" else [])
    assert_all_ok(_run(n, scenarios, protocol=protocol), scenarios)


@pytest.mark.parametrize("protocol", ["device", "memop"])
@pytest.mark.parametrize("n", [4, 8])
def test_calls_with_a_reach_move_the_neighbours_data_alone(gpu, n, protocol):
    """Calls with a reach of 1 (the window's halo) between whole calls on one workspace, in one
    program: the all-gathers' chunks of ranks out of reach are zeros, the grad_returns sum the
    writers within it; every result bitwise against the oracle, all dtypes, three layouts."""
    _need_own_gpus(n, protocol)
    assert_all_ok(_run(n, ["reach"], protocol=protocol), ["reach"])


@pytest.mark.parametrize("protocol", ["device", "memop"])
def test_race_test_fails_without_the_write_after_read_protection(gpu, protocol):
    """With a slow owner (rank 0 waits before reading) every call stays right; with the
    protection also removed (test builds' hooks) calls go wrong: the negative control, so the
    race tests can fail."""
    _need_own_gpus(2, protocol)
    need(
        jax_cpgrad._native.HAS_TEST_HOOKS,
        "the negative control needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)",
    )
    # The device protocol's small calls travel as LL words: their own race test and control.
    small = ["race_small", "race_small_unprotected"] if protocol == "device" else []
    scenarios = ["race_slow_owner", "race_unprotected", *small]
    outs = _run(2, scenarios, protocol=protocol)
    assert_all_ok(outs, scenarios)
    found = results(outs)
    assert "slow_owner_got_wrong_calls_without_protection" in found[("race_unprotected", 0)]["checks"]
    if small:
        assert "slow_owner_failed_without_protection" in found[("race_small_unprotected", 0)]["checks"]


def test_device_protocol_is_recorded_into_cuda_graphs(gpu, tmp_path):
    """XLA's dump shows the calls inside a command buffer, and the replayed graphs stay bitwise
    right with data changing every step."""
    _need_own_gpus(2, "device")
    env = {"XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*cpgrad_graph_probe.*"}
    outs = _run(2, ["graphs"], env=env, protocol="device")
    assert_all_ok(outs, ["graphs"])
    graphs = results(outs)[("graphs", 0)]
    assert "xla_captured_the_calls" in graphs["checks"], graphs


@pytest.mark.parametrize("n,protocol", [(2, "device"), (2, "memop"), (4, "memop")])
def test_missing_peer_times_out_naming_it(gpu, n, protocol):
    """The last rank stalls; the others fail within the timeout, naming it. (Once they exit, the
    JAX coordination service takes the straggler down too: only the waiters report.)"""
    _need_own_gpus(n, protocol)
    outs = _run(n, ["missing_peer"], timeout_s=180, allow_failure=True, protocol=protocol)
    assert_all_ok(outs, ["missing_peer"], ranks=n - 1)


def test_slow_peer_within_timeout_is_fine(gpu):
    outs = _run(2, ["slow_peer"], timeout_s=180)
    assert_all_ok(outs, ["slow_peer"])


@pytest.mark.parametrize("protocol", ["device", "memop"])
def test_dead_peer_process_times_out_naming_it(gpu, protocol):
    _need_own_gpus(2, protocol)
    outs = _run(2, ["dead_peer"], timeout_s=180, allow_failure=True, protocol=protocol)
    assert_all_ok(outs, ["dead_peer"])


def test_soak_and_lifecycle(gpu):
    """100,000 checked calls on one workspace; 1,000 create/close cycles leak nothing."""
    scenarios = ["soak", "lifecycle"]
    assert_all_ok(_run(2, scenarios, timeout_s=900), scenarios)


def test_interpreter_exit_is_clean_with_open_or_closed_workspaces(gpu):
    """Every rank exits 0 through the normal interpreter exit, with no crash or leak report: with
    workspaces left open, and with a closed one still referenced by a live jitted function."""
    out = launch.launch([sys.executable, WORKER, "exit_closed,exit_open"], 2, timeout_s=120, echo=False)
    assert_all_ok([r.output for r in out], ["exit_closed", "exit_open"])
    for r in out:
        assert r.returncode == 0
        for bad in ("leaked", "Segmentation", "terminate called", "Fatal Python error"):
            assert bad not in r.output, r.output[-2000:]


def test_workspace_arguments_that_differ_between_processes_are_reported(gpu):
    assert_all_ok(_run(2, ["mismatch"], timeout_s=120), ["mismatch"])


def test_allocation_failure_on_one_process_fails_every_process_at_once(gpu):
    assert_all_ok(_run(2, ["allocation_failure"], timeout_s=120), ["allocation_failure"])


def test_two_workspaces_on_two_axes_stay_independent(gpu):
    assert_all_ok(_run(4, ["independent"], timeout_s=300), ["independent"])


def _intruder_user() -> str:
    """The second user (intruder.py); skips with the reason where there can be none (not root: a
    property of the machine, so even with REQUIRE_GPU)."""
    try:
        return intruder.ensure_user()
    except LookupError as why:
        pytest.skip(str(why))


def test_another_user_knowing_the_store_cannot_get_the_workspace_memory(gpu):
    """Another user's process, given everything the key-value store holds, tries the ranks'
    sockets, /proc/PID/fd and pidfd_getfd while they pass their memory; then rank 0's socket with
    its directory opened (its credentials check must refuse). It obtains no descriptor, the job
    goes on with every call right, and rank 0 warns naming the intruder's pid."""
    user = _intruder_user()
    outs = _run(2, ["intruder"], timeout_s=300, env={"JAX_CPGRAD_TEST_INTRUDER": user})
    if skip := results(outs).get(("intruder", 0), {}).get("skip"):
        pytest.skip(skip)
    assert_all_ok(outs, ["intruder"])


def test_bad_store_entries_fail_every_process_clearly(gpu):
    """A truncated, then a bogus entry of one process: every process raises at once, naming that
    process's entry; no crash, no hang, and the next workspace works."""
    assert_all_ok(_run(2, ["bad_store_entries"], timeout_s=300), ["bad_store_entries"])


def test_fabric_support_is_reported_and_a_fabric_request_fails_clearly(gpu):
    _run_in_one_process(["fabric"], timeout_s=300, CUDA_VISIBLE_DEVICES="0")


def _run_in_one_process(scenarios, timeout_s, **env):
    """The worker as a single process over every GPU it sees; fails unless every scenario is ok."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, WORKER, ",".join(scenarios)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env),
    )
    assert_all_ok([proc.stdout + proc.stderr[-3000:]], scenarios)


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("protocol", ["device", "memop"])
def test_single_process_multi_gpu(gpu, protocol, overlap):
    """One process driving every visible GPU: each GPU granted access to the others' memory, no
    descriptors passed; with
    overlap, every call a pair on the workspaces' streams (one per GPU)."""
    if GPUS < 2:  # a property of the machine, not a missing build: skip even with REQUIRE_GPU
        pytest.skip(f"single-process multi-GPU needs >= 2 GPUs in one process; {GPUS} visible")
    need(jax_cpgrad._native.HAS_TEST_HOOKS, "the wrap test needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)")
    if overlap == "1":
        scenarios = ["overlap", *CORE]
    else:
        scenarios = CORE + (["graphs"] if protocol == "device" else [])
    _run_in_one_process(
        scenarios, timeout_s=900, JAX_CPGRAD_TEST_PROTOCOL=protocol, JAX_CPGRAD_TEST_OVERLAP=overlap
    )


@pytest.mark.parametrize("protocol", ["device", "memop"])
def test_overlapped_workspaces_run_every_call_as_a_pair_on_their_own_stream(gpu, protocol):
    """Workspace(overlap=True), one process per GPU: the core scenarios with every call a
    start/done pair on the workspace's stream, and work placed between the two (the schedule
    checked, every result right). No CUDA graphs: the pairs stay out of them by design."""
    _need_own_gpus(2, protocol)
    need(jax_cpgrad._native.HAS_TEST_HOOKS, "the wrap test needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)")
    scenarios = ["overlap", *CORE]
    assert_all_ok(_run(2, scenarios, env={"JAX_CPGRAD_TEST_OVERLAP": "1"}, protocol=protocol), scenarios)


def test_the_overlap_test_fails_without_the_dones_wait(gpu):
    """Negative control of the overlap scenario (N = 1, one process): with the dones' waits removed
    (a test build's hook), results read before the slowed calls finish come out wrong."""
    need(jax_cpgrad._native.HAS_TEST_HOOKS, "the control needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)")
    _run_in_one_process(["overlap_unjoined"], timeout_s=300, CUDA_VISIBLE_DEVICES="0")


@pytest.mark.parametrize("overlap", ["0", "1"])
def test_one_gpu_in_process_n1(gpu, overlap):
    """N = 1 on one GPU in one process: the FFI path, jit, vmap and grad without any peer; with
    overlap, every call a pair on the workspace's stream and work placed between start and done."""
    need(jax_cpgrad._native.HAS_TEST_HOOKS, "the wrap test needs a test build (JAX_CPGRAD_TEST_HOOKS=ON)")
    scenarios = ["correctness", "wrap", "errors"] + (["overlap"] if overlap == "1" else [])
    _run_in_one_process(scenarios, timeout_s=600, CUDA_VISIBLE_DEVICES="0", JAX_CPGRAD_TEST_OVERLAP=overlap)
