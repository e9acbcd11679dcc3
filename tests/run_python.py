"""Running Python programs of this repository the way a user does, for the tests.

They run from a directory outside the checkout, so that `jax_cpgrad` is the installed package
(editable or not) rather than the source tree's, which has no compiled module; the scripts they
name are this checkout's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def script(relative_path: str) -> str:
    """The absolute path of a file of the checkout."""
    return os.path.join(ROOT, relative_path)


def run_python(args: list[str], timeout: float = 300, env: dict | None = None) -> str:
    """`python *args` (arguments naming a .py file of the checkout become absolute); its stdout.
    Fails the test, with the output's tail, on a non-zero exit."""
    args = [script(a) if a.endswith(".py") and os.path.exists(script(a)) else a for a in args]
    # -S passes through when the suite itself runs without site (a checkout next to an installed copy).
    site = ["-S"] if sys.flags.no_site else []
    proc = subprocess.run(
        [sys.executable, *site, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
        env=env or CPU_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
