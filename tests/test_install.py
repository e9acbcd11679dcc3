"""Installs that fail say why: the source tree shadowing an installed copy, and Python < 3.12."""

import os
import shutil
import subprocess
import sys

import pytest

from run_python import ROOT, run_python

SHADOWED = """
import sys
# What a non-editable install sees from the clone's root: the source tree first on sys.path (the
# editable install's finder, which would supply the compiled module, removed).
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
try:
    import jax_cpgrad
except ImportError as err:
    print("ImportError:", err)
else:
    print("imported from", jax_cpgrad.__file__)
"""


def test_importing_the_source_tree_names_the_cause_and_the_fix():
    proc = subprocess.run(
        [sys.executable, "-c", SHADOWED],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    out = proc.stdout + proc.stderr
    assert "ImportError: jax_cpgrad is being imported from the source tree at" in out, out[-3000:]
    assert "run from another directory" in out and "pip install -e ." in out, out[-3000:]


def _old_python():
    for name in ("python3.11", "python3.10", "/usr/bin/python3"):
        path = shutil.which(name)
        if path:
            probe = subprocess.run(
                [path, "-c", "import sys, venv, ensurepip; print(sys.version_info < (3, 12))"],
                capture_output=True,
                text=True,
            )
            if probe.stdout.strip() == "True":
                return path
    return None


def test_pip_install_on_python_311_says_python_312_is_needed(tmp_path):
    old = _old_python()
    if old is None:
        pytest.skip("no Python < 3.12 with venv and pip on this machine")
    subprocess.run([old, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=300)
    source = tmp_path / "src"  # a copy, so that nothing is written into the checkout
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "benchmarks", "tests", "*.so", "__pycache__"),
    )
    proc = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "pip"), "install", "--no-cache-dir", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    if "No matching distribution found for scikit-build-core" in out or "NewConnectionError" in out:
        pytest.skip("the package index is not reachable: " + out[-500:])
    assert proc.returncode != 0
    assert "jax_cpgrad needs Python >= 3.12" in out, out[-3000:]
    assert "No matching distribution found for jaxlib" not in out, out[-3000:]


def test_python_m_jax_cpgrad_describes_the_install():
    out = run_python(["-m", "jax_cpgrad"])
    assert "CUDA peer transport built:" in out and out.strip().splitlines()[-1].startswith("OK: "), out
