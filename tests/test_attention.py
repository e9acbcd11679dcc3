"""jax_cpgrad.dot_product_attention on CPU devices against unsharded jax.nn.dot_product_attention:
values and q/k/v gradients for R = 1, 2, 4, 8 ranks (``n`` here), causal and not, MHA, GQA and
MQA, float32 and bfloat16, under jit, grad and jax.checkpoint; the cuDNN code path through
stand-in primitives; the bad inputs it refuses. Documents and windows: test_attention_masks.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_check as ac
import jax_cpgrad as cpg
from jax_cpgrad.attention import kernels
from spmd import cp_mesh
from workspace_stub import peer_calls_on_xla, workspace_spec

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 5e-2, jnp.float16: 1e-2}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "gqa_g3": (6, 2), "mqa": (4, 1)}  # gqa_g3: G != K


def _check(n, *, causal=True, heads="gqa", dtype=jnp.float32, chunk=8, batch=1, **kw):
    h, hk = HEADS[heads]
    inputs = ac.random_inputs(2 * n * chunk, batch=batch, heads=h, kv_heads=hk, dtype=dtype, seed=n)
    ref = ac.reference(
        *inputs, causal=causal, scale=kw.get("scale"), local_window_size=kw.get("local_window_size")
    )
    got = ac.cp_layer(cp_mesh(n), inputs, dtype=dtype, causal=causal, **kw)
    errs = ac.relative_errors(got, ref)
    assert max(errs.values()) <= TOLERANCE[dtype], errs
    return errs


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_matches_unsharded_attention_float32(n, causal, heads):
    _check(n, causal=causal, heads=heads)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_unsharded_attention_bfloat16(n, causal):
    _check(n, causal=causal, dtype=jnp.bfloat16, chunk=16)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_float16_and_batch_rows(n, causal):
    _check(n, causal=causal, heads="mqa", dtype=jnp.float16, chunk=16, batch=2)


@pytest.mark.parametrize("n", [1, 4])
def test_under_jax_checkpoint(n):
    _check(n, remat=True)


def test_custom_scale_and_batch_rows():
    h, hk = HEADS["gqa"]
    inputs = ac.random_inputs(32, batch=3, heads=h, kv_heads=hk, seed=5)
    ref = ac.reference(*inputs, scale=0.3)
    errs = ac.relative_errors(ac.cp_layer(cp_mesh(2), inputs, dtype=jnp.float32, scale=0.3), ref)
    assert max(errs.values()) <= TOLERANCE[jnp.float32], errs


@pytest.mark.parametrize(
    "n,heads,groups", [(2, "mha", 2), (4, "mha", 4), (8, "gqa", 2), (4, "gqa_g3", 2)], ids=str
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_groups_pipeline_matches_unsharded_attention(n, heads, groups, causal):
    _check(n, causal=causal, heads=heads, head_groups=groups)


def test_head_groups_under_jax_checkpoint_and_bfloat16():
    _check(4, heads="mha", dtype=jnp.bfloat16, chunk=16, head_groups=2, remat=True)


def test_the_split_path_at_n1():
    """At R = 1 the layer is one attention call; the two-part path (what the transfer's path
    runs at R = 1 on one GPU, transfer_when_alone) must be exact too."""
    _check(1, transfer_when_alone=True)


def test_grad_of_a_loss_through_the_layer():
    """jax.grad of a scalar loss (not only jax.vjp) reaches q, k and v through the transfer."""
    n, seq = 4, 64
    q, k, v, _ = ac.random_inputs(seq, seed=3)
    mesh = cp_mesh(n)
    spec = jax.sharding.PartitionSpec(None, "cp")

    def loss(q, k, v):
        out = cpg.dot_product_attention(q, k, v, axis_name="cp")
        return jax.lax.psum(jnp.sum(jnp.sin(out)), "cp")

    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=spec, out_specs=spec))
    laid = [cpg.to_cp_layout(x, n, seq_axis=1) for x in (q, k, v)]
    got = [np.asarray(cpg.from_cp_layout(g, n, seq_axis=1)) for g in grad(*laid)]
    ref = jax.grad(
        lambda q, k, v: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, is_causal=True))), (0, 1, 2)
    )
    for g, r in zip(got, ref(q, k, v), strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5 * np.abs(r).max())


def test_same_bits_every_run():
    inputs = ac.random_inputs(64, seed=9)
    first = ac.cp_layer(cp_mesh(4), inputs, dtype=jnp.float32)
    second = ac.cp_layer(cp_mesh(4), inputs, dtype=jnp.float32)
    for name in ac.NAMES:
        for rank, rows in first[name].items():
            assert np.array_equal(rows, second[name][rank]), (name, rank)


def test_the_private_cudnn_binds_are_found_on_this_jax():
    """The fast path's dependency on jax internals: found on every supported jax (the CPU suite
    runs the newest, the GPU machine the oldest); a jax that changes them fails here first."""
    assert kernels.cudnn.binds() is not None, (
        f"jax {jax.__version__}: private cuDNN attention binds not found"
    )


def test_the_xla_kernels_clear_rows_that_see_no_key():
    q, k, v, ct = (jnp.asarray(x) for x in ac.random_inputs(8, batch=2, heads=2, kv_heads=1, seed=1))
    kv_len = jnp.array([0, 5], jnp.int32)
    out, lse = kernels.forward("xla", q, k, v, causal=False, scale=0.25, kv_len=kv_len)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isneginf(np.asarray(lse[0])))
    ref = jax.nn.dot_product_attention(q[1:], k[1:, :5], v[1:, :5], scale=0.25)
    np.testing.assert_allclose(out[1:], ref, atol=1e-6)
    dq, dk, dv = kernels.backward("xla", q, k, v, out, lse, ct, causal=False, scale=0.25, kv_len=kv_len)
    for grad in (dq[0], dk[0], dv[0], dk[1, 5:], dv[1, 5:]):
        assert not np.any(np.asarray(grad))
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.25)
    ref = jax.vjp(attend, q[1:], k[1:, :5], v[1:, :5])[1](ct[1:])
    for got, want in zip((dq[1:], dk[1:, :5], dv[1:, :5]), ref, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


class _FakeCudnnPrimitives:
    """Stands in for jax's private cuDNN primitives on the CPU: the XLA kernels given the operands
    and parameters as the layer binds them, writing NaN where cuDNN leaves values unspecified
    (padded key rows of dK/dV; query rows past q_len in every output), so that the layer's cuDNN
    code (operand order, the lengths, the clamp of empty entries, the masks) is checked here and
    not only on a GPU."""

    class MaskType:
        NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL = "none", "padding", "causal", "padding_causal"

    class AttentionLayout:
        class BTNH:
            value = "btnh"

    def __init__(self):
        fake = self
        self.key_counts: list[np.ndarray] = []  # every kv_len cuDNN was given
        self.windows: list[int | None] = []  # every sliding_window_length it was given

        class Fwd:
            @staticmethod
            def bind(q, k, v, bias, q_len, kv_len, q_off, kv_off, pk, pv, *, mask_type, scale, **kw):
                args = fake._args(mask_type, scale, kv_len, kw["sliding_window_length"])
                out, lse = kernels.xla.forward(q, k, v, **args)
                return fake._past_q_len(out, q_len, 1), fake._past_q_len(lse, q_len, 2)

        class Bwd:
            @staticmethod
            def bind(
                q, k, v, bias, q_len, kv_len, q_off, kv_off, pk, pv, lse, o, do, *, mask_type, scale, **kw
            ):
                args = fake._args(mask_type, scale, kv_len, kw["sliding_window_length"])
                dq, dk, dv = kernels.xla.backward(q, k, v, o, lse, do, **args)
                if kv_len.size:  # unspecified rows, as cuDNN leaves them
                    pad = (jnp.arange(k.shape[1]) >= kv_len[:, None])[:, :, None, None]
                    dk, dv = (jnp.where(pad, jnp.nan, g) for g in (dk, dv))
                return fake._past_q_len(dq, q_len, 1), dk, dv

        self._dot_product_attention_fwd_p_wrapper = Fwd
        self._dot_product_attention_bwd_p_wrapper = Bwd

    @staticmethod
    def _past_q_len(x, q_len, axis: int):
        """NaN in the query rows (along ``axis``) at or past each entry's q_len."""
        if not q_len.size:
            return x
        rows = jnp.arange(x.shape[axis]) >= q_len[:, None]  # [B, T]
        shape = [x.shape[0]] + [1] * (x.ndim - 1)
        shape[axis] = x.shape[axis]
        return jnp.where(rows.reshape(shape), jnp.nan, x)

    def _args(self, mask_type, scale, kv_len, sliding_window_length):
        causal = mask_type in (self.MaskType.CAUSAL, self.MaskType.PADDING_CAUSAL)
        assert (kv_len.size > 0) == (mask_type in (self.MaskType.PADDING, self.MaskType.PADDING_CAUSAL))
        self.windows.append(sliding_window_length)
        # jax passes a left window w as cuDNN's sliding window of w + 1, with the causal mask only
        assert sliding_window_length is None or (
            sliding_window_length >= 1 and mask_type == self.MaskType.CAUSAL
        )
        window = None if sliding_window_length is None else sliding_window_length - 1
        if kv_len.size:
            jax.debug.callback(lambda x: self.key_counts.append(np.asarray(x)), kv_len)
        return dict(causal=causal, scale=scale, kv_len=kv_len if kv_len.size else None, window=window)


@pytest.mark.parametrize(
    "n,split_alone", [(1, False), (1, True), (2, False), (4, False)], ids=["1", "1-split", "2", "4"]
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,head_groups", [("gqa_g3", 1), ("mqa", 1), ("gqa_g3", 2)], ids=str)
def test_the_cudnn_code_path_with_stand_in_primitives(
    monkeypatch, n, split_alone, causal, heads, head_groups
):
    fake = _FakeCudnnPrimitives()
    monkeypatch.setattr(kernels.cudnn, "binds", lambda: (fake, {}))
    monkeypatch.setattr(kernels.cudnn, "max_head_dim", lambda: 256)
    _check(
        n, causal=causal, heads=heads, dtype=jnp.float16, chunk=16, batch=2, implementation="cudnn",
        scale=0.3, head_groups=head_groups, transfer_when_alone=split_alone,
    )  # fmt: skip
    jax.effects_barrier()
    assert all(counts.min() >= 1 for counts in fake.key_counts)  # never an entry with no key
    # padded entries: the causal remote part's paired call (rank 0's first chunk has no remote
    # key, rank N-1's second chunk none in the second half)
    assert bool(fake.key_counts) == (causal and n > 1)


def _cudnn_window_check(monkeypatch, n: int, left: int, heads: str, head_groups: int):
    """The layer with implementation='cudnn' through the stand-in primitives and a causal window
    of ``left`` (chunks of 8 tokens; a right side of 3, which is_causal ignores) against the
    dense reference; the stand-in, for what the calls were given."""
    fake = _FakeCudnnPrimitives()
    monkeypatch.setattr(kernels.cudnn, "binds", lambda: (fake, {}))
    monkeypatch.setattr(kernels.cudnn, "max_head_dim", lambda: 256)
    _check(
        n, heads=heads, dtype=jnp.float16, chunk=8, batch=2, implementation="cudnn",
        local_window_size=(left, 3), head_groups=head_groups,
    )  # fmt: skip
    jax.effects_barrier()
    return fake


_WINDOWS_UNDER_A_CHUNK = [(n, left) for n in (1, 2, 4, 8) for left in (0, 1, 5, 7)] + [(1, 12)]


@pytest.mark.parametrize("n,left", _WINDOWS_UNDER_A_CHUNK, ids=lambda x: str(x))
@pytest.mark.parametrize("heads,head_groups", [("gqa_g3", 1), ("mqa", 1), ("mha", 2)], ids=str)
def test_the_cudnn_window_path_with_stand_in_primitives(monkeypatch, n, left, heads, head_groups):
    """A causal window shorter than a chunk (8 tokens here; any at R = 1: 12 of 16) through
    cuDNN's plain calls: the diagonal blocks with the sliding window, the halo's edge rows
    reversed against the keys before each chunk (rank R-1's own), against
    jax.nn.dot_product_attention with the window (its right side ignored, as with is_causal)."""
    fake = _cudnn_window_check(monkeypatch, n, left, heads, head_groups)
    assert left in {w - 1 for w in fake.windows if w is not None}  # the diagonal blocks' window
    assert all(counts.min() >= 1 for counts in fake.key_counts)  # never an entry with no key
    assert bool(fake.key_counts) == (n > 1 and left > 0)  # the halo call (rank 0's first: none)


_WINDOWS_OF_A_CHUNK_OR_MORE = [(n, left) for n in (2, 4, 8) for left in (8, 9, 15, 16, 21)] + [(8, 200)]


@pytest.mark.parametrize("n,left", _WINDOWS_OF_A_CHUNK_OR_MORE, ids=lambda x: str(x))
@pytest.mark.parametrize("heads,head_groups", [("gqa_g3", 1), ("mha", 2)], ids=str)
def test_the_cudnn_wide_window_path_with_stand_in_primitives(monkeypatch, n, left, heads, head_groups):
    """A causal window of a chunk (8 tokens) or more through cuDNN's plain calls: the diagonal
    blocks causal, the left - c keys just before each chunk whole, and the c keys before those
    as a causal call on reversed rows and keys (cut off at the sequence's start by the key
    counts), against jax.nn.dot_product_attention with the window."""
    fake = _cudnn_window_check(monkeypatch, n, left, heads, head_groups)
    assert set(fake.windows) == {None}  # no sliding window: each call's mask is whole
    assert all(counts.min() >= 1 for counts in fake.key_counts)  # never an entry with no key
    spans = {int(k) for counts in fake.key_counts for k in counts.ravel()}
    whole_span = min(left - 8, (2 * n - 1) * 8)  # keys before the last chunk: at most its start
    assert max(spans) == max(8, whole_span)  # the band's c keys, or the whole span's


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("left", [6, 13], ids=["halo", "band"])
def test_the_cudnn_window_path_on_the_peer_transport(monkeypatch, n, left):
    """The same with a workspace: the halo through the peer transport's gather with a reach of 1,
    or a window of a chunk or more through its gather with the window's reach (emulated on XLA's
    collectives, the rows out of reach zeros)."""
    fake = _FakeCudnnPrimitives()
    monkeypatch.setattr(kernels.cudnn, "binds", lambda: (fake, {}))
    monkeypatch.setattr(kernels.cudnn, "max_head_dim", lambda: 256)
    peer_calls_on_xla(monkeypatch)
    _check(
        n, heads="gqa", dtype=jnp.float16, chunk=8, batch=2, implementation="cudnn",
        local_window_size=(left, 0), workspace=workspace_spec(n),
    )  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        dict(local_window_size=3, is_causal=False),
        dict(local_window_size=(2, 0), segment_ids=np.zeros((1, 16), np.int32)),
    ],
    ids=["two_sided", "documents"],
)
def test_cudnn_refuses_a_window_it_cannot_take(monkeypatch, kw):
    monkeypatch.setattr(kernels.cudnn, "binds", lambda: (_FakeCudnnPrimitives(), {}))
    monkeypatch.setattr(kernels.cudnn, "max_head_dim", lambda: 256)
    ids = kw.pop("segment_ids", None)
    spec = jax.sharding.PartitionSpec(None, "cp")

    def body(q, k, v, *ids):
        return cpg.dot_product_attention(
            q, k, v, axis_name="cp", implementation="cudnn", segment_ids=ids[0] if ids else None, **kw
        )

    x = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.bfloat16)
    args = (x, x, x) + (() if ids is None else (jax.ShapeDtypeStruct((1, 32), jnp.int32),))
    expected = (
        "implementation='cudnn' takes no documents (segment_ids), and a local window only with is_causal=True"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        mesh = cp_mesh(2)
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).trace(*args)


def test_workspace_nbytes_helper():
    key = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    assert cpg.attention_workspace_nbytes(key) == 2 * 2 * 1024 * 8 * 128 * 2


# -- bad input: a ValueError before anything runs -----------------------------------------------


def _trace(q_shape, k_shape, v_shape=None, *, n=2, dtype=jnp.float32, **kw):
    mesh = cp_mesh(n)
    spec = jax.sharding.PartitionSpec(None, "cp")
    body = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", **kw)
    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, v_shape or k_shape)]
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).trace(*shapes)


@pytest.mark.parametrize(
    "args, kw, message",
    [
        (((1, 16, 6, 8), (1, 16, 4, 8)), {}, "multiple of the key/value heads"),
        (((1, 18, 4, 8), (1, 18, 2, 8)), {}, "must be even"),  # local length 9 per rank
        (((1, 16, 4, 8), (1, 16, 2, 16)), {}, "head dims differ"),
        (((1, 16, 4, 8), (1, 16, 2, 8), (1, 16, 2, 4)), {}, "same shape"),
        (((1, 16, 4, 8), (1, 8, 2, 8)), {}, "same batch and local length"),
        (((16, 4, 8), (16, 2, 8)), {}, "4 dimensions"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"dtype": jnp.int32}, "float32, bfloat16 and float16"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"implementation": "flash"}, "implementation must be"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"implementation": "cudnn"}, "needs bfloat16 or float16"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"implementation": "cudnn", "dtype": jnp.bfloat16}, "NVIDIA GPU"),
        (((1, 16, 4, 8), (1, 16, 0, 8)), {}, "multiple of the key/value heads"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"scale": jnp.float32(0.5)}, "scale must be"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"workspace": workspace_spec(2, nbytes=1000)}, "needs 1024"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"workspace": workspace_spec(4)}, "created for 4"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"head_groups": 3}, "must divide the key/value heads (2)"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"head_groups": 0}, "head_groups must be a positive int"),
        (((1, 16, 4, 8), (1, 16, 2, 8)), {"head_groups": True}, "head_groups must be a positive int"),
    ],
)
def test_bad_input_is_a_value_error(args, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _trace(*args, **kw)


def test_outside_shard_map_is_a_value_error():
    q = jnp.zeros((1, 16, 4, 8))
    k = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="not bound here"):
        cpg.dot_product_attention(q, k, k, axis_name="cp")


@pytest.mark.parametrize("head_groups", [1, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_under_vmap(causal, head_groups):
    """jax.vmap over a leading axis of q, k and v (e.g. micro-batches) inside shard_map: each slice
    equals the unsharded attention on that slice, values and gradients (with the transfer
    pipelined over head groups too)."""
    n, seq, slices = 4, 64, 3
    stacked = [
        np.stack(xs) for xs in zip(*(ac.random_inputs(seq, seed=20 + i) for i in range(slices)), strict=True)
    ]
    mesh = cp_mesh(n)
    spec = jax.sharding.PartitionSpec(None, None, "cp")
    layer_fn = lambda q, k, v: cpg.dot_product_attention(
        q, k, v, axis_name="cp", is_causal=causal, head_groups=head_groups
    )

    def one(q, k, v, ct):
        out, vjp = jax.vjp(layer_fn, q, k, v)
        return (out, *vjp(ct))

    step = jax.jit(jax.shard_map(jax.vmap(one), mesh=mesh, in_specs=spec, out_specs=spec))
    laid = [cpg.to_cp_layout(x, n, seq_axis=2) for x in stacked]
    got = [np.asarray(cpg.from_cp_layout(g, n, seq_axis=2)) for g in step(*laid)]
    for i in range(slices):
        ref = ac.reference(*(x[i] for x in stacked), causal=causal)
        for name, g in zip(ac.NAMES, got, strict=True):
            np.testing.assert_allclose(g[i], ref[name], atol=2e-5 * np.abs(ref[name]).max(), err_msg=name)
