"""Masks of the rank's index alone, looked up rather than computed (``jax_cpgrad/attention/per_rank.py``).

- a rank's calls (``plan.RankPlan.calls``) and a kernel's tile plan of their masks
  (``Visibility.derive``) looked up by a traced rank equal, for every rank, those computed for it;
- the lowered program of a static mask holds no search, sort or reduction, while documents' does
  (the negative control);
- a value that reads a traced one, or too large a table, is computed in the program as before;
- the layer's output and gradients, and the Pallas kernels' in interpret mode, are the same bits
  with the tables as without them;
- two layers in one program read one layer's constants (jax 0.12.1 passes each constant array to
  XLA as a parameter of its own), and the backward takes the forward's masks.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import attention_check as ac
import jax_cpgrad as cpg
from jax_cpgrad.attention import masks, mosaic_gpu, per_rank, plan, tile_plan
from spmd import cp_mesh

# the module (the package's name `backward` is its function)
mosaic_backward = importlib.import_module("jax_cpgrad.attention.mosaic_gpu.backward")

HAS_INTERPRET = hasattr(plgpu, "force_gpu_interpret_mode") and hasattr(plgpu, "InterpretGPUParams")

C = 64  # chunk length
# name -> a RankPlan's arguments (R added per test)
PLANS = {
    "halo_causal": dict(causal=True, window=(20, 0)),
    "halo_two_sided": dict(causal=False, window=(13, 40)),
    "wide_window_chunks": dict(causal=True, window=(100, 0), moves_window_chunks=True),
    "wide_window_gathered": dict(causal=True, window=(100, 0)),
    "plain_causal_as_masked": dict(causal=True, plain_as_masked=True),
    "full_as_masked": dict(causal=False, plain_as_masked=True),
    "plain_window": dict(causal=True, window=(20, 0), plain_windows=True),  # kv_len arrays
    "plain_causal": dict(causal=True),  # the paired call's kv_len
}


def _queries(batch: int = 2):
    return jax.ShapeDtypeStruct((batch, 2 * C, 4, 64), jnp.bfloat16)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _visibilities(calls):
    return [call.vis for call in calls.local + calls.remote if call.vis is not None]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", PLANS)
def test_looked_up_calls_are_each_ranks_own(name, ranks):
    rank_plan = plan.RankPlan(num_ranks=ranks, **PLANS[name])
    q = _queries()
    looked_up = jax.jit(lambda rank: rank_plan.calls(q, rank))
    for r in range(ranks):
        got, want = looked_up(jnp.int32(r)), rank_plan._calls(q, r)
        assert all(vis.by_rank is not None for vis in _visibilities(got))  # for the kernels' plans
        assert jax.tree.structure(_intervals(got)) == jax.tree.structure(want)
        for a, b in zip(_leaves(_intervals(got)), _leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def _intervals(calls):
    """``calls`` with each Visibility its intervals alone (no rank, no table)."""
    is_vis = lambda x: isinstance(x, masks.Visibility)
    bare = lambda x: masks.Visibility(x.row_lo, x.row_hi, x.col_lo, x.col_hi) if is_vis(x) else x
    return jax.tree.map(bare, calls, is_leaf=is_vis)


@pytest.mark.parametrize("name", ["halo_causal", "plain_causal_as_masked", "halo_two_sided"])
def test_a_kernels_plan_is_looked_up_for_every_rank(name):
    ranks = 4
    rank_plan = plan.RankPlan(num_ranks=ranks, **PLANS[name])
    q = _queries()

    def tile_plans(vis):
        q_len, k_len = vis.q_len, vis.k_len
        rows = tile_plan.tile_ranges(vis.row_lo, vis.row_hi, outer_block=32, inner_block=16, inner_len=k_len)
        cols = tile_plan.tile_ranges(vis.col_lo, vis.col_hi, outer_block=16, inner_block=32, inner_len=q_len)
        return rows, cols

    def looked_up(rank):
        return [vis.derive(tile_plans, "test") for vis in _visibilities(rank_plan.calls(q, rank))]

    looked_up = jax.jit(looked_up)
    for r in range(ranks):
        want = [tile_plans(vis) for vis in _visibilities(rank_plan._calls(q, r))]
        got = looked_up(jnp.int32(r))
        for a, b in zip(_leaves(got), _leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def _ops(documents: bool) -> set[str]:
    """The StableHLO ops of a rank's masks and their tile plans, for a traced rank."""
    rank_plan = plan.RankPlan(num_ranks=4, causal=True, window=(20, 0), documents=documents)
    q = _queries()
    ids = jnp.asarray(np.arange(8 * C)[None].repeat(2, 0) // 50, jnp.int32)

    def masks_and_plans(rank, ids):
        words = plan.id_words(ids) if documents else None
        tile_plans = lambda vis: tile_plan.tile_ranges(
            vis.row_lo, vis.row_hi, outer_block=32, inner_block=16, inner_len=vis.k_len
        )
        return [vis.derive(tile_plans, "test") for vis in _visibilities(rank_plan.calls(q, rank, words))]

    text = jax.jit(masks_and_plans).lower(jnp.int32(1), ids).as_text()
    return set(re.findall(r"stablehlo\.(\w+)", text))


def test_a_static_mask_leaves_no_mask_work_in_the_program():
    static, documents = _ops(documents=False), _ops(documents=True)
    work = {"sort", "reduce", "while", "minimum", "maximum", "clamp"}
    assert "dynamic_slice" in static
    assert not static & work, static & work
    assert {"sort", "reduce"} <= documents  # the control: the same masks from ids are computed


def test_values_that_read_a_traced_one_or_do_not_fit_are_computed():
    x = jnp.arange(3, dtype=jnp.int32)

    @jax.jit
    def traced(rank, y):
        return per_rank.tabulate(lambda r: y * r, rank, 4)

    value, table = traced(jnp.int32(2), x)
    assert table is None
    np.testing.assert_array_equal(value, 2 * np.arange(3))

    @jax.jit
    def large(rank):
        return per_rank.tabulate(lambda r: jnp.full((per_rank.MAX_ELEMENTS // 4 + 1,), r), rank, 4)

    value, table = large(jnp.int32(3))
    assert table is None
    assert int(value[0]) == 3


def test_every_looked_up_leaf_starts_256_byte_aligned():
    """XLA may hand a kernel a slice of the table in place, and a Mosaic GPU kernel refuses an
    input that is not 256-byte aligned (it failed so on a GPU): every leaf's slice of the row, and
    every row, starts at a multiple of 256 bytes, for leaves of odd sizes and two dtypes."""

    def fn(r):
        return {
            "a": jnp.arange(3, dtype=jnp.int32) + r,
            "b": jnp.full((5, 7), r, jnp.int32),
            "c": jnp.arange(9, dtype=jnp.int16) * r,
            "d": jnp.full((70,), -r, jnp.int32),
        }

    jaxpr = jax.make_jaxpr(lambda rank: per_rank.tabulate(fn, rank, 4)[0])(jnp.int32(1))
    (rows_int16, rows_int32) = sorted((c for c in jaxpr.consts if np.ndim(c) == 2), key=lambda c: c.itemsize)
    assert rows_int16.shape[1] * 2 % 256 == 0 and rows_int32.shape[1] * 4 % 256 == 0
    slices = [e for e in jaxpr.eqns if e.primitive.name == "slice"]
    starts = {e.params["start_indices"][0] * e.invars[0].aval.dtype.itemsize for e in slices}
    assert len(slices) == 4 and all(b % 256 == 0 for b in starts), starts
    looked_up = jax.jit(lambda rank: per_rank.tabulate(fn, rank, 4)[0])(jnp.int32(3))
    for name, value in fn(3).items():
        np.testing.assert_array_equal(looked_up[name], value)


def test_a_python_int_rank_gives_constants():
    value, table = per_rank.tabulate(lambda r: jnp.arange(3) + r, 2, 4)
    assert table is not None and table.num_ranks == 4
    np.testing.assert_array_equal(value, np.arange(3) + 2)


def test_tables_are_computed_once_a_key():
    """A backward after its forward, or a model's layers of one configuration, reuse the tables
    of an equal key; another key, or none, computes them again."""
    runs = []

    def fn(r):
        runs.append(r)
        return jnp.arange(3) + r

    first = per_rank.tabulate(fn, jnp.int32(1), 4, key=("test", "once"))[1]
    again = jax.jit(lambda rank: per_rank.tabulate(fn, rank, 4, key=("test", "once"))[0])(jnp.int32(3))
    assert runs == [0, 1, 2, 3]
    np.testing.assert_array_equal(again, np.arange(3) + 3)
    other = per_rank.tabulate(fn, 0, 4, key=("test", "another"))[1]
    per_rank.tabulate(fn, 0, 4)
    assert len(runs) == 12
    assert first is not None and other is not None and first is not other


def test_lookups_of_one_table_read_one_constant():
    """Two lookups of a table (a model's layers of one configuration) read one constant array:
    jax 0.12.1 hands each array to XLA as a parameter of its own, and XLA shares the lookups of two
    layers only where they read the same one."""
    fn = lambda r: {"lo": jnp.arange(8, dtype=jnp.int32) + r, "hi": jnp.full(64, r, jnp.int32)}

    def two_layers(rank):
        return [per_rank.tabulate(fn, rank, 4, key=("test", "one constant"))[0] for _ in range(2)]

    closed = jax.make_jaxpr(two_layers)(jnp.int32(1))
    assert len(closed.consts) == 1, [np.shape(c) for c in closed.consts]


@pytest.mark.parametrize("window", [(5, 0), (40, 0), (3, 7)], ids=["halo", "window_chunks", "two_sided_halo"])
def test_two_layers_in_one_program_read_one_layers_constants(window):
    """The layer twice in one program under ``shard_map`` (windows: the masks looked up from
    tables, the halo's or the window chunks' rows placed by rank tables) holds the constants of
    one layer alone: the second layer's lookups are the first's, which XLA then computes once."""
    ranks, seq = 4, 2 * 4 * 16
    q, k, v, _ = (jnp.asarray(x) for x in ac.random_inputs(seq, heads=4, kv_heads=2, seed=7))
    spec = jax.sharding.PartitionSpec(None, "cp")

    def constants(layers: int) -> int:
        def body(q, k, v):
            attend = lambda q, k, v: cpg.dot_product_attention(
                q, k, v, axis_name="cp", is_causal=window[1] == 0, local_window_size=window
            )
            out, grads = q, None
            for _ in range(layers):
                out, vjp = jax.vjp(attend, out, k, v)
                grads = vjp(out)
            return out, grads

        f = jax.shard_map(body, mesh=cp_mesh(ranks), in_specs=spec, out_specs=spec)
        return len(jax.make_jaxpr(f)(q, k, v).consts)

    one = constants(1)
    assert one >= 1 and constants(2) == one


def test_a_second_layer_of_one_configuration_computes_no_table(monkeypatch):
    computed = []
    every_rank = per_rank._every_rank
    monkeypatch.setattr(per_rank, "_CACHE", {})
    monkeypatch.setattr(per_rank, "_every_rank", lambda fn, n: computed.append(n) or every_rank(fn, n))
    inputs = ac.random_inputs(2 * 4 * 8, heads=4, kv_heads=2, seed=5)
    layer = lambda: ac.cp_layer(
        cp_mesh(4), inputs, dtype=jnp.float32, causal=True, local_window_size=(5, 0), implementation="xla"
    )
    layer()
    misses = len(computed)
    layer()
    assert misses >= 1 and len(computed) == misses  # the second layer computed none


@pytest.mark.parametrize(
    "window,causal", [((5, 0), True), ((3, 11), False), ((20, 0), True), (None, True)], ids=str
)
def test_the_layer_gives_the_same_bits_with_and_without_tables(monkeypatch, window, causal):
    ranks, chunk = 4, 8
    inputs = ac.random_inputs(2 * ranks * chunk, heads=4, kv_heads=2, seed=5)
    mesh = cp_mesh(ranks)
    run = lambda: ac.cp_layer(
        mesh, inputs, dtype=jnp.float32, causal=causal, local_window_size=window, implementation="xla"
    )
    with_tables = run()
    monkeypatch.setattr(per_rank, "MAX_ELEMENTS", 0)
    monkeypatch.setattr(per_rank, "_CACHE", {})  # else the first run's tables are reused
    without = run()
    for name in ac.NAMES:
        for r in range(ranks):
            assert with_tables[name][r].tobytes() == without[name][r].tobytes(), (name, r)


@pytest.mark.skipif(not HAS_INTERPRET, reason=f"jax {jax.__version__}: no Pallas GPU interpret mode")
@pytest.mark.parametrize("name", ["halo_causal", "plain_causal_as_masked"])
def test_the_pallas_kernels_give_the_same_bits_with_and_without_tables(name):
    """Each rank's masked calls, forward and backward in interpret mode, with the calls looked up
    by a traced rank (and the kernels' plans with them) against the same calls computed."""
    ranks = 2
    rank_plan = plan.RankPlan(num_ranks=ranks, **PLANS[name])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2 * C, 2, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, 2 * C, 1, 64)), jnp.bfloat16)
    fwd_config = mosaic_gpu.default_config(64, interpret=True)
    bwd_config = mosaic_backward.default_config(64, interpret=True)

    def own_call(rank, q, kv, looked_up: bool):
        calls = rank_plan.calls(q, rank) if looked_up else rank_plan._calls(q, rank)
        vis = calls.local[0].vis
        out, lse = mosaic_gpu.forward(q, kv, kv, vis, scale=0.125, config=fwd_config)
        grads = mosaic_gpu.backward(q, kv, kv, out, lse, out, vis, scale=0.125, config=bwd_config)
        return out, lse, grads

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        for r in range(ranks):
            got = jax.jit(lambda rank: own_call(rank, q, kv, True))(jnp.int32(r))
            want = jax.jit(lambda rank: own_call(rank, q, kv, False))(jnp.int32(r))
            for a, b in zip(_leaves(got), _leaves(want), strict=True):
                assert a.tobytes() == b.tobytes()


def test_the_backward_takes_the_forwards_masks(monkeypatch):
    """The layer's backward takes the forward's calls (their masks) as residuals: the plan makes
    them once for a forward and backward of documents (whose masks are computed in the program),
    so that a lax.scan over layers keeps them outside its loop, as it does the forward's."""
    made = []
    calls = plan.RankPlan.calls
    monkeypatch.setattr(plan.RankPlan, "calls", lambda self, *a: made.append(1) or calls(self, *a))
    ranks, seq = 4, 2 * 4 * 16
    q, k, v, _ = (jnp.asarray(x) for x in ac.random_inputs(seq, heads=4, kv_heads=2, seed=9))
    ids = jnp.asarray(ac.documents("crossing", seq, 1, chunk=16, seed=1))
    spec = jax.sharding.PartitionSpec(None, "cp")

    def body(q, k, v, ids):
        attend = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", segment_ids=ids)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    jax.make_jaxpr(jax.shard_map(body, mesh=cp_mesh(ranks), in_specs=spec, out_specs=spec))(q, k, v, ids)
    assert len(made) == 1, len(made)
