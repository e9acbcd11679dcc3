"""Causal attention of one CP rank's queries against the gathered keys, three exact ways.

Layout: CP rank r of N holds global chunks r and 2N-1-r (c = S/(2N) tokens each), so its local
queries q [B, 2c, H, D] are chunk A = r then chunk B = 2N-1-r. Query chunk j needs the keys
0..(j+1)c-1 with a causal mask aligned bottom-right (the diagonal block is square). The gathered
keys k_glob/v_glob [B, S, Hk, D] are in natural order (jax_cpgrad.all_gather); Hk divides H (GQA).

- ``xla``: plain jnp (einsum, float32 softmax, position mask). Runs anywhere; memory S x 2c.
- ``mask``: ``jax.nn.dot_product_attention`` with a boolean mask built from positions (public
  API). Chunk A against keys [0, Nc) (all it can need), chunk B against all S keys. With
  implementation="cudnn" the mask becomes an additive bf16 bias cuDNN reads tile by tile and
  cannot skip: 3Nc^2 scores per rank where 2Nc^2 are needed, plus the bias in memory.
- ``split``: each query chunk = its diagonal block (square, causal top-left = bottom-right) plus
  the full (unmasked) key chunks before it, merged by log-sum-exp. The full blocks of a rank are
  always 2N-1 chunk pairs of c x c (chunk A has r, chunk B 2N-1-r), so their shapes are static
  under SPMD even though which pairs they are depends on the rank: one batched call for the full
  blocks, one for the two diagonal blocks. The merge has a custom VJP that runs each part's
  backward with the *merged* output and log-sum-exp, as ring-attention implementations do: that
  is the exact gradient (derivation in `_split_bwd`).

  Part backends: ``xla`` emulates the cuDNN kernels in jnp (any dtype, CPU: the tests), and
  ``cudnn`` binds jax's cuDNN flash-attention primitives directly. That is private jax API
  (``jax._src.cudnn.fused_attention_stablehlo``): the public ``dot_product_attention`` returns
  the log-sum-exp rounded to bf16 (a 0.03 error at lse ~ 10 is a 3% merge-weight error) and its
  backward ignores that residual's cotangent and cannot take an external output and statistics.
  The private binds are checked against jax 0.11.2 and 0.12 (their keyword sets differ by
  ``score_mod``, detected from the signature).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("xla", "mask", "split")
F32 = jnp.float32


def local_positions(rank, n: int, seq: int):
    """Global positions of a rank's local tokens (chunks rank and 2n-1-rank)."""
    c = seq // (2 * n)
    return jnp.concatenate([rank * c + jnp.arange(c), (2 * n - 1 - rank) * c + jnp.arange(c)])


# -- dense -------------------------------------------------------------------------------------


def attention_dense(q, k, v, q_pos, k_pos):
    """Causal attention of queries at q_pos against keys at k_pos; q [B,T,H,D], k/v [B,S,Hk,D]."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, h // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32) * (d**-0.5)
    mask = k_pos[None, :] <= q_pos[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=F32)
    return o.reshape(b, t, h, d).astype(q.dtype)


# -- mask --------------------------------------------------------------------------------------


def mask_attention_masks(rank, n: int, seq: int):
    """Boolean masks [1, 1, c, Nc] (chunk A) and [1, 1, c, S] (chunk B); build once per step."""
    c = seq // (2 * n)
    pos = local_positions(rank, n, seq)
    mask_a = jnp.arange(n * c)[None, :] <= pos[:c, None]
    mask_b = jnp.arange(seq)[None, :] <= pos[c:, None]
    return mask_a[None, None], mask_b[None, None]


def attention_mask(q, k_glob, v_glob, masks, n: int, implementation: str):
    c = q.shape[1] // 2
    mask_a, mask_b = masks
    kw = dict(implementation=implementation)
    o_a = jax.nn.dot_product_attention(q[:, :c], k_glob[:, : n * c], v_glob[:, : n * c], mask=mask_a, **kw)
    o_b = jax.nn.dot_product_attention(q[:, c:], k_glob, v_glob, mask=mask_b, **kw)
    return jnp.concatenate([o_a, o_b], axis=1)


# -- the parts of split: forward -> (out, lse [B, H, T] float32); backward with external out/lse -


def _grouped_scores(q, k, causal: bool):
    b, t, h, d = q.shape
    hk = k.shape[2]
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, hk, h // hk, d), k, preferred_element_type=F32)
    s = s * F32(d**-0.5)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)
    return s


def _xla_part_forward(q, k, v, causal: bool):
    b, t, h, d = q.shape
    s = _grouped_scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32))
    return o.reshape(b, t, h, d).astype(q.dtype), lse.reshape(b, h, t)


def _xla_part_backward(q, k, v, o, lse, do, causal: bool):
    """What the cuDNN backward computes from (q, k, v, o, lse, do): the softmax gradient with
    P = exp(S - lse) and D = rowsum(do * o), whatever o and lse are."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    s = _grouped_scores(q, k, causal)
    p = jnp.exp(s - lse.reshape(b, hk, g, t)[..., None])
    dog = do.reshape(b, t, hk, g, d).astype(F32)
    delta = jnp.einsum("btkgd,btkgd->bkgt", dog, o.reshape(b, t, hk, g, d).astype(F32))
    dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
    ds = p * (jnp.einsum("btkgd,bskd->bkgts", dog, v.astype(F32)) - delta[..., None]) * F32(d**-0.5)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32)).reshape(b, t, h, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.reshape(b, t, hk, g, d).astype(F32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _cudnn():
    from jax._src.cudnn import fused_attention_stablehlo as fas

    # jax 0.12 added flex attention: the primitives take a `score_mod` parameter (and positional
    # score_mod_args after the fixed operands, none here); jax 0.11.2 has neither.
    extra = (
        {"score_mod": None}
        if "score_mod" in inspect.signature(fas._dot_product_attention_fwd_impl).parameters
        else {}
    )
    return fas, extra


def _cudnn_params(fas, q, causal: bool):
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"cuDNN attention needs bfloat16 or float16, got {q.dtype}")
    d = q.shape[-1]
    if d % 8 or d > 256:
        raise ValueError(f"cuDNN flash attention needs a head dim <= 256 and a multiple of 8, got {d}")
    return dict(
        scale=float(1.0 / np.sqrt(d)),
        seed=42,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=fas.MaskType.CAUSAL if causal else fas.MaskType.NO_MASK,
        layout=fas.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )


def _cudnn_part_forward(q, k, v, causal: bool):
    fas, extra = _cudnn()
    unused = jnp.zeros((0,), q.dtype)  # bias, q/kv seqlens, q/kv offsets, page tables k/v: absent
    out, stats = fas._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, *([unused] * 7), is_training=True, **_cudnn_params(fas, q, causal), **extra
    )
    return out, stats  # stats: log-sum-exp of the scaled scores, [B, H, T] float32


def _cudnn_part_backward(q, k, v, o, lse, do, causal: bool):
    fas, extra = _cudnn()
    unused = jnp.zeros((0,), q.dtype)
    dq, dk, dv = fas._dot_product_attention_bwd_p_wrapper.bind(
        q,
        k,
        v,
        *([unused] * 7),
        lse.astype(F32),
        o.astype(q.dtype),
        do.astype(q.dtype),
        **_cudnn_params(fas, q, causal),
        **extra,
    )
    return dq, dk, dv


_PARTS = {
    "xla": (_xla_part_forward, _xla_part_backward),
    "cudnn": (_cudnn_part_forward, _cudnn_part_backward),
}


# -- split -------------------------------------------------------------------------------------


def _block_table(rank, n: int):
    """The 2N-1 full c x c blocks of a rank: block t belongs to query chunk owner[t] (0 = A, the
    chunk r; 1 = B, the chunk 2N-1-r) and reads key chunk key[t]. A has r blocks (keys 0..r-1),
    B has 2N-1-r (keys 0..2N-2-r)."""
    t = jnp.arange(2 * n - 1)
    return (t >= rank).astype(jnp.int32), jnp.where(t < rank, t, t - rank).astype(jnp.int32)


def _chunks(x, parts: int):
    """[B, parts*c, ...] -> [parts, B, c, ...]."""
    b, s = x.shape[:2]
    return jnp.swapaxes(x.reshape(b, parts, s // parts, *x.shape[2:]), 0, 1)


def _unchunk(x):
    """[parts, B, c, ...] -> [B, parts*c, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _flat(x):
    return x.reshape(-1, *x.shape[2:])


def _to_btn1(w):
    """[..., B, H, c] weights -> [..., B, c, H, 1] to scale outputs."""
    return jnp.swapaxes(w, -1, -2)[..., None]


def _split_forward(q, k_loc, v_loc, k_glob, v_glob, rank, n, backend):
    part_fwd = _PARTS[backend][0]
    nb = 2 * n - 1
    qc = _chunks(q, 2)  # [2, B, c, H, D]
    b, c, h, d = qc.shape[1:]
    owner, key = _block_table(rank, n)
    kc, vc = _chunks(k_glob, 2 * n), _chunks(v_glob, 2 * n)  # [2N, B, c, Hk, D]
    o_blk, l_blk = part_fwd(_flat(qc[owner]), _flat(kc[key]), _flat(vc[key]), False)
    o_dia, l_dia = part_fwd(_flat(qc), _flat(_chunks(k_loc, 2)), _flat(_chunks(v_loc, 2)), True)
    o_blk, l_blk = o_blk.reshape(nb, b, c, h, d), l_blk.reshape(nb, b, h, c)
    o_dia, l_dia = o_dia.reshape(2, b, c, h, d), l_dia.reshape(2, b, h, c)
    member = owner[None, :] == jnp.arange(2)[:, None]  # [2, nb]: block t belongs to chunk o
    l_mem = jnp.where(member[:, :, None, None, None], l_blk[None], -jnp.inf)  # [2, nb, B, H, c]
    m = jnp.maximum(l_dia, l_mem.max(axis=1))  # finite: every row sees its diagonal key
    lse = m + jnp.log(jnp.exp(l_dia - m) + jnp.exp(l_mem - m[:, None]).sum(axis=1))
    w_dia, w_blk = jnp.exp(l_dia - lse), jnp.exp(l_mem - lse[:, None])  # w_blk = 0 off-member
    out = _to_btn1(w_dia) * o_dia.astype(F32)
    out = out + jnp.einsum("onbch,nbchd->obchd", jnp.swapaxes(w_blk, -1, -2), o_blk.astype(F32))
    return _unchunk(out).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _split(q, k_loc, v_loc, k_glob, v_glob, rank, n, backend):
    return _split_forward(q, k_loc, v_loc, k_glob, v_glob, rank, n, backend)[0]


def _split_fwd(q, k_loc, v_loc, k_glob, v_glob, rank, n, backend):
    out, lse = _split_forward(q, k_loc, v_loc, k_glob, v_glob, rank, n, backend)
    return out, (q, k_loc, v_loc, k_glob, v_glob, rank, out, lse)


def _split_bwd(n, backend, res, d_out):
    """Exact gradient of the merged attention.

    With O = sum_p w_p O_p, w_p = exp(L_p - L), L = logsumexp_p L_p, the scores S_p of part p
    take the merged probabilities P = exp(S_p - L) = w_p P_p, so the true score gradient is
    dS_p = P * (dO V_p^T - rowsum(dO * O)) with the *merged* O and L. That is exactly what a
    flash-attention backward computes when it is given (O, L) instead of its own (O_p, L_p):
    run each part's backward with the merged output and log-sum-exp and the unscaled dO.
    (Autodiff through the merge would give the same: dO_p = w_p dO plus a cotangent
    w_p rowsum(dO * (O_p - O)) on L_p, whose term P_p * that restores the merged D; the public
    cuDNN backward drops that lse cotangent, hence this rule.)
    """
    q, k_loc, v_loc, k_glob, v_glob, rank, out, lse = res
    part_bwd = _PARTS[backend][1]
    nb = 2 * n - 1
    qc, oc, doc = _chunks(q, 2), _chunks(out, 2), _chunks(d_out.astype(q.dtype), 2)
    b, c, h, d = qc.shape[1:]
    hk = k_glob.shape[2]
    owner, key = _block_table(rank, n)
    kc, vc = _chunks(k_glob, 2 * n), _chunks(v_glob, 2 * n)
    dq_b, dk_b, dv_b = part_bwd(
        _flat(qc[owner]),
        _flat(kc[key]),
        _flat(vc[key]),
        _flat(oc[owner]),
        _flat(lse[owner]),
        _flat(doc[owner]),
        False,
    )
    dq_d, dk_d, dv_d = part_bwd(
        _flat(qc), _flat(_chunks(k_loc, 2)), _flat(_chunks(v_loc, 2)), _flat(oc), _flat(lse), _flat(doc), True
    )
    # Sum the block gradients into their query chunk and key chunk (one-hot contractions: exact,
    # deterministic), in float32, rounding once.
    member = (owner[None, :] == jnp.arange(2)[:, None]).astype(F32)  # [2, nb]
    onehot = (key[None, :] == jnp.arange(2 * n)[:, None]).astype(F32)  # [2N, nb]
    dq = dq_d.reshape(2, b, c, h, d).astype(F32)
    dq = dq + jnp.einsum("on,nbchd->obchd", member, dq_b.reshape(nb, b, c, h, d).astype(F32))
    scatter = lambda g: jnp.einsum("jn,nbchd->jbchd", onehot, g.reshape(nb, b, c, hk, d).astype(F32))
    dk_glob, dv_glob = _unchunk(scatter(dk_b)), _unchunk(scatter(dv_b))
    dk_loc, dv_loc = _unchunk(dk_d.reshape(2, b, c, hk, d)), _unchunk(dv_d.reshape(2, b, c, hk, d))
    return (
        _unchunk(dq).astype(q.dtype),
        dk_loc.astype(k_loc.dtype),
        dv_loc.astype(v_loc.dtype),
        dk_glob.astype(k_glob.dtype),
        dv_glob.astype(v_glob.dtype),
        None,
    )


_split.defvjp(_split_fwd, _split_bwd)


def attention_split(q, k_loc, v_loc, k_glob, v_glob, rank, n: int, backend: str):
    """The split attention; k_loc/v_loc are the rank's local keys (its two chunks, which the
    diagonal blocks read directly), k_glob/v_glob the gathered ones (the full blocks)."""
    if backend not in _PARTS:
        raise ValueError(f"backend must be one of {sorted(_PARTS)}, got {backend!r}")
    return _split(q, k_loc, v_loc, k_glob, v_glob, jnp.asarray(rank, jnp.int32), n, backend)


# -- one entry point for the step --------------------------------------------------------------


def make_cp_attention(kind: str, backend: str, rank, n: int, seq: int):
    """attend(q, k_loc, v_loc, k_glob, v_glob) for CP rank `rank` (traced) of n.

    backend: "cudnn" or "xla" (the implementation of `mask` and the parts of `split`; `xla` is
    always plain jnp). Build it once per step: `mask` builds its masks here, shared by all layers.
    """
    if kind == "xla":
        q_pos, k_pos = local_positions(rank, n, seq), jnp.arange(seq)
        return lambda q, k, v, kg, vg: attention_dense(q, kg, vg, q_pos, k_pos)
    if kind == "mask":
        masks = mask_attention_masks(rank, n, seq)
        return lambda q, k, v, kg, vg: attention_mask(q, kg, vg, masks, n, backend)
    if kind == "split":
        return lambda q, k, v, kg, vg: attention_split(q, k, v, kg, vg, rank, n, backend)
    raise ValueError(f"attention must be one of {KINDS}, got {kind!r}")


def reference_attention(q, k, v):
    """Unsharded causal attention (natural order), plain jnp."""
    pos = jnp.arange(q.shape[1])
    return attention_dense(q, k, v, pos, pos)


def check_against_dense(
    kind: str,
    backend: str,
    n: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    chunk: int = 128,
    dtype=jnp.bfloat16,
    seed: int = 0,
) -> dict:
    """Run `kind` for every rank of an n-way CP group at a small size on the default device and
    compare its output and gradients (q, k, v; random output cotangent) with the float32 dense
    unsharded attention. Returns the largest error of each over the ranks, relative to the
    reference's largest magnitude: {"out", "dq", "dk", "dv"}. dk/dv: the ranks' contributions
    summed (what grad_return computes), so every key's gradient is checked once.

    On a GPU this catches a wrong cuDNN path (e.g. statistics that are not the natural-log lse
    of the scaled scores) before anything is timed."""
    from jax_cpgrad import layout

    seq = 2 * n * chunk
    rng = np.random.default_rng(seed)
    q, ct = (rng.standard_normal((1, seq, heads, head_dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, seq, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    cast = lambda x: jnp.asarray(x, dtype)
    # The reference sees the same (rounded) inputs, so only the attention's own error counts.
    q, k, v, ct = (np.asarray(cast(x), np.float32) for x in (q, k, v, ct))
    ref_o, ref_vjp = jax.vjp(reference_attention, q, k, v)
    ref = dict(zip(("out", "dq", "dk", "dv"), (ref_o, *ref_vjp(ct)), strict=True))
    ref = {name: np.asarray(x) for name, x in ref.items()}
    by_rank = np.asarray(layout.to_cp_layout(np.arange(seq), n, seq_axis=0)).reshape(n, -1)
    got = {
        "out": np.zeros_like(ref["out"]),
        "dq": np.zeros_like(ref["dq"]),
        "dk": np.zeros_like(ref["dk"]),
        "dv": np.zeros_like(ref["dv"]),
    }
    for rank in range(n):
        mine = by_rank[rank]

        def f(q_loc, kg, vg, rank=rank, mine=mine):
            attend = make_cp_attention(kind, backend, jnp.int32(rank), n, seq)
            return attend(q_loc, kg[:, mine], vg[:, mine], kg, vg)

        o, vjp = jax.vjp(jax.jit(f), cast(q[:, mine]), cast(k), cast(v))
        dq, dk, dv = vjp(cast(ct[:, mine]))
        got["out"][:, mine] = np.asarray(o, np.float32)
        got["dq"][:, mine] = np.asarray(dq, np.float32)
        got["dk"] += np.asarray(dk, np.float32)
        got["dv"] += np.asarray(dv, np.float32)
    return {
        name: float(np.max(np.abs(got[name] - ref[name])) / (np.max(np.abs(ref[name])) + 1e-30))
        for name in ref
    }
