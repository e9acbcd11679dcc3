"""A CPU-only build (no nvcc) imports, runs the XLA transport, and says what a GPU call lacks (and,
where JAX has a CUDA plugin, warns at import)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import sys, warnings
# An editable install redirects `import jax_cpgrad` through a meta-path finder: take the copy.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax_cpgrad as cpg
for w in caught:
    print("WARNING:", w.message)
from jax_cpgrad._native import require_cuda
assert cpg.HAS_CUDA is False
mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("cp",))
x = jax.device_put(np.ones((2, 8, 3), np.float32), NamedSharding(mesh, P("cp")))
f = jax.jit(jax.shard_map(lambda a: cpg.grad_return(a[0], axis_name="cp", seq_axis=0)[None],
                          mesh=mesh, in_specs=P("cp"), out_specs=P("cp")))
assert np.all(np.asarray(f(x)) == 2.0)
try:
    require_cuda("jax_cpgrad.Workspace")
except RuntimeError as err:
    print("ERROR:", err)
"""


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cpu_only_build_imports_and_explains_gpu_calls(tmp_path):
    build = tmp_path / "build"
    configure = [
        shutil.which("cmake"),
        "-S",
        ROOT,
        "-B",
        str(build),
        "-DJAX_CPGRAD_CUDA=OFF",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for cmd in (configure, [shutil.which("cmake"), "--build", str(build), "-j", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # A copy of the package with the CPU-only module in place of the installed one.
    package = tmp_path / "pkg" / "jax_cpgrad"
    shutil.copytree(
        os.path.join(ROOT, "jax_cpgrad"), package, ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    for so in build.glob("_cpgrad_ext*.so"):
        shutil.copy(so, package)
    # What a JAX GPU user has: a CUDA plugin (its metadata is all the import-time check reads).
    plugin = tmp_path / "pkg" / "jax_cuda13_plugin-0.11.2.dist-info"
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: jax-cuda13-plugin\nVersion: 0.11.2\n")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(package.parent), JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "ERROR: jax_cpgrad.Workspace needs the CUDA peer transport, but jax_cpgrad was built without CUDA"
        in proc.stdout
    )
    assert "JAX_CPGRAD_CUDA=ON pip install ." in proc.stdout and "build_wheel.sh" in proc.stdout
    # A GPU user (JAX has a CUDA plugin) hears about the CPU-only build at import already.
    assert "WARNING: jax_cpgrad" in proc.stdout and "jax-cuda13-plugin 0.11.2" in proc.stdout, proc.stdout
