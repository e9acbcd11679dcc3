"""A workspace as tracing, trace-time checks and lowering see it: its immutable description
(creating a real one needs GPUs)."""

from jax_cpgrad.spec import WorkspaceSpec


def workspace_spec(num_ranks: int = 2, **fields) -> WorkspaceSpec:
    base = dict(id=7, name="stub", axis_name="cp", num_ranks=num_ranks, nbytes=1 << 24, protocol="memop")
    return WorkspaceSpec(**{**base, **fields})
