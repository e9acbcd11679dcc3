"""The CP attention layer on a real GPU: bf16 through cuDNN against the float32 unsharded attention,
the same bits on every run, the overlapped schedule in the compiled program with its negative
control; documents and windows through the masked kernels, and the windows' halo-only transfer
(its rows and returned gradients bitwise, its schedule with a negative control, a missing
neighbour named). R = 1 in one process (device
protocol, the transfer's path forced on), and R = 2 and 4 processes sharing one GPU (memop
protocol). Skips, with the reason, without a GPU or a
CUDA build; JAX_CPGRAD_REQUIRE_GPU=1 turns those skips into failures.

The workers run with XLA_FLAGS=--xla_gpu_deterministic_ops=true: cuDNN's attention backward
otherwise sums dQ with atomics, in an order that changes from run to run."""

import os
import subprocess
import sys

import pytest

import jax_cpgrad
import jax_cpgrad._native
from gpu_support import assert_all_ok, need, need_gpu
from jax_cpgrad import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_attention_worker.py")
DETERMINISTIC = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}


@pytest.fixture
def gpu():
    need_gpu()
    need(
        jax_cpgrad._native.HAS_TEST_HOOKS, "the slow-owner hooks need a test build (JAX_CPGRAD_TEST_HOOKS=ON)"
    )


def _one_process(scenarios, protocol: str, deterministic: bool = True):
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="0",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        JAX_CPGRAD_TEST_PROTOCOL=protocol,
        **(DETERMINISTIC if deterministic else {}),
    )
    proc = subprocess.run(
        [sys.executable, WORKER, ",".join(scenarios)], capture_output=True, text=True, timeout=600, env=env
    )
    assert_all_ok([proc.stdout + proc.stderr[-3000:]], scenarios)


def test_layer_n1_device_protocol(gpu):
    _one_process(["values", "schedule", "vmapped", "masks"], "device")


def test_layer_head_groups_n1_device_protocol(gpu):
    """head_groups=2 at R = 1, without the deterministic flag: with it, XLA of jax 0.11.2 fails to
    run this program ("IndexError: absl::container_internal::raw_hash_map<>::at", seen with and
    without command buffers and without the ordering barrier between transfers), so the grouped
    results are compared with one group's within a tolerance (cuDNN's dQ atomics)."""
    _one_process(["head_groups"], "device", deterministic=False)


def test_layer_schedule_fails_without_the_dones_wait(gpu):
    """Negative control: with the dones' waits removed and the owner slowed, results go wrong."""
    _one_process(["schedule_unjoined"], "device")


@pytest.mark.parametrize("n", [2, 4])
def test_layer_ranks_sharing_one_gpu(gpu, n):
    scenarios = ["values", "schedule", "vmapped", "head_groups", "masks"]
    # With --xla_gpu_deterministic_ops=true, XLA (jax 0.11.2) fails to run the layer's step for
    # processes sharing a GPU ("IndexError: absl::container_internal::raw_hash_map<>::at" in
    # execute_sharded), so here two runs are compared within a tolerance (cuDNN's dQ atomics);
    # the same bits every run are checked at R = 1 (test_layer_n1_device_protocol).
    _launched(scenarios, n)


def _launched(scenarios, n: int) -> None:
    try:
        results = launch.launch(
            [sys.executable, WORKER, ",".join(scenarios)],
            n,
            timeout_s=600,
            env={"JAX_CPGRAD_TEST_PROTOCOL": "memop"},
            echo=False,
        )
    except launch.LaunchError as err:
        results = err.results
    assert_all_ok([r.output for r in sorted(results, key=lambda r: r.rank)], scenarios)


def test_cudnn_windows_n1_device_protocol(gpu):
    """A causal window through cuDNN's sliding window: one call at R = 1."""
    _one_process(["cudnn_windows"], "device")


@pytest.mark.parametrize("n", [2, 4])
def test_cudnn_windows_ranks_sharing_one_gpu(gpu, n):
    """Causal windows through cuDNN's plain calls, the halo (or, for a window of a chunk or more,
    the gather of the ranks within its reach) on the peer transport (cuDNN's
    dQ atomics: two runs compared within a tolerance, as test_layer_ranks_sharing_one_gpu)."""
    _launched(["cudnn_windows"], n)


@pytest.mark.parametrize("n", [2, 4])
def test_halo_ranks_sharing_one_gpu(gpu, n):
    """The window's halo-only transfer on the peer transport (a window needs R >= 2 to move
    anything): its rows and returned gradients bitwise against numpy, the layer with windows
    against float32, the overlapped schedule's pairs."""
    _launched(["halo_rows", "halo_layer"], n)


def test_halo_names_a_missing_neighbour(gpu):
    """The last rank stalls past the timeout before a halo exchange: the other's rows from it
    are NaN within the timeout, check() names it, the next call fails (only the waiter reports:
    once it exits the coordination service takes the straggler down)."""
    try:
        results = launch.launch(
            [sys.executable, WORKER, "halo_missing_peer"], 2, timeout_s=180,
            env={"JAX_CPGRAD_TEST_PROTOCOL": "memop"}, echo=False,
        )  # fmt: skip
    except launch.LaunchError as err:
        results = err.results
    assert_all_ok([r.output for r in sorted(results, key=lambda r: r.rank)], ["halo_missing_peer"], ranks=1)


def test_halo_schedule_fails_without_the_dones_wait(gpu):
    """Negative control: the windowed layer with the dones' waits removed and the owner slowed."""
    _launched(["halo_unjoined"], 2)
