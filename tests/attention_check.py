"""The CP attention layer against unsharded ``jax.nn.dot_product_attention``: one run of every
rank on a mesh, its output and q/k/v gradients put back in natural order, and the largest error
of each relative to the reference's largest magnitude. Shared by the CPU tests and the GPU worker.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cpgrad as cpg

NAMES = ("out", "dq", "dk", "dv")


def random_inputs(seq: int, *, batch=1, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32, seed=0):
    """Natural-order q, k, v and an output cotangent, rounded to ``dtype`` (as numpy float32)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim)]
    q, k, v, ct = (rng.standard_normal(shapes[i in (1, 2)]).astype(np.float32) for i in range(4))
    return tuple(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v, ct))


def reference(q, k, v, ct, *, causal=True, scale=None):
    """Output and q/k/v gradients of the unsharded attention, float32, XLA."""
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out, vjp = jax.vjp(attend, q, k, v)
    return dict(zip(NAMES, (np.asarray(x) for x in (out, *vjp(ct))), strict=True))


def cp_layer(
    mesh,
    inputs,
    *,
    dtype,
    causal=True,
    workspace=None,
    implementation=None,
    remat=False,
    scale=None,
    head_groups=1,
):
    """The layer's output and gradients, as {name: {rank: local rows}} for the ranks this process
    holds (numpy float32; no collective gathers them: XLA's refuse ranks that share a GPU)."""
    layer = functools.partial(
        cpg.dot_product_attention,
        axis_name="cp",
        workspace=workspace,
        is_causal=causal,
        implementation=implementation,
        scale=scale,
        head_groups=head_groups,
    )
    if remat:
        layer = jax.checkpoint(layer)

    def body(q, k, v, ct):
        out, vjp = jax.vjp(layer, q, k, v)
        return (out, *vjp(ct))

    spec = P(None, "cp")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return dict(zip(NAMES, (local_rows(o) for o in step(*place(mesh, inputs, dtype))), strict=True))


def place(mesh, arrays, dtype, seq_axis: int = 1) -> list:
    """Natural-order arrays in CP layout, as ``dtype``, sharded over the mesh's "cp" axis on
    ``seq_axis``."""
    n = mesh.shape["cp"]
    sharding = NamedSharding(mesh, P(*[None] * seq_axis, "cp"))
    laid = [np.asarray(cpg.to_cp_layout(x, n, seq_axis=seq_axis)) for x in arrays]
    return [
        jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: np.asarray(jnp.asarray(x[i], dtype)))
        for x in laid
    ]


def local_rows(x) -> dict[int, np.ndarray]:
    """{rank: its rows [B, T, ...]} of a CP-layout array sharded on the sequence axis, for the
    shards this process holds."""
    length = x.shape[1] // len(x.sharding.mesh.devices.flat)
    return {(s.index[1].start or 0) // length: np.asarray(s.data, np.float32) for s in x.addressable_shards}


def relative_errors(got: dict, ref: dict) -> dict:
    """Largest error over the ranks held, relative to the reference's largest magnitude."""
    errors = {}
    for name, by_rank in got.items():
        n = ref[name].shape[1] // next(iter(by_rank.values())).shape[1]
        laid = np.asarray(cpg.to_cp_layout(ref[name], n, seq_axis=1))
        t = laid.shape[1] // n
        worst = max(float(np.max(np.abs(rows - laid[:, r * t : (r + 1) * t]))) for r, rows in by_rank.items())
        errors[name] = worst / (float(np.max(np.abs(ref[name]))) + 1e-30)
    return errors
