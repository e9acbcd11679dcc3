"""The Mosaic GPU forward kernel (jax_cpgrad/attention/mosaic_gpu) without a GPU.

- interpret mode: the kernel runs on the CPU in Pallas' GPU interpreter (SMEM, TMA, barriers
  and wgmma simulated) against a float32 reference, with a tolerance of twice the reference's
  own error in the inputs' dtype; skipped, saying why, on a jax without GPU interpret mode;
- lowering: ``jax.export`` for ``cuda`` runs the whole Mosaic GPU lowering on the CPU (it needs
  ``jax-cuda13-plugin``, installed ``--no-deps``); both forms of the PV matmul (P in registers,
  for the GPU; through shared memory, the form interpret mode runs) and head dims 64/128/256.
  ``scripts/test_mosaic_lowering.sh`` runs this file on jax 0.11.2 and the newest 0.12.x and
  sets ``JAX_CPGRAD_REQUIRE_LOWERING=1``, which turns a lowering skip into a failure;
- the checks: every unsupported input is a ValueError saying what to use instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_cpgrad.attention import masks
from jax_cpgrad.attention.mosaic_gpu import Config, check_device, default_config, forward

F32 = jnp.float32
HAS_INTERPRET = hasattr(plgpu, "force_gpu_interpret_mode") and hasattr(plgpu, "InterpretGPUParams")


def _has_cuda_lowering() -> bool:
    # The plugin carries jax's Mosaic GPU extension; without it Pallas has no CUDA lowering.
    return importlib.util.find_spec("jax_cuda13_plugin") is not None


def _skip_lowering_reason() -> str | None:
    if _has_cuda_lowering():
        return None
    reason = (
        "the CUDA lowering needs jax-cuda13-plugin: pip install --no-deps jax-cuda13-plugin==<jax's version>"
    )
    if os.environ.get("JAX_CPGRAD_REQUIRE_LOWERING") == "1":
        pytest.fail(f"JAX_CPGRAD_REQUIRE_LOWERING=1 but {reason}")
    return reason


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: shapes, the mask, positions (and document lengths per batch row)."""

    name: str
    T: int
    L: int
    N: int = 1
    K: int = 1
    B: int = 1
    H: int = 64
    mask: masks.Mask = masks.Mask(causal=True)
    q_pos: tuple[int, ...] | None = None  # default: the last T of L positions
    docs: tuple[tuple[int, ...], ...] | None = None  # per batch row: document lengths (sum = T = L)

    def positions(self):
        q_pos = np.arange(self.L - self.T, self.L) if self.q_pos is None else np.asarray(self.q_pos)
        return jnp.asarray(q_pos, jnp.int32), jnp.arange(self.L, dtype=jnp.int32)

    def runs(self):
        """The documents' run ids [B, L], or None."""
        if self.docs is None:
            return None
        return masks.run_ids(jnp.asarray([np.repeat(np.arange(len(d)), d) for d in self.docs], jnp.int32))

    def visibility(self):
        q_pos, k_pos = self.positions()
        runs = self.runs()
        return masks.visibility(self.mask, q_pos, k_pos, runs, runs)


def _two_chunks(R: int, r: int, c: int):
    """The positions of rank r's two chunks (r and 2R-1-r, each c rows) of the CP layout."""
    return tuple(range(r * c, (r + 1) * c)) + tuple(range((2 * R - 1 - r) * c, (2 * R - r) * c))


CASES = [
    # A CP rank's two chunks (R = 2, rank 0, chunks of 64) against the whole sequence: causal at
    # two offsets in one call, the second chunk the heavy one.
    Case("causal_two_chunks", T=128, L=256, q_pos=_two_chunks(2, 0, 64)),
    Case("causal_offset", T=128, L=256),  # bottom-right causal: queries at 128..255
    Case("full_ragged", T=100, L=200, mask=masks.Mask()),  # neither length a multiple of a tile
    Case("window", T=256, L=256, mask=masks.Mask(causal=True, window=(48, 0))),
    Case("window_both_sides", T=128, L=192, mask=masks.Mask(window=(40, 24)), q_pos=tuple(range(32, 160))),
    Case("documents", T=200, L=200, B=2, docs=((37, 90, 73), (200,))),
    Case("gqa4", T=128, L=192, N=4, K=1),
    Case("gqa1_two_heads", T=128, L=128, N=2, K=2),
    # Queries before every key: rows 0..63 see nothing (out 0, lse -inf).
    Case("empty_rows", T=128, L=128, q_pos=tuple(range(-64, 64))),
]


def _inputs(case: Case, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (case.B, case.T, case.N, case.H), F32).astype(dtype)
    k = jax.random.normal(kk, (case.B, case.L, case.K, case.H), F32).astype(dtype)
    v = jax.random.normal(kv, (case.B, case.L, case.K, case.H), F32).astype(dtype)
    return q, k, v


def reference(q, k, v, vis, scale):
    """(out, lse) in float32 at HIGHEST precision from the dense mask; empty rows give 0, -inf."""
    seen = vis.dense()[:, None]  # [Bp, 1, T, L]
    group = q.shape[2] // k.shape[2]
    kr, vr = (jnp.repeat(x.astype(F32), group, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,blnh->bntl", q.astype(F32), kr, precision="highest") * scale
    s = jnp.where(seen, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(seen, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bntl,blnh->btnh", p, vr, precision="highest")
    return out, lse


def _reference_in_dtype(q, k, v, vis, scale):
    """jax.nn.dot_product_attention in the inputs' dtype: the error a 16-bit attention makes."""
    return jax.nn.dot_product_attention(q, k, v, mask=vis.dense()[:, None], scale=scale, implementation="xla")


def _interpret_config(H: int, **changes) -> Config:
    # block_k = 64: more key tiles than ring slots even at L = 128..256, so the ring wraps.
    return default_config(H, interpret=True).replace(block_k=64, **changes)


def _run_interpreted(q, k, v, vis, scale, config):
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        f = jax.jit(lambda q, k, v, vis: forward(q, k, v, vis, scale=scale, config=config))
        out, lse = f(q, k, v, vis)
        return np.asarray(out.astype(F32)), np.asarray(lse)


def _check_against_reference(case: Case, dtype, config: Config):
    q, k, v = _inputs(case, dtype)
    vis = case.visibility()
    scale = case.H**-0.5
    out, lse = _run_interpreted(q, k, v, vis, scale, config)
    assert out.shape == q.shape and lse.shape == (case.B, case.N, case.T)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    ref_out, ref_lse = (np.asarray(x) for x in reference(q, k, v, vis, scale))
    sees = np.broadcast_to(np.asarray(vis.row_hi > vis.row_lo), (case.B, case.T))  # [B, T]
    # Rows that see nothing: exactly 0 and -inf.
    assert (out[~sees] == 0).all()
    assert np.isneginf(lse.transpose(0, 2, 1)[~sees]).all()
    # The others: within twice the error of jax's attention run in the same dtype.
    low = np.asarray(_reference_in_dtype(q, k, v, vis, scale).astype(F32))
    budget = 2 * np.abs(low - ref_out)[sees].max()
    err = np.abs(out - ref_out)[sees].max()
    what = f"{case.name} {jnp.dtype(dtype).name}"
    assert err <= budget, f"{what}: max |out - ref| {err:.3g} > 2 x {budget / 2:.3g}"
    lse_err = np.abs(lse.transpose(0, 2, 1)[sees] - ref_lse.transpose(0, 2, 1)[sees]).max()
    assert lse_err <= 1e-3 * max(1.0, np.abs(ref_lse[np.isfinite(ref_lse)]).max()), lse_err
    return out, lse


interpret = pytest.mark.skipif(
    not HAS_INTERPRET, reason=f"jax {jax.__version__} has no Pallas GPU interpret mode"
)


@interpret
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpret_bf16(case):
    _check_against_reference(case, jnp.bfloat16, _interpret_config(case.H))


@interpret
@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=lambda c: c.name)
def test_interpret_f16(case):
    _check_against_reference(case, jnp.float16, _interpret_config(case.H))


@interpret
@pytest.mark.parametrize(
    "changes",
    [
        dict(consumers=1, pingpong=False, num_stages=3),  # one consumer, a 3-slot ring
        dict(block_k=128),  # the default key tile (2 slots, no wrap at these lengths)
        dict(block_q=128, consumers=1, pingpong=False),  # 128 rows in one warpgroup
    ],
    ids=["one_consumer_3_stages", "block_k_128", "block_q_128"],
)
def test_interpret_configs(changes):
    case = CASES[3]  # the window: masked tiles at both ends, full ones between
    config = default_config(case.H, interpret=True).replace(**changes)
    _check_against_reference(case, jnp.bfloat16, config)


@interpret
def test_interpret_deterministic():
    case = CASES[1]
    config = _interpret_config(case.H)
    q, k, v = _inputs(case, jnp.bfloat16)
    first = _run_interpreted(q, k, v, case.visibility(), 0.125, config)
    second = _run_interpreted(q, k, v, case.visibility(), 0.125, config)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a, b, equal_nan=True)


@interpret
@pytest.mark.parametrize("extra", [200, 40], ids=["in_place", "under_a_tile"])
def test_interpret_reads_the_first_rows_of_a_longer_q(extra):
    """q with more rows than the mask (the layer's halo call on each chunk's first rows): the
    same bits as the call on q's first T rows alone, whether q holds the padded tiles (read in
    place) or not (its first rows copied and padded); the rows after T are large and unread."""
    case = CASES[2]  # T = 100: its last tile is partial
    config = _interpret_config(case.H)
    q, k, v = _inputs(case, jnp.bfloat16)
    tail = 100 * jax.random.normal(jax.random.key(7), (case.B, extra, case.N, case.H), F32)
    longer = jnp.concatenate([q, tail.astype(q.dtype)], axis=1)
    want = _run_interpreted(q, k, v, case.visibility(), 0.125, config)
    got = _run_interpreted(longer, k, v, case.visibility(), 0.125, config)
    assert got[0].shape == q.shape and got[1].shape == (case.B, case.N, case.T)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def _split_keys(case: Case, at: int):
    """The case's call cut in two at key ``at``: ((k, v, vis) of the first keys, of the rest)."""
    q, k, v = _inputs(case, jnp.bfloat16)
    q_pos, k_pos = case.positions()
    runs = case.runs()
    part = lambda sl: (
        k[:, sl], v[:, sl],
        masks.visibility(case.mask, q_pos, k_pos[sl], runs, None if runs is None else runs[:, sl]),
    )  # fmt: skip
    return q, part(slice(0, at)), part(slice(at, None))


@interpret
@pytest.mark.parametrize("case", [CASES[5], CASES[0], CASES[8]], ids=lambda c: c.name)
def test_interpret_continues_a_previous_part(case):
    """``prev``: the call continues the (out, lse) of the same rows against other keys (a rank's
    remote part continuing its local one): within twice jax's own error of the whole call's float32
    reference; a row that sees none of the second part's keys gets the first part's bits back."""
    config = _interpret_config(case.H)
    q, first, second = _split_keys(case, 32)
    scale = case.H**-0.5
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        run = jax.jit(lambda q, k, v, vis, prev: forward(q, k, v, vis, scale=scale, config=config, prev=prev))
        prev = run(q, *first, None)
        out, lse = (np.asarray(x.astype(F32)) for x in run(q, *second, prev))
    vis = case.visibility()
    ref_out, ref_lse = (np.asarray(x) for x in reference(q, *_inputs(case, jnp.bfloat16)[1:], vis, scale))
    sees = np.broadcast_to(np.asarray(vis.row_hi > vis.row_lo), (case.B, case.T))
    low = np.asarray(_reference_in_dtype(q, *_inputs(case, jnp.bfloat16)[1:], vis, scale).astype(F32))
    budget = 2 * np.abs(low - ref_out)[sees].max()
    assert np.abs(out - ref_out)[sees].max() <= budget
    assert (out[~sees] == 0).all() and np.isneginf(lse.transpose(0, 2, 1)[~sees]).all()
    lse_t, ref_t = lse.transpose(0, 2, 1)[sees], ref_lse.transpose(0, 2, 1)[sees]
    assert np.abs(lse_t - ref_t).max() <= 1e-3 * max(1.0, np.abs(ref_t).max())
    unseen_here = np.broadcast_to(np.asarray(second[2].row_hi <= second[2].row_lo), (case.B, case.T))
    assert unseen_here.any() and (~unseen_here).any()  # both kinds of row are tested
    np.testing.assert_array_equal(out[unseen_here], np.asarray(prev[0].astype(F32))[unseen_here])
    np.testing.assert_array_equal(
        lse.transpose(0, 2, 1)[unseen_here], np.asarray(prev[1]).transpose(0, 2, 1)[unseen_here]
    )


# --- lowering for CUDA (no GPU needed) -----------------------------------------------------------


def _export(case: Case, dtype, config: Config | None):
    q, k, v = _inputs(case, dtype)
    vis = case.visibility()

    def f(q, k, v, vis):
        return forward(q, k, v, vis, scale=case.H**-0.5, config=config)

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        spec(q), spec(k), spec(v), jax.tree.map(spec, vis)
    )
    return exported.mlir_module()


LOWERING_CASES = [dataclasses.replace(c, H=h) for c in CASES for h in (64, 128)] + [
    dataclasses.replace(CASES[1], H=256, name="causal_offset"),
    dataclasses.replace(CASES[5], H=256, name="documents"),
]


@pytest.mark.parametrize("p_via_smem", [False, True], ids=["p_in_registers", "p_via_smem"])
@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"{c.name}-h{c.H}")
def test_lowers_for_cuda(case, p_via_smem):
    if reason := _skip_lowering_reason():
        pytest.skip(reason)
    text = _export(case, jnp.bfloat16, default_config(case.H).replace(p_via_smem=p_via_smem))
    assert "mosaic_gpu" in text  # the kernel's custom call
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1  # one launch per call


@pytest.mark.parametrize("H", [64, 128])
def test_continuing_call_lowers_for_cuda(H):
    """The call with ``prev`` (a rank's remote part continuing its local one), P in registers."""
    if reason := _skip_lowering_reason():
        pytest.skip(reason)
    case = dataclasses.replace(CASES[5], H=H)
    q, (k, v, vis), _ = _split_keys(case, case.L // 2)
    prev = (q, jnp.zeros((case.B, case.N, case.T), F32))

    def f(q, k, v, vis, prev):
        return forward(q, k, v, vis, scale=H**-0.5, config=default_config(H), prev=prev)

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    args = jax.tree.map(spec, (q, k, v, vis, prev))
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize(
    "config",
    [Config(consumers=1, pingpong=False, num_stages=3), Config(block_q=128, consumers=1, pingpong=False)],
    ids=["one_consumer_3_stages", "block_q_128"],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_lowers_for_cuda_configs(config, dtype):
    if reason := _skip_lowering_reason():
        pytest.skip(reason)
    assert "mosaic_gpu" in _export(dataclasses.replace(CASES[3], H=128), dtype, config)


# --- checks ---------------------------------------------------------------------------------------


def _call(q_shape=(1, 128, 2, 64), kv_shape=(1, 128, 1, 64), dtype=jnp.bfloat16, vis=None, **kw):
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype)
    if vis is None:
        vis = masks.visibility(masks.Mask(causal=True), jnp.arange(q_shape[1]), jnp.arange(kv_shape[1]))
    kw.setdefault("scale", 0.125)
    return jax.eval_shape(lambda q, k, v: forward(q, k, v, vis, **kw), q, kv, kv)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q_shape=(1, 128, 2, 96), kv_shape=(1, 128, 1, 96)), "head dimensions 64, 128, 256"),
        (dict(dtype=jnp.float32), "bfloat16 or float16"),
        (dict(q_shape=(1, 128, 3, 64), kv_shape=(1, 128, 2, 64)), "must divide"),
        (dict(kv_shape=(1, 128, 1, 128)), "key and value must be"),
        (dict(q_shape=(1, 128, 64)), r"query \[B, T, N, H\]"),
        (dict(scale=-1.0), "scale must be"),
        (dict(config=Config(num_stages=4)), "shared memory"),  # 4 stages at head dim 128
    ],
    ids=["head_dim", "float32", "gqa", "kv_shape", "rank", "scale", "smem"],
)
def test_bad_inputs(kwargs, match):
    if "config" in kwargs:
        kwargs.update(q_shape=(1, 128, 2, 128), kv_shape=(1, 128, 1, 128))
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_bad_prev():
    """``prev`` must be (out shaped and typed as q, lse [B, N, T])."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 128), F32)
    vis = masks.visibility(masks.Mask(causal=True), jnp.arange(128), jnp.arange(128))
    call = lambda prev: jax.eval_shape(
        lambda q, k, p: forward(q, k, k, vis, scale=0.125, prev=p), q, kv, prev
    )
    for bad in [(jax.ShapeDtypeStruct(q.shape, F32), lse), (q, jax.ShapeDtypeStruct((1, 2, 64), F32))]:
        with pytest.raises(ValueError, match="prev must be"):
            call(bad)
    out, merged = call((q, lse))
    assert out.shape == q.shape and merged.shape == lse.shape


def test_bad_visibility():
    """A mask of more query rows than q holds, or of another key count, is refused (fewer rows
    are the call of q's first rows: ``test_interpret_reads_the_first_rows_of_a_longer_q``)."""
    more_rows = masks.visibility(masks.Mask(causal=True), jnp.arange(256), jnp.arange(128))
    with pytest.raises(ValueError, match="vis describes 256 query rows, more than q's 128"):
        _call(vis=more_rows)
    other_keys = masks.visibility(masks.Mask(causal=True), jnp.arange(128), jnp.arange(64))
    with pytest.raises(ValueError, match=r"vis.col_lo must be \[1 or B=1, L=128\]"):
        _call(vis=other_keys)
    out, lse = _call(vis=masks.visibility(masks.Mask(causal=True), jnp.arange(64), jnp.arange(128)))
    assert out.shape == (1, 64, 2, 64) and lse.shape == (1, 2, 64)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(block_q=48), "multiple of 64"),
        (dict(block_k=320), "at most 256"),
        (dict(num_stages=1), ">= 2"),
        (dict(consumers=3), "1 or 2"),
        (dict(consumers=1), "pingpong needs consumers=2"),
    ],
)
def test_bad_config(changes, match):
    with pytest.raises(ValueError, match=match):
        Config(**changes)


def test_device_check():
    gpu = lambda cc, kind: types.SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind)
    check_device(gpu("9.0", "NVIDIA H200"))
    with pytest.raises(ValueError, match=r"compute capability 8.0 \(NVIDIA A100.*use implementation='cudnn'"):
        check_device(gpu("8.0", "NVIDIA A100-SXM4-80GB"))
    with pytest.raises(ValueError, match="compute capability 10.0"):
        check_device(gpu("10.0", "NVIDIA B200"))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="a cpu device"):
            check_device()
