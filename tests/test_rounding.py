"""The layer's roundings survive XLA's excess precision (``jax_cpgrad/attention/rounding.py``): in
its lowered program no value rounded from float32 to bfloat16 is widened straight back to
float32, the chain XLA's GPU compiler removes. Where such a chain sat, the same inputs gave
different bits on a plain and an overlapped workspace (the overlapped transports' barriers break
the chain, the plain ones do not); the GPU suite checks the bits themselves."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_cpgrad as cpg
from spmd import cp_mesh
from workspace_stub import workspace_spec

P = jax.sharding.PartitionSpec
CONVERT = re.compile(
    r"(%[\w#]+) = stablehlo\.convert (%[\w#]+) : \(tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>"
)


def rounded_then_widened(text: str) -> list[str]:
    """The converts of ``text`` (StableHLO) that widen a bfloat16 value to float32 that a convert
    had just rounded from float32."""
    converts = [m.groups() for m in CONVERT.finditer(text)]
    narrowed = {out for out, _, src, dst in converts if (src, dst) == ("f32", "bf16")}
    widened = [(out, arg) for out, arg, src, dst in converts if (src, dst) == ("bf16", "f32")]
    return [f"{out} = convert {arg}" for out, arg in widened if arg in narrowed]


def _lowered(ws, window, documents: bool, causal: bool = True) -> str:
    def layer(q, k, v, ids):
        return cpg.dot_product_attention(
            q, k, v, axis_name="cp", workspace=ws, is_causal=causal, local_window_size=window,
            segment_ids=ids if documents else None, implementation="xla",
        )  # fmt: skip

    def body(q, k, v, ids):
        out, vjp = jax.vjp(lambda q, k, v: layer(q, k, v, ids), q, k, v)
        return out, vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(4), in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    return step.trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()


def test_the_finder_sees_a_rounding_widened_back():
    text = jax.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) * 2).lower(jnp.ones(4)).as_text()
    assert len(rounded_then_widened(text)) == 1
    kept = jax.jit(lambda x: cpg.attention.rounding.rounded(x, jnp.bfloat16).astype(jnp.float32))
    assert rounded_then_widened(kept.lower(jnp.ones(4)).as_text()) == []


WORKSPACES = {
    "xla": None,
    "plain": workspace_spec(4, protocol="memop"),
    "overlapped": workspace_spec(4, protocol="device", overlap=True),
}


@pytest.mark.parametrize("transport", list(WORKSPACES))
@pytest.mark.parametrize(
    "window, documents, causal",
    [
        (None, False, True),
        (None, False, False),
        ((3, 0), False, True),
        ((3, 2), False, False),
        ((20, 0), True, True),
    ],
    ids=["causal", "full", "halo", "two_sided_halo", "documents_window"],
)
def test_no_rounding_of_the_layer_is_widened_back(transport, window, documents, causal):
    text = _lowered(WORKSPACES[transport], window, documents, causal)
    assert rounded_then_widened(text) == []


@pytest.mark.parametrize("continued", [False, True], ids=["merged", "continued"])
@pytest.mark.parametrize("edges", [(), ((0, 2), (4, 6))], ids=["all_rows", "edge_rows"])
def test_the_merged_rows_come_out_firm(edges, continued):
    """The remote part's merge into the local part's rows (``schedule._merge_remote``) rounds with
    ``rounded_into`` (no barrier of its own, so that XLA can fuse it into an in-place write): its
    results must leave through an optimization barrier, for a call of all rows as for one of
    edge rows, or a later widening could undo the rounding; so must a remote call's rows that
    continued the local part's (written in place of them)."""
    from jax_cpgrad.attention import plan, schedule

    call = plan.Call("edges" if edges else "all", "others", edges=edges)
    rows = 4 if edges else 8
    local = (jnp.ones((1, 8, 2, 4), jnp.bfloat16), jnp.zeros((1, 2, 8), jnp.float32))
    parts = [(jnp.ones((1, rows, 2, 4), jnp.bfloat16), jnp.zeros((1, 2, rows), jnp.float32))]
    merged = lambda own, other: schedule._merge_remote(plan.RankPlan, call, own, other, continued=continued)
    jaxpr = jax.make_jaxpr(merged)(local, parts).jaxpr
    barrier = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"][-1]
    assert all(v in barrier.outvars for v in jaxpr.outvars)
