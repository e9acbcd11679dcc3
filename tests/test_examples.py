"""The programs outside the package run: the example script and the demo (small sizes, CPU); the
experiments' kernel sweep (experiments/kernel_variants.cu) compiles."""

import os
import subprocess

import pytest

from run_python import run_python, script


def test_example_training_script_runs_and_learns():
    out = run_python(["examples/train_cp_transformer.py", "--n", "4", "--seq-len", "128", "--steps", "12"])
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 12
    assert min(losses[-3:]) < losses[0], losses


def test_example_training_script_runs_as_two_cpu_processes():
    """The launcher's multi-process mode on a laptop: 2 ranks on the CPU, gloo between them."""
    args = ["--devices", "none", "--timeout", "240", "examples/train_cp_transformer.py", "--steps", "3"]
    out = run_python(["-m", "jax_cpgrad.launch", "-n", "2", *args, "--seq-len", "256"], timeout=300)
    steps = [line for line in out.splitlines() if line.startswith("[rank 0] step")]
    assert len(steps) == 3, out


def test_demo_runs_on_cpu_and_matches_the_reference():
    out = run_python(["-m", "jax_cpgrad.demo", "--cpu", "--seq-len", "256", "--steps", "3"])
    assert "8 CPU devices; transports: xla" in out
    row = next(line for line in out.splitlines() if line.startswith("xla "))
    _, first, last, dloss, dgrad, ms = row.split()
    assert float(dloss) < 1e-4 and float(dgrad) < 1e-5, row
    assert float(ms) > 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: CP gradients (xla transport) match the unsharded model (max rel err "), last


def test_demo_with_documents_a_window_and_checkpointed_layers_matches_the_reference():
    args = ["--cpu", "--seq-len", "256", "--steps", "2", "--documents", "40", "--window", "24", "--remat"]
    out = run_python(["-m", "jax_cpgrad.demo", *args])
    assert "documents of about 40 tokens; layer 0 a window of 24, layer 1 global; layers checkpointed" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: CP gradients (xla transport) match the unsharded model (max rel err "), last


def _find_nvcc():
    for candidate in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = os.path.join(candidate, "bin", "nvcc")
        if candidate and os.access(path, os.X_OK):
            return path
    return None


def test_kernel_variant_sweep_compiles(tmp_path):
    # The sweep is a standalone program (not built with the package); compiling it keeps it from
    # rotting. Running it needs a GPU: experiments/README.md.
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA_HOME or /usr/local/cuda)")
    proc = subprocess.run(
        [
            nvcc,
            "-O3",
            "-std=c++17",
            "-arch=sm_90",
            "--extended-lambda",
            "-c",
            script("experiments/kernel_variants.cu"),
            "-o",
            str(tmp_path / "kv.o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_transport_example_runs_on_cpu_devices():
    out = run_python(["examples/transport_collectives.py"])
    assert "8 ranks (XLA): gathered K (8, 2048, 8, 128), returned dK (1, 2048, 8, 128)" in out, out
