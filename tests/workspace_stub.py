"""A workspace as tracing, trace-time checks and lowering see it: its immutable description
(creating a real one needs GPUs)."""

from jax_cpgrad.spec import WorkspaceSpec


def workspace_spec(num_ranks: int = 2, **fields) -> WorkspaceSpec:
    base = dict(id=7, name="stub", axis_name="cp", num_ranks=num_ranks, nbytes=1 << 24, protocol="memop")
    return WorkspaceSpec(**{**base, **fields})


def _in_reach(spec: WorkspaceSpec, x, seq_axis: int, num_ranks: int):
    """bool, broadcastable against global ``x``: the rows whose owner is within the spec's reach
    of this rank (every row for reach 0)."""
    import jax
    import jax.numpy as jnp

    length = x.shape[seq_axis]
    chunk = jnp.arange(length) // (length // (2 * num_ranks))
    owner = jnp.where(chunk < num_ranks, chunk, 2 * num_ranks - 1 - chunk)
    rank = jax.lax.axis_index(spec.axis_name)
    keep = (spec.reach == 0) | (jnp.abs(owner - rank) <= spec.reach)
    return keep.reshape([length if a == seq_axis else 1 for a in range(x.ndim)])


def peer_calls_on_xla(monkeypatch) -> None:
    """The peer transport's whole calls swapped for XLA's collectives with the kernels' reach
    (``WorkspaceSpec.within``): an all-gather's rows of ranks out of reach are zeros, and a
    grad_return leaves out the contributions of writers out of reach. The layer's choice of
    reach then runs on the CPU (for a workspace without overlap); the sums are XLA's, not the
    peer transport's."""
    import jax.numpy as jnp

    from jax_cpgrad import api
    from jax_cpgrad.xla_transport import all_gather_xla, grad_return_xla

    def all_gather(xs, seq, n, spec):
        outs = [all_gather_xla(x, spec.axis_name, seq, n) for x in xs]
        return tuple(jnp.where(_in_reach(spec, o, seq, n), o, jnp.zeros_like(o)) for o in outs)

    def grad_return(xs, seq, n, spec):
        kept = [jnp.where(_in_reach(spec, x, seq, n), x, jnp.zeros_like(x)) for x in xs]
        return tuple(grad_return_xla(x, spec.axis_name, seq, n) for x in kept)

    monkeypatch.setattr(api, "all_gather_peer", all_gather)
    monkeypatch.setattr(api, "grad_return_peer", grad_return)
