"""The CP attention layer against unsharded ``jax.nn.dot_product_attention``: one run of every
rank on a mesh, its output and q/k/v gradients put back in natural order, and the largest error
of each relative to the reference's largest magnitude. Shared by the CPU tests and the GPU worker.

Masks: ``is_causal`` and ``local_window_size`` are jax's own; documents (``segment_ids``, natural
order ``[B, S]``) become jax's boolean ``mask``, built here in numpy from the runs of equal ids
(each contiguous run one document), independently of the layer's code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cpgrad as cpg
from jax_cpgrad.attention import layer as attention_layer

NAMES = ("out", "dq", "dk", "dv")


def random_inputs(seq: int, *, batch=1, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32, seed=0):
    """Natural-order q, k, v and an output cotangent, rounded to ``dtype`` (as numpy float32)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim)]
    q, k, v, ct = (rng.standard_normal(shapes[i in (1, 2)]).astype(np.float32) for i in range(4))
    return tuple(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v, ct))


def reference(q, k, v, ct, *, causal=True, scale=None, segment_ids=None, local_window_size=None, dtype=None):
    """Output and q/k/v gradients of the unsharded attention, XLA, float32 (or, with ``dtype``,
    computed in that dtype and returned as float32: a kernel's own error)."""
    mask = None if segment_ids is None else document_mask(segment_ids)[:, None]
    attend = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, mask=mask, local_window_size=local_window_size
    )
    arrays = (q, k, v, ct) if dtype is None else tuple(jnp.asarray(x, dtype) for x in (q, k, v, ct))
    out, vjp = jax.vjp(attend, *arrays[:3])
    return dict(
        zip(NAMES, (np.asarray(jnp.asarray(x, jnp.float32)) for x in (out, *vjp(arrays[3]))), strict=True)
    )


def document_mask(segment_ids) -> np.ndarray:
    """bool [B, S, S]: query and key in the same contiguous run of equal ids (natural order)."""
    ids = np.asarray(segment_ids)
    runs = np.concatenate([np.zeros_like(ids[:, :1]), np.cumsum(ids[:, 1:] != ids[:, :-1], axis=1)], axis=1)
    return runs[:, :, None] == runs[:, None, :]


def documents(kind: str, seq: int, batch: int, *, chunk: int, seed: int = 0) -> np.ndarray:
    """Natural-order segment ids [batch, seq] of a named layout, for chunks of ``chunk`` tokens."""
    rng = np.random.default_rng(seed)
    if kind == "one":
        return np.full((batch, seq), 7, np.int32)
    if kind == "short":  # many documents of a few tokens
        return np.cumsum(rng.random((batch, seq)) < 0.4, axis=1).astype(np.int32)
    if kind == "crossing":  # 1.5 chunks each: documents across chunk and rank boundaries
        return (np.arange(seq)[None] // (3 * chunk // 2) + np.arange(batch)[:, None]).astype(np.int32)
    if kind == "one_token":  # one-token documents at both ends and at the end of a chunk
        ids = np.repeat(np.arange(seq)[None] // (2 * chunk + 3), batch, axis=0).astype(np.int32) + 10
        ids[:, 0], ids[:, chunk - 1], ids[:, -1] = 0, 1, 99
        return ids
    if kind == "repeated":  # an id in two separate runs is two documents (runs of 5, ids cycling)
        return (np.arange(seq)[None] // 5 % 3 + np.zeros((batch, 1), int)).astype(np.int32)
    if kind == "nan_bits":  # ids whose float32 bit patterns are NaNs and infinities, in the transport
        values = np.array([-1, 0x7FC00000, 0x7F800001, 0x7F800000, -0x800000, 3], np.int64).astype(np.int32)
        return values[np.arange(seq)[None] // 7 % len(values) + np.zeros((batch, 1), int)]
    raise ValueError(kind)


def cp_layer(
    mesh,
    inputs,
    *,
    dtype,
    causal=True,
    workspace=None,
    implementation=None,
    remat=False,
    remat_policy=None,
    scale=None,
    head_groups=1,
    segment_ids=None,
    local_window_size=None,
    max_document_length=None,
    transfer_when_alone=False,
):
    """The layer's output and gradients, as {name: {rank: local rows}} for the ranks this process
    holds (numpy float32; no collective gathers them: XLA's refuse ranks that share a GPU).
    ``segment_ids``: natural-order ``[B, S]`` ids, placed in CP layout like the inputs."""
    layer = functools.partial(
        attention_layer.attention,
        axis_name="cp",
        workspace=workspace,
        is_causal=causal,
        implementation=implementation,
        scale=scale,
        head_groups=head_groups,
        local_window_size=local_window_size,
        max_document_length=max_document_length,
        transfer_when_alone=transfer_when_alone,
    )
    if remat:
        layer = jax.checkpoint(layer, policy=remat_policy)

    def body(q, k, v, ct, *ids):
        attend = lambda q, k, v: layer(q, k, v, segment_ids=ids[0] if ids else None)
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(ct))

    spec = P(None, "cp")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    placed = place(mesh, inputs, dtype)
    if segment_ids is not None:
        placed += place(mesh, [np.asarray(segment_ids)], np.asarray(segment_ids).dtype)
    return dict(zip(NAMES, (local_rows(o) for o in step(*placed)), strict=True))


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
    """Largest error over the ranks held, relative to the reference's largest magnitude (absolute
    where the reference is all zeros)."""
    errors = {}
    for name, by_rank in got.items():
        n = ref[name].shape[1] // next(iter(by_rank.values())).shape[1]
        laid = np.asarray(cpg.to_cp_layout(ref[name], n, seq_axis=1))
        t = laid.shape[1] // n
        worst = max(float(np.max(np.abs(rows - laid[:, r * t : (r + 1) * t]))) for r, rows in by_rank.items())
        # An exactly zero reference (e.g. dq and dk where each query sees only itself) has no
        # magnitude to be relative to: the error is then absolute.
        errors[name] = worst / (float(np.max(np.abs(ref[name]))) or 1.0)
    return errors
