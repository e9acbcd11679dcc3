"""The attention forward as one Pallas Mosaic GPU kernel for Hopper (sm_90), FlashAttention-3 style.

``forward(q, k, v, vis, *, scale, config=None) -> (out, lse)``: q ``[B, T, N, H]`` (or more rows:
below), k and v
``[B, L, K, H]`` (K divides N; query head n reads key head ``n // (N // K)``), ``vis`` a
:class:`~jax_cpgrad.attention.masks.Visibility`. ``out [B, T, N, H]`` in q's dtype, ``lse
[B, N, T]`` float32 in natural log; a row that sees no key gets out 0 and lse -inf.

**One launch** covers every query tile of every (batch, head) pair: grid ``(N, B, tiles)``,
heads fastest (the query heads of one KV head run side by side and share its K/V in L2), query
tiles slowest and taken in the plan's ``order`` (heaviest first), so the long tiles start first
and the short ones fill the tail.

**The plan.** The query rows are cut in tiles of ``consumers * block_q`` rows (one per thread
block) and the keys in tiles of ``block_k``. ``tile_plan.tile_ranges`` gives each query tile the
key tiles ``[lo, hi)`` it visits; tiles outside are never loaded. Tiles in ``[full_lo,
full_hi)`` are visible to every row of the query tile and run without an element mask; the
others (at most a few at each end: the diagonal of a causal mask, the edges of a window or a
document) apply ``row_lo <= key < row_hi`` per row, read from the Visibility. The intervals and
the plan reach the kernel as one int32 operand (``packed_plan.py``); its scalars are read by every
thread straight from global memory (a handful of loads per thread block).

**Warp specialisation** (``consumers + 1`` warpgroups of 128 threads):

- the **producer** warpgroup (registers lowered to 40) issues the TMA loads of K and V tiles
  ``lo .. hi-1`` into a ring of ``num_stages`` shared-memory slots; before reusing a slot it
  waits for both consumers to have released it (one barrier per slot and per operand, so a
  slot's K can be refilled while its V is still being read);
- each **consumer** warpgroup (registers raised to 232, 240 alone) owns ``block_q`` query rows:
  Q is loaded once by TMA, then per key tile ``S = Q K^T`` (wgmma, float32 accumulator), the
  online softmax in float32 registers (base 2, the scale folded into one multiply-add:
  ``exp2(s * scale * log2 e - m)``), and ``O += P V`` (wgmma, P in 16 bits). K is released
  right after the first matmul and V after the second, so the producer refills early.
- With two consumers, **ping-pong** (FA3): a barrier of two arrivals makes the consumers take
  turns, one issuing its matmuls while the other runs its softmax (an H100 has about 250x more
  matmul than exponential throughput, 989 vs 3.9 TFLOPS in the FA3 paper, so the exp2 of the
  softmax would otherwise leave the tensor cores idle). The second consumer starts half a
  step behind and the first finishes half a step after, so both do the same number of barrier
  rounds: both visit the same key tiles (the thread block's range), which is why the range is
  planned per thread block, not per warpgroup.

**Tiles and depth** (``config.default_config``): ``block_q = 64`` rows per consumer (the wgmma
M), 128 rows per thread block; ``block_k = 128`` (64 for head dim 256). ``num_stages = 2`` for
head dim 128: K+V of one stage are 64 KiB, so two stages plus Q (32 KiB) use 160 KiB of the 227
KiB, and a third stage does not fit; at head dim 64 a stage is 32 KiB and four fit. With two
stages the next tile's TMA load is in flight while the consumers work on the current one, which
is what FA3 runs at head dim 128; whether a deeper ring pays at head dim 64 is for the GPU to
say (``num_stages`` is a config field). Each K/V tile serves the thread block's 128 query rows:
128 matmul flops per byte loaded. FA3 uses the same tiles for head dims 64 and 128.

**P in registers or through shared memory** (``Config.p_via_smem``): on the GPU, P stays in
registers and the PV wgmma accumulates into the carried output (``pl.run_state`` over an
accumulator initialised from it). GPU interpret mode simulates wgmma only with operands in
memory and cannot interpret ``pl.run_state``; with ``p_via_smem=True`` P is stored to a
per-consumer shared-memory tile and PV goes to a fresh accumulator added to the rescaled
output. The arithmetic is the same (float32 accumulation of 16-bit P times V); only where P
lives differs. ``default_config(H, interpret=True)`` picks it; both forms lower for CUDA in the
tests.

**Masks and empty rows**: masked scores are -inf; the running maximum is replaced by 0 where it
is still -inf, so a row that has seen nothing yet keeps ``alpha = p = 0`` instead of NaN, and a
row that saw nothing at all ends with ``l = 0``: out 0 and lse -inf.

**Continuing a previous part** (``prev``): given the (out, lse) of the same rows against other
keys (a CP rank's local part), the kernel returns both merged: its epilogue loads prev's out and
lse into the tiles Q and the lse used, and weighs them against its own unnormalised sums in
float32 (the log-sum-exp merge, ``merging.py``), so that the layer's remote call writes the
rank's final rows once instead of writing its own and merging in XLA. A program whose rows see
no key here loads nothing but prev's rows, and writes them back unchanged (weights 1 and 0).

**Rows read in place.** ``q`` may hold more rows than ``vis`` describes (``T = vis.q_len``):
the call takes the first T rows of each batch entry and returns T rows, reading q where it lies
(the layer's halo call takes each chunk's first rows this way, with no copy).

**Lengths** not a multiple of the tiles are padded in the wrapper: padded query rows see
nothing (``row_lo = row_hi = 0``), padded keys are seen by no row; both are sliced off.

Deterministic: every output element is written once by one thread block, no atomics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import tile_plan
from ..mesh_axes import varying, varying_like
from . import config as config_lib
from .config import Config
from .packed_plan import PackedPlan, ranges_lengths, ranges_sections
from .turns import Turns

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int, value=0):
    """x padded with ``value`` to ``size`` along ``axis``."""
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def leading_rows(x, rows: int, padded: int):
    """``x [B, R, ...]`` as a kernel operand whose first ``rows`` rows along axis 1 are read in
    whole tiles up to ``padded``: ``x`` itself where it holds ``padded`` rows or more (read in
    place, the rest never loaded), else its first ``rows`` padded with zeros."""
    if x.shape[1] >= padded:
        return x
    return pad_axis(x if x.shape[1] == rows else x[:, :rows], 1, padded)


def read_scalar(ref, *index):
    """``ref[index]``, a scalar of the plan (a tile index or a loop bound) read from GMEM inside a
    kernel, typed like every other value the kernel computes.

    Why: inside ``jax.shard_map``, ``plgpu.kernel`` (jax's ``mpmd_map``, jax 0.11 and 0.12) gives
    the kernel its operand refs with the operands' varying mesh axes (``int32[]{V:cp}``), but
    traces the body with the vma check off, under which every value the body computes is
    unvarying (``int32[]``); a loop started from a read value (``fori_loop(lo, hi, ...)``, whose
    index is a carry) then carries ``int32[]{V:cp}`` in and ``int32[]`` out, a TypeError.
    (``pallas_call`` drops the operands' varying axes from the kernel's refs; ``mpmd_map`` does
    not.) Adding 0, which the Mosaic GPU compiler folds away, gives the read the body's type.
    Outside ``shard_map`` the read is returned as it is."""
    x = ref[index]
    if not varying(x):
        return x
    return x + jnp.zeros((), x.dtype)


def read_tile(plan_ref, layout: PackedPlan, prefix: str, bp, i):
    """``(tile, (lo, full_lo, full_hi, hi))``: the outer tile program ``i`` runs (the plan's
    ``order``) and the bounds of its inner tiles, read from the packed plan's sections ``prefix``
    + the field's name (``packed_plan.ranges_lengths``)."""
    scalar = lambda name, at: read_scalar(plan_ref, bp, layout.start(prefix + name) + at)
    tile = scalar("order", i)
    return tile, tuple(scalar(name, tile) for name in ("lo", "full_lo", "full_hi", "hi"))


def _plan(T: int, L: int, config: Config):
    """``(Tp, Lp, layout, key, plan_of)`` of a call of T query rows against L keys: the padded
    lengths, and the kernel's mask operands in one array (the padded row intervals and the tile
    plan), made by ``plan_of(vis)`` (``Visibility.derive``'s ``fn``, under ``key``)."""
    tile_q, block_k = config.tile_q, config.block_k
    Tp, Lp = _round_up(T, tile_q), _round_up(L, block_k)
    layout = PackedPlan.of(row_lo=Tp, row_hi=Tp, **ranges_lengths("", Tp // tile_q))

    def plan_of(vis):
        row_lo, row_hi = (pad_axis(jnp.asarray(x, jnp.int32), 1, Tp) for x in (vis.row_lo, vis.row_hi))
        r = tile_plan.tile_ranges(row_lo, row_hi, outer_block=tile_q, inner_block=block_k, inner_len=Lp)
        return layout.pack(row_lo=row_lo, row_hi=row_hi, **ranges_sections("", r))

    return Tp, Lp, layout, ("forward", Tp, Lp, tile_q, block_k), plan_of


def _config_of(q, config: Config | None) -> Config:
    if config is not None:
        return config
    return config_lib.default_config(q.shape[-1]) if q.ndim == 4 else Config()


def prime_forward(q, k, vis, *, config: Config | None = None):
    """``vis`` with the plan :func:`forward` of these q and k (arrays or shapes) makes of it made
    now (``Visibility.with_derived``), for a caller that makes its masks ahead of the calls."""
    _, _, _, key, plan_of = _plan(vis.q_len, k.shape[1], _config_of(q, config))
    return vis.with_derived(plan_of, key)


def forward(q, k, v, vis, *, scale: float, config: Config | None = None, prev=None):
    """Attention of q against k, v where ``vis`` allows; ``(out, lse)`` (see the module doc).

    ``prev``: ``(out, lse)`` of the same rows against other keys (rows read as q's are: the
    first T, in place), which the call continues: the result is the two merged (as
    ``merging.merge``, without rounding this call's part first), and a row that sees no key
    here gets ``prev``'s out and lse back, bit for bit."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"implementation='mosaic': scale must be a Python number > 0, got {scale!r}")
    config = _config_of(q, config)
    config_lib.check(q, k, v, vis, config)
    if jax.default_backend() == "gpu":
        config_lib.check_device()
    T = vis.q_len  # q may hold more rows: the call takes its first T
    Tp, Lp, layout, key, plan_of = _plan(T, k.shape[1], config)
    plan = vis.derive(plan_of, key)
    qp, kp, vp = leading_rows(q, T, Tp), pad_axis(k, 1, Lp), pad_axis(v, 1, Lp)
    if prev is not None:
        prev = _check_prev(q, T, prev)
        prev = (leading_rows(prev[0], T, Tp), pad_axis(prev[1], 2, Tp, -jnp.inf))
    out, lse = _call(qp, kp, vp, plan, prev, layout=layout, scale=float(scale), config=config)
    return out[:, :T], lse[:, :, :T]


def _check_prev(q, T: int, prev):
    """``prev`` as ``(out, lse float32)``; ValueError unless out is shaped and typed as q and lse
    is [B, N, T]."""
    out, lse = prev
    B, _, N, _ = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or lse.shape != (B, N, T):
        raise ValueError(
            f"implementation='mosaic': prev must be (out {list(q.shape)} {q.dtype}, lse {[B, N, T]}), got "
            f"({list(out.shape)} {out.dtype}, {list(lse.shape)})"
        )
    return out, lse.astype(jnp.float32)


def _call(q, k, v, plan, prev, *, layout: PackedPlan, scale, config):
    B, _, N, H = q.shape
    Tp = layout.length("row_lo")  # the call's rows, padded to the tile (q may hold more)
    num_kv_heads = k.shape[2]
    dtype = q.dtype
    bq, bk, S, C = config.block_q, config.block_k, config.num_stages, config.consumers
    n_tiles = Tp // config.tile_q
    per_batch = plan.shape[0] != 1  # Bp == B (documents) or 1
    group = N // num_kv_heads
    c = scale * _LOG2E  # scores to base-2 logits

    continues = prev is not None

    def kernel(refs, scoped):
        q_ref, k_ref, v_ref = refs[:3]
        prev_out_ref, prev_lse_ref = refs[3:5] if continues else (None, None)
        plan_ref, out_ref, lse_ref = refs[-3:]
        smem, barriers = scoped
        qo_smem, k_smem, v_smem, rows_smem, lse_smem, p_smem = smem
        in_bars, k_bars, v_bars, k_free, v_free, turn, prev_bars = barriers
        head, batch, wg = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
        bp = batch if per_batch else 0
        tile, (j_lo, j_flo, j_fhi, j_hi) = read_tile(plan_ref, layout, "", bp, lax.axis_index("tiles"))

        @pl.when(wg < C)
        def _consumer():
            plgpu.set_max_registers(232 if C == 2 else 240, action="increase")
            q0 = tile * config.tile_q + wg * bq
            q_smem = qo_smem.at[wg]
            rows = pl.ds(q0, bq)
            copies = [
                (q_ref.at[batch, rows, head], q_smem),
                (plan_ref.at[bp, pl.ds(layout.start("row_lo") + q0, bq)], rows_smem.at[wg, 0]),
                (plan_ref.at[bp, pl.ds(layout.start("row_hi") + q0, bq)], rows_smem.at[wg, 1]),
            ]

            # A program whose rows see no key here loads nothing of them (a remote call of
            # documents sees few of its rows' keys): its out and lse are written all the same.
            @pl.when(j_lo < j_hi)
            def _load():
                for i, (src, dst) in enumerate(copies):  # one barrier per copy
                    plgpu.copy_gmem_to_smem(src, dst, in_bars.at[3 * wg + i])
                for i in range(len(copies)):
                    plgpu.barrier_wait(in_bars.at[3 * wg + i])

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            lo_rows = plgpu.load(rows_smem.at[wg, 0], layout=row_layout)
            hi_rows = plgpu.load(rows_smem.at[wg, 1], layout=row_layout)

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.full((bq, H), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            turns = Turns(turn if config.pingpong else None, wg)
            turns.start()

            def step(j, carry, *, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(j - j_lo, S)
                plgpu.barrier_wait(k_bars.at[slot])

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
                    turns.give()
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    key = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA) + j * bk
                    seen = (key >= lax.broadcast_in_dim(lo_rows, (bq, bk), [0])) & (
                        key < lax.broadcast_in_dim(hi_rows, (bq, bk), [0])
                    )
                    s = jnp.where(seen, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * c)
                # A row that has seen no key yet keeps m = -inf; shift it by 0 instead (no NaN).
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                turns.done()  # softmax done
                plgpu.barrier_wait(v_bars.at[slot])
                turns.take()
                if config.p_via_smem:
                    p_tile = p_smem.at[wg]
                    p_tile[...] = p16
                    plgpu.commit_smem()

                    def pv(o_ref):
                        plgpu.wgmma(o_ref, p_tile, v_smem.at[slot])
                        return o_ref[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, H), jnp.float32))
                else:

                    def pv(o_ref):
                        plgpu.wgmma(o_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc, m_i, l_i = tile_plan.over_inner_tiles(j_lo, j_flo, j_fhi, j_hi, step, (acc, m_i, l_i))
            turns.end()

            seen_any = l_i > 0.0
            log_l = jnp.log(jnp.where(seen_any, l_i, 1.0))
            lse = jnp.where(seen_any, m_i * _LN2 + log_l, -jnp.inf)  # natural log
            if continues:  # Q is no longer read: its tile takes prev's out
                out, lse = _continued(
                    prev_out_ref.at[batch, rows, head],
                    prev_lse_ref.at[batch, head, rows],
                    q_smem,
                    lse_smem.at[wg],
                    prev_bars,
                    wg,
                    acc,
                    m_i,
                    lse,
                    row_layout,
                )
            else:
                inv_l = 1.0 / jnp.where(seen_any, l_i, 1.0)
                out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
            q_smem[...] = out.astype(dtype)  # Q is no longer read: its tile holds the output
            lse_smem.at[wg][...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, rows, head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == C)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            @pl.loop(j_lo, j_hi)
            def _load(j):
                slot = lax.rem(j - j_lo, S)
                tile_k = (batch, pl.ds(j * bk, bk), kv_head)
                reuse = j - j_lo >= S

                @pl.when(reuse)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[tile_k], k_smem.at[slot], k_bars.at[slot])

                @pl.when(reuse)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[tile_k], v_smem.at[slot], v_bars.at[slot])

    def entry(*refs):
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((C, bq, H), dtype, transforms=transforms),
            plgpu.SMEM((S, bk, H), dtype, transforms=transforms),
            plgpu.SMEM((S, bk, H), dtype, transforms=transforms),
            plgpu.SMEM((C, 2, bq), jnp.int32),
            plgpu.SMEM((C, bq), jnp.float32),
            plgpu.SMEM((C, bq, bk), dtype, transforms=transforms) if config.p_via_smem else None,
        )
        barriers = (
            plgpu.Barrier(num_barriers=3 * C),  # per consumer: Q, row_lo, row_hi
            plgpu.Barrier(num_barriers=S),  # K slot filled
            plgpu.Barrier(num_barriers=S),  # V slot filled
            plgpu.Barrier(num_arrivals=C, num_barriers=S),  # K slot released by every consumer
            plgpu.Barrier(num_arrivals=C, num_barriers=S),  # V slot released
            plgpu.Barrier(num_arrivals=2) if config.pingpong else None,  # ping-pong turns
            plgpu.Barrier(num_barriers=2 * C) if continues else None,  # per consumer: prev's out, lse
        )
        pl.run_scoped(lambda *scoped: kernel(refs, scoped), smem, barriers, collective_axes="wg")

    out_type = (
        jax.ShapeDtypeStruct((B, Tp, N, H), dtype),
        jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    )
    operands = (q, k, v, *(prev if continues else ()), plan)  # the plan last (the layer's tests find it)
    outs = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(N, B, n_tiles),
        grid_names=("heads", "batch", "tiles"),
        num_threads=C + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
    # plgpu.kernel types its results as invariant: see mesh_axes.py.
    return varying_like(outs, operands)


def _continued(prev_out_ref, prev_lse_ref, out_smem, lse_smem, bars, wg, acc, m_i, lse, row_layout):
    """(out float32, lse) of a consumer's rows: prev's (loaded from GMEM into ``out_smem`` and
    ``lse_smem``) merged with this call's unnormalised ``acc``, base-2 running max ``m_i`` and
    natural ``lse``: L = logaddexp(L_prev, L) and out = e^(L_prev - L) out_prev + 2^(m - L log2 e) acc
    (acc / l weighted by e^(L_here - L)). A row this call saw nothing of keeps prev's bits: its
    weights are exactly 1 and 0."""
    plgpu.copy_gmem_to_smem(prev_out_ref, out_smem, bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(prev_lse_ref, lse_smem, bars.at[2 * wg + 1])
    plgpu.barrier_wait(bars.at[2 * wg])
    plgpu.barrier_wait(bars.at[2 * wg + 1])
    # Both tiles are written over below: the out tile's elements each by the one thread that
    # read it; a row's lse by the lanes of the quad that hold it, one warp, after its load.
    prev_out = plgpu.load(out_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    prev_lse = plgpu.load(lse_smem, layout=row_layout)
    top = jnp.maximum(prev_lse, lse)
    shift = jnp.where(top == -jnp.inf, 0.0, top)  # a row that sees nothing anywhere: no NaN
    exp = lambda x: jnp.exp2(x * _LOG2E)
    merged = shift + jnp.log(exp(prev_lse - shift) + exp(lse - shift))
    base = jnp.where(merged == -jnp.inf, 0.0, merged)
    w_prev = exp(prev_lse - base)
    w_here = jnp.exp2(m_i - base * _LOG2E)  # 0 where this call saw nothing (m = -inf)
    bcast = lambda w: lax.broadcast_in_dim(w, acc.shape, [0])
    return prev_out * bcast(w_prev) + acc * bcast(w_here), merged
