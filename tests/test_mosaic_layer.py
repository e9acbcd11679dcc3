"""The layer with ``implementation="mosaic"`` inside ``jax.shard_map``, without a GPU.

The Mosaic GPU kernels (``jax_cpgrad/attention/mosaic_gpu``) run inside ``shard_map``, where
their operands vary over the CP axis (see ``forward.read_scalar`` and ``forward.varying_like``
for what that asks of a ``plgpu.kernel``). The layer refuses "mosaic" off Hopper, so these
tests replace the mosaic entry of ``kernels.KERNELS`` with one that refuses nothing.

- **lowering** (``jax.export`` for ``cuda``, the whole Mosaic GPU lowering on the CPU; needs
  ``jax-cuda13-plugin``): ``jax.grad`` of the layer under ``shard_map`` on R = 2 and 4 CPU
  devices, for plain causal, full, a window and documents, bf16, head dim 64; the module must
  hold the forward, dQ and dK/dV kernels;
- **interpret** (``plgpu.force_gpu_interpret_mode``, the kernels' interpret form): the layer's
  output and q/k/v gradients under ``shard_map`` against the dense-mask unsharded
  ``jax.nn.dot_product_attention`` in float32, within twice that reference's own error in
  bf16. On ONE device only (R = 1, plain causal through the transfer's path to itself, and a
  window over documents): jax's GPU interpreter (0.11.2 and 0.12) keeps one memory for all
  simulated devices and, at the end of every kernel, asserts that no barrier is allocated in
  any of them, while the devices' kernels run concurrently (its clean-up waits for all of
  them): at R >= 2 that assertion fails on the other devices' live barriers. Tiny: S = 256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_cpgrad
from jax_cpgrad.attention import kernels, layer as layer_lib, mosaic_gpu, tile_plan

mb = importlib.import_module("jax_cpgrad.attention.mosaic_gpu.backward")

F32, BF16 = jnp.float32, jnp.bfloat16
H = 64
HAS_INTERPRET = hasattr(plgpu, "force_gpu_interpret_mode") and hasattr(plgpu, "InterpretGPUParams")
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_cuda13_plugin") is not None
needs_cuda_lowering = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN and os.environ.get("JAX_CPGRAD_REQUIRE_LOWERING") != "1",
    reason="no jax-cuda13-plugin: Pallas has no Mosaic GPU lowering without it",
)
needs_interpret = pytest.mark.skipif(
    not HAS_INTERPRET, reason=f"jax {jax.__version__}: no GPU interpret mode (plgpu.force_gpu_interpret_mode)"
)

# name -> the layer's mask arguments (documents: segment ids given per test)
MASKS = {
    "causal": dict(is_causal=True),
    "full": dict(is_causal=False),
    "window": dict(is_causal=True, local_window_size=(40, 0)),
    "documents": dict(is_causal=True, documents=True),
}


def _mosaic_anywhere(monkeypatch, **entries):
    """kernels.KERNELS with a mosaic entry that refuses nothing (and ``entries`` replaced)."""
    replaced = tuple(
        dataclasses.replace(k, refuses=lambda dtype, head_dim: None, **entries) if k.name == "mosaic" else k
        for k in kernels.KERNELS
    )
    monkeypatch.setattr(kernels, "KERNELS", replaced)


def _grad_fn(mesh, mask: dict, *, transfer_when_alone=False, wrap=lambda layer: layer):
    """shard_map of (out, (dq, dk, dv)) of sum(out * d_out) for the layer (``wrap(layer)``, e.g.
    checkpointed), over axis "cp"."""
    mask = dict(mask)
    documents = mask.pop("documents", False)
    layer = wrap(
        lambda q, k, v, ids: layer_lib.attention(
            q, k, v, axis_name="cp", implementation="mosaic", segment_ids=ids if documents else None,
            transfer_when_alone=transfer_when_alone, **mask,
        )
    )  # fmt: skip

    def loss(q, k, v, d_out, ids):
        out = layer(q, k, v, ids)
        return jax.lax.psum(jnp.sum(out.astype(F32) * d_out), "cp"), out

    def f(q, k, v, d_out, ids):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, d_out, ids)
        return out, grads

    spec = P(None, "cp")
    return jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec, (spec, spec, spec)))


def _kernels_in(text: str) -> dict[str, int]:
    """Mosaic GPU custom calls of an exported module by kernel, from their operand count and
    result types: the forward (4 operands: q, k, v and the packed plan, or 6 with the out and
    lse it continues; out and the float32 lse), dQ (7 operands, 8 with the dQ it adds; dQ and
    the float32 delta it computes for dK/dV) and dK/dV (7 operands; two 16-bit results)."""
    found = {"forward": 0, "dq": 0, "dkv": 0, "other": 0}
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\).*-> (.*)", line)
        if not m:
            continue
        operands, results = m.group(1).count("%"), re.findall(r"tensor<[^>]*>", m.group(2))
        form = (operands, len(results), results[-1].endswith("xf32>"))
        kinds = {(4, 2, True): "forward", (6, 2, True): "forward", (7, 2, True): "dq", (8, 2, True): "dq"}
        kinds[(7, 2, False)] = "dkv"
        kind = kinds.get(form, "other")
        found[kind] += 1
    return found


def _exported_grad(monkeypatch, R: int, mask: str):
    """The layer's fwd + bwd with ``mask`` at R ranks (B = 1, S = 128 R, N = 2, K = 1) exported
    for CUDA, our kernels taken on any machine."""
    _mosaic_anywhere(monkeypatch)
    mesh = Mesh(np.array(jax.devices()[:R]), ("cp",))
    B, S, N, K = 1, 128 * R, 2, 1
    sh = NamedSharding(mesh, P(None, "cp"))
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    args = (
        arg((B, S, N, H), BF16), arg((B, S, K, H), BF16), arg((B, S, K, H), BF16),
        arg((B, S, N, H), F32), arg((B, S), jnp.int32),
    )  # fmt: skip
    return jax.export.export(jax.jit(_grad_fn(mesh, MASKS[mask])), platforms=["cuda"])(*args)


@needs_cuda_lowering
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("R", [2, 4])
def test_layer_grad_lowers_for_cuda(monkeypatch, R, mask):
    exported = _exported_grad(monkeypatch, R, mask)
    B, S, N, K = 1, 128 * R, 2, 1  # _exported_grad's
    text = exported.mlir_module()
    found = _kernels_in(text)
    assert found["forward"] >= 1 and found["dq"] >= 1 and found["dkv"] >= 1, found
    # no XLA loop around the kernels: on a GPU each of its steps costs launches and a readback
    # (the masks' searches were loops, and took more time than the kernels at R = 8)
    assert "stablehlo.while" not in text
    assert found["other"] == 0, found
    assert found["dq"] == found["dkv"], found  # every backward call launches both
    out, dq, dk, dv = exported.out_avals
    assert [x.shape for x in (out, dq, dk, dv)] == [(B, S, N, H)] * 2 + [(B, S, K, H)] * 2


def _plan_operand_sources(text: str) -> list[str]:
    """For each Mosaic GPU custom call of an exported module, what makes its last operand (the
    packed plan), looked through reshapes: the op's name, or the called function's."""
    sources = []
    for body in re.split(r"\n\s*func\.func ", text):  # SSA names are per function
        defs = {}
        for line in body.splitlines():
            if m := re.match(r"\s*(%[\w]+)(?::\d+)?\s*=\s*(\S+)\s*(@\w+)?(.*)", line):
                defs[m.group(1)] = (m.group(2), m.group(3), m.group(4))
        for line in body.splitlines():
            if not (m := re.search(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", line)):
                continue
            name = m.group(1).split(",")[-1].strip()
            while name in defs and defs[name][0] == "stablehlo.reshape":
                name = re.findall(r"%\w+", defs[name][2])[0]
            op, callee, _ = defs.get(name, ("an argument", None, ""))
            sources.append(callee or op)
    return sources


@needs_cuda_lowering
@pytest.mark.parametrize("mask", ["causal", "window", "documents"])
def test_each_kernels_plan_is_the_looked_up_row_itself(monkeypatch, mask):
    """Without documents a rank's plans are looked up in a table by its index (per_rank.py), and
    each kernel's packed plan must be the looked-up row itself: XLA copies out (a launch each)
    every static slice of it that a kernel would take. Documents' plans are computed in the
    program (the control: the same check tells them apart)."""
    exported = _exported_grad(monkeypatch, 2, mask)
    sources = _plan_operand_sources(exported.mlir_module())
    assert len(sources) >= 3, sources
    looked_up = [s.startswith(("@dynamic_index_in_dim", "stablehlo.dynamic_slice")) for s in sources]
    if mask == "documents":
        assert not any(looked_up), sources
    else:
        assert all(looked_up), sources


# -- interpret mode (values, one device) ---------------------------------------------------------


def _dense_mask(S: int, mask: dict, ids):
    """bool [B, 1, S, S] of what query p sees (natural order; R = 1: CP layout is natural)."""
    p, s = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    seen = jnp.ones((S, S), bool)
    if mask.get("is_causal", True):
        seen &= s <= p
    if (w := mask.get("local_window_size")) is not None:
        seen &= (s >= p - w[0]) & (s <= p + w[1])
    seen = seen[None]
    if mask.get("documents"):
        seen = seen & (ids[:, :, None] == ids[:, None, :])
    return seen[:, None]


def _reference(q, k, v, d_out, seen):
    """(out, (dq, dk, dv)) of jax.nn.dot_product_attention with the dense mask, in q's dtype."""

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, mask=seen, implementation="xla")
        return jnp.sum(out.astype(F32) * d_out), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


INTERPRET_CASES = {
    # R = 1 through the transfer's path (two parts, K/V from and dK/dV to the rank itself).
    "causal_two_parts": (dict(is_causal=True), True),
    "window_documents": (dict(is_causal=True, local_window_size=(40, 0), documents=True), False),
}


@needs_interpret
@pytest.mark.parametrize("name", list(INTERPRET_CASES))
def test_interpret_layer_matches_reference_on_one_device(monkeypatch, name):
    """INTERPRET MODE, R = 1 (see the module docstring): values and q/k/v gradients."""
    mask, transfer = INTERPRET_CASES[name]
    forward_config = mosaic_gpu.default_config(H, interpret=True)
    _mosaic_anywhere(
        monkeypatch,
        masked_forward=functools.partial(mosaic_gpu.forward, config=forward_config),
        masked_backward=functools.partial(mb.backward, config=mb.default_config(H, interpret=True)),
    )
    B, S, N, K = 1, 256, 2, 1
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (B, S, N, H), F32).astype(BF16)
    k = jax.random.normal(keys[1], (B, S, K, H), F32).astype(BF16)
    v = jax.random.normal(keys[2], (B, S, K, H), F32).astype(BF16)
    d_out = jax.random.normal(keys[3], (B, S, N, H), F32)
    ids = jnp.asarray(np.repeat(np.arange(3), (70, 120, 66))[None], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out, grads = jax.jit(_grad_fn(mesh, mask, transfer_when_alone=transfer))(q, k, v, d_out, ids)
        got = [np.asarray(x.astype(F32)) for x in (out, *grads)]
    seen = _dense_mask(S, mask, ids)
    exact = _reference(*(x.astype(F32) for x in (q, k, v)), d_out, seen)
    low = _reference(q, k, v, d_out, seen)
    exact, low = ([np.asarray(x.astype(F32)) for x in jax.tree.leaves(r)] for r in (exact, low))
    for what, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low, strict=True):
        assert np.isfinite(g).all(), what
        budget = 2 * np.abs(lo - e).max()
        err = np.abs(g - e).max()
        assert err <= budget, f"{name} {what}: max |layer - ref| {err:.3g} > 2 x {budget / 2:.3g}"


def _documents_grad_inputs(R: int, kv_heads: int = 1):
    """A mesh of R CPU devices and ``_grad_fn``'s (q, k, v, d_out, ids) for documents of 100
    tokens over 128 x R (two query heads), zeros (what tracing them needs)."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("cp",))
    B, S, N, K = 1, 128 * R, 2, kv_heads
    args = (
        jnp.zeros((B, S, N, H), BF16), jnp.zeros((B, S, K, H), BF16), jnp.zeros((B, S, K, H), BF16),
        jnp.zeros((B, S, N, H), F32), jnp.asarray(np.arange(S) // 100, jnp.int32)[None],
    )  # fmt: skip
    return mesh, args


# documents alone, and with each kind of window (c = 64 tokens a chunk at R = 4): its halo (left
# < c), a wider one (the chunks it reaches), two-sided without causal; and the transfer pipelined
# over two head groups (two KV heads: each group's call gets one)
DOCUMENT_MASKS = {
    "documents": MASKS["documents"],
    "halo": dict(is_causal=True, local_window_size=(40, 0), documents=True),
    "wide_window": dict(is_causal=True, local_window_size=(100, 0), documents=True),
    "two_sided": dict(is_causal=False, local_window_size=(20, 30), documents=True),
    "head_groups": dict(is_causal=True, documents=True, head_groups=2),
}


@pytest.mark.parametrize("mask", DOCUMENT_MASKS)
@pytest.mark.parametrize("R", [1, 4])
def test_the_layer_makes_its_tile_plans_before_its_custom_vjp(monkeypatch, R, mask):
    """With documents (masks computed in the program) the layer makes the kernels' tile plans with
    its masks, before its custom VJP (``kernels.prime_masked``), where a checkpoint policy can keep
    them (with jax's ``jax_remat3`` flag too), and the VJP's forward and backward, given them, make
    none: under a ``lax.scan`` over layers the backward would make them in every step. Made for the
    operands the calls get, or a kernel would make its own in the VJP."""
    _mosaic_anywhere(monkeypatch)
    made = []
    tile_ranges = tile_plan.tile_ranges

    def counted(*args, **kw):
        frames = {frame.name for frame in traceback.extract_stack()}
        made.append(next((f for f in ("_attention_fwd", "_attention_bwd") if f in frames), "before the VJP"))
        return tile_ranges(*args, **kw)

    monkeypatch.setattr(tile_plan, "tile_ranges", counted)
    mesh, args = _documents_grad_inputs(R, kv_heads=DOCUMENT_MASKS[mask].get("head_groups", 1))
    jax.make_jaxpr(_grad_fn(mesh, DOCUMENT_MASKS[mask]))(*args)
    calls = 1 if R == 1 else 2  # the local call, and the remote one
    assert made == ["before the VJP"] * 3 * calls, made  # each call: its forward's plan, dQ's, dK/dV's


def _primitives(jaxpr, name: str) -> int:
    """How many equations of primitive ``name`` a jaxpr holds, its inner jaxprs' included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    count += _primitives(sub, name)
    return count


@contextlib.contextmanager
def _remat3(on: bool):
    """jax's ``jax_remat3`` flag set to ``on`` inside (a skip where this jax has no such flag)."""
    before = getattr(jax.config, "jax_remat3", None)
    if before is None:
        pytest.skip("this jax has no jax_remat3 flag")
    jax.config.update("jax_remat3", on)
    try:
        yield
    finally:
        jax.config.update("jax_remat3", before)


@pytest.mark.parametrize("remat3", [False, True], ids=["remat", "remat3"])
@pytest.mark.parametrize("R", [1, 4])
def test_a_checkpointed_layer_keeps_its_masks_with_the_policy(monkeypatch, R, remat3):
    """Under ``jax.checkpoint`` the backward computes the layer's forward again, its masks and tile
    plans with it (documents: each plan a sort); with ``masks_checkpoint_policy`` it takes them
    from the forward, and the program sorts as often as without the checkpoint. The checkpoint
    without the policy is the control: it sorts more. With jax's ``jax_remat3`` flag too, which
    saves no name made inside a custom VJP's forward: the layer makes its masks before its own."""
    _mosaic_anywhere(monkeypatch)
    mesh, args = _documents_grad_inputs(R)
    wraps = {
        "plain": lambda layer: layer,
        "checkpoint": jax.checkpoint,
        "policy": functools.partial(jax.checkpoint, policy=jax_cpgrad.masks_checkpoint_policy()),
    }
    grad_jaxpr = lambda wrap: jax.make_jaxpr(_grad_fn(mesh, MASKS["documents"], wrap=wrap))(*args).jaxpr
    with _remat3(remat3):
        sorts = {name: _primitives(grad_jaxpr(wrap), "sort") for name, wrap in wraps.items()}
    assert sorts["plain"] > 0, sorts
    assert sorts["checkpoint"] > sorts["plain"], sorts
    assert sorts["policy"] == sorts["plain"], sorts
