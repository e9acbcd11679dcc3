"""A Workspace as tracing, trace-time checks and lowering see it (creating a real one needs GPUs)."""

import types

import jax_cpgrad as cpg


def workspace_stub(n: int = 2, **state):
    ws = object.__new__(cpg.Workspace)
    ws.__dict__.update(dict(_closed=False, axis_name="cp", n=n, nbytes=1 << 24, name="stub",
                            _native=types.SimpleNamespace(id=7)), **state)
    return ws
