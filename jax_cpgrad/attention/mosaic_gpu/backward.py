"""The attention backward as two Pallas Mosaic GPU kernels for Hopper (sm_90): dQ, and dK/dV.

Both take the GIVEN output and log-sum-exp (possibly the merged ones of several key parts, see
``split_attention``): P = exp(S - lse) and delta = rowsum(dO * O) with those, so that the
backward of each key part, summed, is the backward of the whole (the merge property). The
log-sum-exp is turned into base 2 in XLA, and ``-inf`` (a row that sees nothing) into ``+inf``,
so that its P is exactly 0 in every tile. delta is the dQ kernel's: each program has its rows' dO
resident anyway, reads their O (in out's own dtype) beside it, sums the float32 products of each
row and writes them out for the dK/dV kernel, which runs after it. A pass of its own over O and
dO (what we did before, in XLA) took about 25 us of a 0.57 ms rank at S = 32k, R = 8 on an H200;
here it costs the dQ kernels 12-13 us, and the rank's busy GPU time fell 1.7% (results, finding
12).

**The work.** Lengths are padded to the tiles in the wrapper (padded query rows see nothing and
have dO = 0; padded keys are seen by nobody). As in the forward, q, out and d_out may hold more
rows than ``vis`` describes: the call takes their first ``vis.q_len`` rows, read in place.
``tile_plan.tile_ranges`` turns the mask's intervals (``masks.Visibility``) into, for each outer
tile, the inner tiles it visits ``[lo, hi)`` and the unmasked ones ``[full_lo, full_hi)``; the
element mask (row t sees keys ``[row_lo[t], row_hi[t])``, key l is seen by queries
``[col_lo[l], col_hi[l])``) is applied only outside the unmasked range. Programs are launched
heaviest tile first (``order``). Both kernels take the intervals and both plans as one int32
operand (``packed_plan.py``), each reading its own sections.

- **dQ** (``_dq_kernel``): one program per (query tile of ``consumers * block_q`` rows, query
  head, batch entry), first delta = rowsum(dO * O), then over the key tiles of the row plan:
  S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
  With ``dq_add`` (another part's dQ of the same rows: a CP rank's local backward given its
  remote part's), the epilogue loads those rows into Q's tile and writes the float32 sum of both,
  rounded once. A program whose rows see no key loads nothing, and writes dQ 0 (or the dQ it
  adds) and delta 0.
- **dK/dV** (``_dkv_kernel``): one program per (key tile of ``consumers * block_k`` keys, KV
  head, batch entry), over the G = N/K query heads of that KV head and the query tiles of the
  column plan, in the transposed orientation: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
  dK += dS^T Q. GQA is summed in the float32 accumulators, in a fixed order: no atomics,
  bitwise deterministic. A program whose keys no query sees loads nothing and writes zeros.

**Warpgroups.** Each program has ``consumers + 1`` warpgroups (``wg``), two consumers by default:

- the last, the *producer*, gives back most of its registers (24 with two consumers, 40 with
  one: ``registers``) and only issues TMA copies of the streamed operands (K and
  V tiles for dQ; Q, dO, lse and delta tiles for dK/dV) into a ring of ``num_stages`` SMEM
  slots, one "loaded" barrier per slot and operand; before refilling a slot it waits for the
  slot's "free" barrier (released by every consumer), and at the end it waits for the last
  releases, so that no arrival is left unobserved;
- each *consumer* (240 registers) owns ``block_q`` rows (dQ) or ``block_k`` keys (dK/dV) of the
  program's tile and loads its resident tiles once (Q, dO, O, lse and the row bounds for
  dQ; K, V and the column bounds for dK/dV), then per step waits for the slot, issues the two
  score-side wgmmas together (S and dP), computes P and dS in float32 registers (base 2:
  ``exp2(s * scale * log2 e - lse2)``, the element mask only on masked tiles), issues the
  accumulating wgmma(s), waits for them and frees the slot.

Why: the loads of the next ``num_stages - 1`` steps overlap the math of this one without a
consumer ever issuing a copy or waiting on a copy it issued, and the loop bounds (read from the
plan in GMEM by every warpgroup) can be dynamic. Two consumers share each streamed tile (half
the loads per row or key) and keep the tensor cores busy while the other computes P and dS:
on an H200 they took the backward from 1.45x cuDNN's time to 1.09x at 16k (causal, head dim
128; ``benchmarks/results/README.md``, finding 11). The plan is per program, so a consumer may
visit a tile that only its sibling's rows see; its P there is exactly 0, and each row's (key's)
sums run over the same tiles in the same order: one consumer and two give the same bits (a GPU
test). So a kernel whose grid is under a wave of SMs runs with one consumer
(``narrow_small_grids``, ``kernel_consumers``): a halo's dK/dV, 64 programs of 128 keys on 132
SMs, would otherwise leave half of them idle while each program walks its whole chain of steps.
The accumulators (dQ; dK and dV) are wgmma accumulator refs that live across the whole
loop, so the float32 sums never leave registers.

**Operands in registers or through SMEM** (``BackwardConfig.operands_via_smem``): on the GPU the
16-bit dS (and P^T, dS^T) are wgmma A operands straight from registers. GPU interpret mode
simulates wgmma only with operands in memory, so the interpret form stores them to an SMEM tile
first (``commit_smem`` fences the stores for the async proxy). The arithmetic is the same;
``default_config(H, interpret=True)`` picks it, and both forms lower for CUDA in the tests.

**What FlashAttention-3 does differently** (its sm90 backward): one kernel per key tile computes
dK/dV and dQ together (5 matmuls per tile pair instead of our 3 + 4), adding dQ into a float32
global buffer with atomics (a separate warp does the TMA reduce-add) and converting it in a
post-kernel, with GQA dK/dV also summed by atomics unless run in its slower deterministic mode.
It uses two consumer warpgroups (M = 128 rows per program), as we do, and overlaps the softmax of
one with the wgmmas of the other by explicit turns, which ours do only with ``pingpong`` (off:
slower on an H100, below). We pay about 40% more matmul
work for determinism, no float32 global dQ buffer and no atomics, and for a mask-aware tile range
in each direction. Measured on an H200 (2026-12-03, ``benchmarks/results/README.md``, finding 11):
1.09-1.12x cuDNN's default backward time at 16k-64k at head dim 128 (1.13-1.14x at head dim
64): 7 matmuls per tile pair to its 5 in 1.1x the time. The rest of the way is dQ summed inside
the dK/dV kernel in a fixed order. Ping-pong turns (``BackwardConfig.pingpong``) give the same bits
but made every backward kernel of a rank 4-14% slower on an H100 (2026-12-07, finding 11): a
backward step is mostly matmuls, which the turns serialize, with little softmax to hide.

Shapes: q ``[B, T, N, H]``, k/v ``[B, L, K, H]``, lse ``[B, N, T]`` float32 natural log.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import tile_plan
from ..masks import Visibility
from ..mesh_axes import varying_like
from . import config as config_lib
from .forward import leading_rows, pad_axis, read_tile
from .packed_plan import PackedPlan, ranges_lengths, ranges_sections
from .turns import Turns

F32 = jnp.float32
I32 = jnp.int32
LOG2E = math.log2(math.e)
#: Head dimensions of the backward: at 256 the float32 dK and dV of a 64-row key tile alone
#: would need all 255 registers of a consumer thread.
HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiling and pipeline of the two backward kernels.

    - ``block_q``: query rows of a dQ program, and of a dK/dV step (a multiple of 64);
    - ``block_k``: key rows of a dQ step, and of a dK/dV program (a multiple of 64);
    - ``num_stages``: slots of the shared-memory ring of streamed tiles (>= 2);
    - ``consumers``: consumer warpgroups per program (1 or 2), each with its own ``block_q`` query
      rows (dQ) or ``block_k`` keys (dK/dV), sharing every streamed tile the producer loads; a
      program's tile is ``consumers`` times the block;
    - ``operands_via_smem``: dS (dQ) and P^T, dS^T (dK/dV) reach their wgmma through shared
      memory instead of as register operands. GPU interpret mode simulates wgmma only with
      operands in memory, so interpret mode needs True; False is what the GPU should run (one
      shared-memory round trip and fence less per step). Both forms lower and are tested;
    - ``narrow_small_grids``: a kernel whose grid of one-consumer programs still fits in one
      wave of the GPU's SMs runs with one consumer (``kernel_consumers``). Such a grid leaves
      half the SMs idle with two, and its time is the longest program's chain of steps; one
      consumer a program halves the keys (rows) each walks. The same bits either way;
    - ``pingpong``: the two consumers of a kernel take turns on the tensor cores, one computing
      P and dS while the other's matmuls run (``turns.py``, the forward's scheme). Without turns
      they wait for the same slot and so run in step, both in their exponentials at once. The
      same bits either way; off by default: slower on an H100 (a rank's four backward kernels
      4-14%; ``--bwd-config pingpong=true`` in ``benchmarks/mosaic_attention.py`` and
      ``experiments/rank_timeline.py`` compares).
    """

    block_q: int = 64
    block_k: int = 64
    num_stages: int = 2
    consumers: int = 2
    operands_via_smem: bool = False
    narrow_small_grids: bool = True
    pingpong: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 64 or value > 128:
                raise ValueError(f"BackwardConfig.{name} must be 64 or 128 (wgmma tiles), got {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"BackwardConfig.num_stages must be an int >= 2, got {self.num_stages!r}")
        if self.consumers not in (1, 2):
            raise ValueError(f"BackwardConfig.consumers must be 1 or 2 warpgroups, got {self.consumers!r}")
        if self.pingpong and self.consumers != 2:
            raise ValueError(
                "BackwardConfig.pingpong needs consumers=2 (two warpgroups take turns); set pingpong=False"
            )

    def smem_bytes(self, head_dim: int, itemsize: int = 2, out_itemsize: int | None = None) -> int:
        """Shared memory of the larger of the two kernels (bytes); ``out_itemsize``: the given
        output's, which the dQ kernel reads (``itemsize`` if None)."""
        bq, bk, s, c = self.block_q, self.block_k, self.num_stages, self.consumers
        p = (bq * bk if self.operands_via_smem else 0) * itemsize
        o = bq * head_dim * (itemsize if out_itemsize is None else out_itemsize)
        dq = c * (2 * bq * head_dim * itemsize + o + p + 4 * 4 * bq) + 2 * s * bk * head_dim * itemsize
        dkv = c * (2 * bk * head_dim * itemsize + 2 * p + 4 * 2 * bk) + s * bq * (2 * head_dim * itemsize + 8)
        return max(dq, dkv)

    def replace(self, **changes) -> BackwardConfig:
        return dataclasses.replace(self, **changes)


def registers(consumers: int) -> tuple[int, int]:
    """(a consumer's, the producer's) registers per thread. Two consumers and the producer share
    an SM's 65536 registers: 240 + 240 + 24 = 504 per lane of 128."""
    return (240, 24) if consumers == 2 else (240, 40)


def kernel_consumers(config: BackwardConfig, programs: int, sm_count: int) -> int:
    """Consumers a kernel runs with: ``config.consumers``, or one where ``narrow_small_grids`` and
    its ``programs`` with one consumer (twice those with two) fit in ``sm_count`` SMs."""
    if config.narrow_small_grids and config.consumers == 2 and programs <= sm_count:
        return 1
    return config.consumers


def consumers_of(config: BackwardConfig, q_shape, k_shape, sm_count: int) -> tuple[int, int]:
    """(the dQ kernel's, the dK/dV kernel's) consumers for q [B, T, N, H] and k [B, L, K, H]:
    their one-consumer grids are N x B x T / block_q and K x B x L / block_k programs."""
    (B, T, N), (L, K) = q_shape[:3], k_shape[1:3]
    return (
        kernel_consumers(config, N * B * tile_plan.cdiv(T, config.block_q), sm_count),
        kernel_consumers(config, K * B * tile_plan.cdiv(L, config.block_k), sm_count),
    )


def default_config(head_dim: int, *, interpret: bool = False) -> BackwardConfig:
    """The backward config for ``head_dim``; ``interpret=True``: the form interpret mode runs."""
    _check_head_dim(head_dim)
    return BackwardConfig(num_stages=3 if head_dim == 64 else 2, operands_via_smem=interpret)


def _check_head_dim(head_dim: int) -> None:
    config_lib.check_head_dim(head_dim)
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"implementation='mosaic': the backward supports head dimensions "
            f"{', '.join(map(str, HEAD_DIMS))}, got {head_dim}; use implementation='cudnn' or 'xla'"
        )


# -- kernels -------------------------------------------------------------------------------------


def _smem_transforms(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _matmuls(*operands, shape, issued):
    """Products a @ b of the (a, b) pairs, each in a fresh float32 accumulator, issued together;
    ``issued()`` runs after the issue and before the wait for the products (``Turns.give``)."""
    pairs = list(zip(operands[::2], operands[1::2], strict=True))

    def body(*accs):
        for acc, (a, b) in zip(accs, pairs, strict=True):
            plgpu.wgmma(acc, a, b)
        issued()
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(body, *[plgpu.ACC(shape, F32) for _ in pairs])


def _operand(x, dtype, smem_ref):
    """The wgmma A operand x in ``dtype``: in registers, or stored to ``smem_ref`` (not None)."""
    x = x.astype(dtype)
    if smem_ref is None:
        return x
    smem_ref[...] = x
    plgpu.commit_smem()  # the generic-proxy stores, visible to the wgmma (async proxy)
    return smem_ref


def _produce(copies, steps, free_bars, stages):
    """The producer warpgroup's loop: for each step n, the TMA copies ``copies(n, slot)``
    (``(gmem ref, smem ref, barrier)`` triples) into ring slot n mod ``stages``, a slot once every
    consumer let go of it; then a wait for the slots' last releases, so that every arrival on a
    "free" barrier is waited for once (nothing is left in flight when the program ends; jax
    0.11.2's interpreter checks it)."""

    def fill(n, carry):
        slot = lax.rem(n, jnp.int32(stages))
        pending = copies(n, slot)

        @pl.when(n >= stages)
        def _():
            plgpu.barrier_wait(free_bars.at[slot])

        for src, dst, barrier in pending:
            plgpu.copy_gmem_to_smem(src, dst, barrier)
        return carry

    lax.fori_loop(0, steps, fill, None)

    def drain(n, carry):
        plgpu.barrier_wait(free_bars.at[lax.rem(n, jnp.int32(stages))])
        return carry

    lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, None)


def _load_resident(pairs, barriers, wg):
    """TMA copies of consumer ``wg``'s resident tiles, ``(gmem ref, smem ref)`` pairs, each on its
    own barrier (``len(pairs)`` a consumer), all issued before the first wait."""
    first = wg * len(pairs)
    for n, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[first + n])
    for n in range(len(pairs)):
        plgpu.barrier_wait(barriers.at[first + n])


def _dq_kernel(
    *refs, block_q, block_k, head_dim, groups, stages, scale, per_batch_plan, via_smem, registers, layout,
    pingpong, adds,
):  # fmt: skip
    q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref = refs[:6]
    add_ref = refs[6] if adds else None
    plan_ref = refs[6 + adds]
    refs = refs[7 + adds :]
    dq_ref, delta_ref = refs[:2]
    q_smem, do_smem, o_smem, lse_smem, delta_smem, vlo_smem, vhi_smem, k_smem, v_smem = refs[2:11]
    ds_smem = refs[11] if via_smem else None
    res_bars, k_bars, v_bars, free_bars = refs[11 + via_smem : 15 + via_smem]
    add_bars = refs[15 + via_smem] if adds else None
    head, batch, i = lax.axis_index("head"), lax.axis_index("batch"), lax.axis_index("tile")
    wg, consumers = lax.axis_index("wg"), q_smem.shape[0]
    turns = Turns(refs[-1] if pingpong else None, wg)
    bp = batch if per_batch_plan else 0
    tile, (lo, full_lo, full_hi, hi) = read_tile(plan_ref, layout, "q_", bp, i)
    kv_head = lax.div(head, jnp.int32(groups))
    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(registers[0], action="increase")
        row0 = (tile * consumers + wg) * block_q
        rows = pl.ds(row0, block_q)  # this consumer's rows
        interval = lambda name: plan_ref.at[bp, pl.ds(layout.start(name) + row0, block_q)]
        q_smem_, do_smem_, ds_smem_ = (
            q_smem.at[wg],
            do_smem.at[wg],
            None if ds_smem is None else ds_smem.at[wg],
        )
        resident = [
            (q_ref.at[batch, rows, head], q_smem_), (do_ref.at[batch, rows, head], do_smem_),
            (o_ref.at[batch, rows, head], o_smem.at[wg]), (lse_ref.at[batch, head, rows], lse_smem.at[wg]),
            (interval("row_lo"), vlo_smem.at[wg]), (interval("row_hi"), vhi_smem.at[wg]),
        ]  # fmt: skip
        # A program whose rows see no key loads nothing of them (a remote call of documents sees
        # few of its rows' keys): its dQ is 0 (or what it adds) and its delta 0, which no key
        # tile reads but a masked one (where P is 0), so it must be finite.
        sees = lo < hi
        tile_of = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA).astype(F32)

        @pl.when(sees)
        def _load():
            _load_resident(resident, res_bars, wg)

        # delta = rowsum(dO * O) of these rows, here rather than in a pass of its own over O and
        # dO; written out for the dK/dV kernel, which streams it per query tile. Where nothing is
        # seen the tiles were not loaded: the value is unused here (no step) and 0 is written.
        delta_rows = jnp.sum(tile_of(do_smem_) * tile_of(o_smem.at[wg]), axis=1)

        @pl.when(sees)
        def _delta():
            delta_smem.at[wg][...] = delta_rows

        @pl.when(jnp.logical_not(sees))
        def _no_delta():
            delta_smem.at[wg][...] = plgpu.layout_cast(jnp.zeros((block_q,), F32), wgmma_rows)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_ref.at[batch, head, rows])
        shape = (block_q, block_k)
        bcast = lambda x: lax.broadcast_in_dim(x, shape, [0])
        delta = bcast(delta_rows)
        lse, vlo, vhi = (
            bcast(plgpu.load(ref.at[wg], layout=wgmma_rows)) for ref in (lse_smem, vlo_smem, vhi_smem)
        )
        cols = plgpu.broadcasted_iota(I32, shape, 1, layout=plgpu.Layout.WGMMA)

        def run(dq_acc):
            def step(j, carry, *, masked: bool):
                slot = lax.rem(j - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_bars.at[slot])
                plgpu.barrier_wait(v_bars.at[slot])
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                s, dp = _matmuls(q_smem_, k_tile.T, do_smem_, v_tile.T, shape=shape, issued=turns.give)
                p = jnp.exp2(s * F32(scale * LOG2E) - lse)
                if masked:
                    col = cols + j * block_k
                    p = jnp.where((col >= vlo) & (col < vhi), p, 0.0)
                ds = _operand(p * (dp - delta), k_tile.dtype, ds_smem_)
                turns.done()
                turns.take()
                plgpu.wgmma(dq_acc, ds, k_tile)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free_bars.at[slot])

            turns.start()
            tile_plan.over_inner_tiles(lo, full_lo, full_hi, hi, step)
            turns.end()
            return dq_acc[...]

        dq = (pl.run_scoped(run, plgpu.ACC((block_q, head_dim), F32)) * F32(scale)).astype(q_smem_.dtype)
        if adds:  # Q is no longer read: its tile takes the rows' dQ to add (the same sum XLA made)
            plgpu.copy_gmem_to_smem(add_ref.at[batch, rows, head], q_smem_, add_bars.at[wg])
            plgpu.barrier_wait(add_bars.at[wg])
            dq = (dq.astype(F32) + tile_of(q_smem_)).astype(q_smem_.dtype)
        q_smem_[...] = dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem_, dq_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    def kv_tiles(n, slot):  # step n: the key tile lo + n
        keys = pl.ds((lo + n) * block_k, block_k)
        return [
            (k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_bars.at[slot]),
            (v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_bars.at[slot]),
        ]

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(registers[1], action="decrease")
        _produce(kv_tiles, hi - lo, free_bars, stages)


def _dkv_kernel(
    *refs, block_q, block_k, head_dim, groups, stages, scale, per_batch_plan, via_smem, registers, layout,
    pingpong,
):  # fmt: skip
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, plan_ref, dk_ref, dv_ref = refs[:9]
    k_smem, v_smem, vlo_smem, vhi_smem, q_smem, do_smem, lse_smem, delta_smem = refs[9:17]
    pt_smem, dst_smem = refs[17:19] if via_smem else (None, None)
    res_bars, q_bars, do_bars, lse_bars, delta_bars, free_bars = refs[17 + 2 * via_smem : 23 + 2 * via_smem]
    kv_head, batch, i = lax.axis_index("head"), lax.axis_index("batch"), lax.axis_index("tile")
    wg, consumers = lax.axis_index("wg"), k_smem.shape[0]
    turns = Turns(refs[-1] if pingpong else None, wg)
    bp = batch if per_batch_plan else 0
    tile, (lo, full_lo, full_hi, hi) = read_tile(plan_ref, layout, "k_", bp, i)
    n_tiles = hi - lo

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(registers[0], action="increase")
        key0 = (tile * consumers + wg) * block_k
        keys = pl.ds(key0, block_k)  # this consumer's keys
        interval = lambda name: plan_ref.at[bp, pl.ds(layout.start(name) + key0, block_k)]
        k_smem_, v_smem_ = k_smem.at[wg], v_smem.at[wg]
        pt_smem_, dst_smem_ = (None, None) if pt_smem is None else (pt_smem.at[wg], dst_smem.at[wg])
        resident = [
            (k_ref.at[batch, keys, kv_head], k_smem_), (v_ref.at[batch, keys, kv_head], v_smem_),
            (interval("col_lo"), vlo_smem.at[wg]), (interval("col_hi"), vhi_smem.at[wg]),
        ]  # fmt: skip

        @pl.when(n_tiles > 0)  # keys that no query sees load nothing: their dK and dV are 0
        def _load():
            _load_resident(resident, res_bars, wg)

        shape = (block_k, block_q)
        vlo, vhi = (
            lax.broadcast_in_dim(plgpu.load(ref.at[wg], layout=plgpu.Layout.WGMMA.reduce(1)), shape, [0])
            for ref in (vlo_smem, vhi_smem)
        )
        qcols = plgpu.broadcasted_iota(I32, shape, 1, layout=plgpu.Layout.WGMMA)
        wgmma_cols = plgpu.Layout.WGMMA.reduce(0)

        def run(dk_acc, dv_acc):
            def step(g, j, carry, *, masked: bool):
                slot = lax.rem(g * n_tiles + j - lo, jnp.int32(stages))
                plgpu.barrier_wait(q_bars.at[slot])
                plgpu.barrier_wait(do_bars.at[slot])
                q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
                st, dpt = _matmuls(k_smem_, q_tile.T, v_smem_, do_tile.T, shape=shape, issued=turns.give)
                plgpu.barrier_wait(lse_bars.at[slot])
                plgpu.barrier_wait(delta_bars.at[slot])
                lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=wgmma_cols), shape, [1])
                delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=wgmma_cols), shape, [1])
                pt = jnp.exp2(st * F32(scale * LOG2E) - lse)
                if masked:
                    qcol = qcols + j * block_q
                    pt = jnp.where((qcol >= vlo) & (qcol < vhi), pt, 0.0)
                dst = pt * (dpt - delta)
                turns.done()
                turns.take()
                plgpu.wgmma(dv_acc, _operand(pt, q_tile.dtype, pt_smem_), do_tile)
                plgpu.wgmma(dk_acc, _operand(dst, q_tile.dtype, dst_smem_), q_tile)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free_bars.at[slot])

            def head_loop(g, carry):
                tile_plan.over_inner_tiles(lo, full_lo, full_hi, hi, functools.partial(step, g))
                return carry

            turns.start()
            lax.fori_loop(0, groups, head_loop, None)
            turns.end()
            return dk_acc[...], dv_acc[...]

        acc = plgpu.ACC((block_k, head_dim), F32)
        dk, dv = pl.run_scoped(run, acc, acc)
        k_smem_[...] = (dk * F32(scale)).astype(k_smem_.dtype)
        v_smem_[...] = dv.astype(v_smem_.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem_, dk_ref.at[batch, keys, kv_head], commit_group=False)
        plgpu.copy_smem_to_gmem(v_smem_, dv_ref.at[batch, keys, kv_head], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    def q_tiles(n, slot):  # step n: query head g of the group, query tile lo + n - g * n_tiles
        g = lax.div(n, n_tiles)
        head = kv_head * groups + g
        rows = pl.ds((lo + n - g * n_tiles) * block_q, block_q)
        return [
            (q_ref.at[batch, rows, head], q_smem.at[slot], q_bars.at[slot]),
            (do_ref.at[batch, rows, head], do_smem.at[slot], do_bars.at[slot]),
            (lse_ref.at[batch, head, rows], lse_smem.at[slot], lse_bars.at[slot]),
            (delta_ref.at[batch, head, rows], delta_smem.at[slot], delta_bars.at[slot]),
        ]

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(registers[1], action="decrease")
        _produce(q_tiles, groups * n_tiles, free_bars, stages)


# -- the wrapper ---------------------------------------------------------------------------------


def check(q, k, v, out, lse, d_out, vis, config: BackwardConfig) -> None:
    """``ValueError`` unless the backward supports these inputs with this config (q, k, v and vis
    as the forward checks them; out, d_out and lse shaped after q; the head dims of the backward;
    its shared memory)."""
    config_lib.check(q, k, v, vis, config_lib.default_config(q.shape[-1] if q.ndim == 4 else 0))
    B, _, N, H = q.shape
    T = vis.q_len  # q's first T rows (the forward's check: no more than q holds)
    _check_head_dim(H)
    if out.shape != q.shape or d_out.shape != q.shape:
        raise ValueError(
            f"implementation='mosaic': out and d_out must have q's shape {q.shape}, got {out.shape}, "
            f"{d_out.shape}"
        )
    if jnp.dtype(out.dtype) not in (jnp.dtype(q.dtype), jnp.dtype(F32)):
        raise ValueError(f"implementation='mosaic': out must be in q's dtype or float32, got {out.dtype}")
    if lse.shape != (B, N, T):
        raise ValueError(f"implementation='mosaic': lse must be [B, N, T] = {(B, N, T)}, got {lse.shape}")
    need = config.smem_bytes(H, jnp.dtype(q.dtype).itemsize, jnp.dtype(out.dtype).itemsize)
    if need > config_lib.SMEM_BYTES:
        raise ValueError(
            f"implementation='mosaic': {config} needs {need} bytes of shared memory for head dim {H}, "
            f"more than the {config_lib.SMEM_BYTES} a Hopper thread block has; lower num_stages "
            f"(default_config({H}) fits)"
        )


def _plan(q_shape, k_shape, vis, config: BackwardConfig):
    """``((Cq, Ck, Tp, Lp), layout, key, plan_of)`` of the backward of q ``[B, *, N, H]`` against k
    ``[B, L, K, H]`` where ``vis`` allows: the two kernels' consumers, the padded rows and keys, and
    both kernels' mask operands in one array (packed_plan.py: the padded intervals and the tile
    plans, the rows' (dQ's, sections q_*) and the columns' (dK/dV's, k_*)), made by ``plan_of(vis)``
    (``Visibility.derive``'s ``fn``, under ``key``)."""
    (B, _, N, _), L = q_shape, k_shape[1]
    T, bq, bk = vis.q_len, config.block_q, config.block_k
    Cq, Ck = consumers_of(config, (B, T, N), k_shape, config_lib.sm_count())  # dQ's, dK/dV's
    # a program's tile is C blocks (its outer tiles); the blocks are the other kernel's inner tiles
    Tp, Lp = tile_plan.cdiv(T, Cq * bq) * Cq * bq, tile_plan.cdiv(L, Ck * bk) * Ck * bk
    layout = PackedPlan.of(
        row_lo=Tp, row_hi=Tp, **ranges_lengths("q_", Tp // (Cq * bq)),
        col_lo=Lp, col_hi=Lp, **ranges_lengths("k_", Lp // (Ck * bk)),
    )  # fmt: skip

    def plan_of(vis):
        row_lo, row_hi = (pad_axis(jnp.asarray(x, I32), 1, Tp) for x in (vis.row_lo, vis.row_hi))
        col_lo, col_hi = (pad_axis(jnp.asarray(x, I32), 1, Lp) for x in (vis.col_lo, vis.col_hi))
        rows = tile_plan.tile_ranges(row_lo, row_hi, outer_block=Cq * bq, inner_block=bk, inner_len=Lp)
        cols = tile_plan.tile_ranges(col_lo, col_hi, outer_block=Ck * bk, inner_block=bq, inner_len=Tp)
        return layout.pack(
            row_lo=row_lo, row_hi=row_hi, **ranges_sections("q_", rows),
            col_lo=col_lo, col_hi=col_hi, **ranges_sections("k_", cols),
        )  # fmt: skip

    return (Cq, Ck, Tp, Lp), layout, ("backward", Tp, Lp, Cq, bq, Ck, bk), plan_of


def prime_backward(q, k, vis, *, config: BackwardConfig | None = None):
    """``vis`` with the plan :func:`backward` of these q and k (arrays or shapes) makes of it made now
    (``Visibility.with_derived``): the layer makes it with its masks, and its backward, given this
    Visibility as a residual, takes it rather than making it in its own pass (where, in a
    ``lax.scan`` over layers, it would be made in every layer's step)."""
    if config is None:
        config = default_config(q.shape[-1] if q.ndim == 4 else 0)
    _, _, key, plan_of = _plan(q.shape, k.shape, vis, config)
    return vis.with_derived(plan_of, key)


def backward(
    q, k, v, out, lse, d_out, vis: Visibility, *, scale: float, config: BackwardConfig | None = None,
    dq_add=None,
):  # fmt: skip
    """(dq, dk, dv), in the dtypes of q, k, v, of the attention of q against k/v where ``vis``
    allows, whose (possibly merged) output and natural-log log-sum-exp are ``out`` and ``lse``;
    ``d_out`` is the cotangent of ``out``. See the module docstring.

    ``dq_add``: ``[B, T, N, H]`` in q's dtype, another part's dQ of the same rows, which the dQ
    kernel adds to this call's (rounded to q's dtype first, summed in float32, rounded once: the
    sum the layer would otherwise make in XLA, the same bits, without its pass over both)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"implementation='mosaic': scale must be a Python number > 0, got {scale!r}")
    if config is None:
        config = default_config(q.shape[-1] if q.ndim == 4 else 0)
    check(q, k, v, out, lse, d_out, vis, config)
    if dq_add is not None and (
        dq_add.shape != (q.shape[0], vis.q_len, *q.shape[2:]) or dq_add.dtype != q.dtype
    ):
        raise ValueError(
            f"implementation='mosaic': dq_add must be [B, T, N, H] = {[q.shape[0], vis.q_len, *q.shape[2:]]} "
            f"in {q.dtype}, got {list(dq_add.shape)} {dq_add.dtype}"
        )
    if jax.default_backend() == "gpu":
        config_lib.check_device()
    B, _, N, H = q.shape
    T = vis.q_len  # q, out and d_out may hold more rows: the call takes their first T
    L, K = k.shape[1:3]
    bq, bk, S = config.block_q, config.block_k, config.num_stages
    via_smem = config.operands_via_smem
    (Cq, Ck, Tp, Lp), layout, key, plan_of = _plan(q.shape, k.shape, vis, config)
    dtype = q.dtype

    # the base-2 lse in XLA; a row that sees nothing: lse +inf, so P = 0 (delta is the dQ kernel's)
    lse2 = pad_axis(jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(F32) * F32(LOG2E)), 2, Tp, jnp.inf)
    qp, dop, outp = (leading_rows(x, T, Tp) for x in (q, d_out.astype(dtype), out))
    kp, vp = pad_axis(k, 1, Lp), pad_axis(v, 1, Lp)

    plan = vis.derive(plan_of, key)

    kw = dict(
        block_q=bq, block_k=bk, head_dim=H, groups=N // K, stages=S, scale=float(scale),
        per_batch_plan=vis.row_lo.shape[0] > 1, via_smem=via_smem, layout=layout,
    )  # fmt: skip
    transforms = _smem_transforms(dtype)
    tiles = lambda *shape: plgpu.SMEM(shape, dtype, transforms=transforms)
    vec = lambda *shape, dt=F32: plgpu.SMEM(shape, dt)
    bars = lambda n: plgpu.Barrier(num_barriers=n)

    def launch(body, C, out_type, scratch, grid, operands):
        pingpong = config.pingpong and C == 2  # a narrowed kernel (one consumer) takes no turns
        return plgpu.kernel(
            functools.partial(body, **kw, registers=registers(C), pingpong=pingpong),
            out_type=out_type,
            scratch_types=[*scratch, *([plgpu.Barrier(num_arrivals=2)] if pingpong else [])],  # turns
            grid=grid,
            num_threads=C + 1,
            thread_name="wg",
            grid_names=("head", "batch", "tile"),
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*operands)

    # a slot is free once every consumer let go of it
    freed = lambda C, n: plgpu.Barrier(num_arrivals=C, num_barriers=n)
    # fmt: off
    dq_scratch: list[Any] = [
        tiles(Cq, bq, H), tiles(Cq, bq, H),  # Q, dO
        plgpu.SMEM((Cq, bq, H), out.dtype, transforms=_smem_transforms(out.dtype)),  # O
        vec(Cq, bq), vec(Cq, bq), vec(Cq, bq, dt=I32), vec(Cq, bq, dt=I32),  # lse, delta, bounds
        tiles(S, bk, H), tiles(S, bk, H),  # the K/V ring
        *([tiles(Cq, bq, bk)] if via_smem else []),  # dS
        bars(6 * Cq), bars(S), bars(S), freed(Cq, S),  # resident loaded; K, V loaded; slot free
        *([bars(Cq)] if dq_add is not None else []),  # the dQ to add loaded
    ]
    dkv_scratch: list[Any] = [
        tiles(Ck, bk, H), tiles(Ck, bk, H), vec(Ck, bk, dt=I32), vec(Ck, bk, dt=I32),  # resident
        tiles(S, bq, H), tiles(S, bq, H), vec(S, bq), vec(S, bq),  # the Q/dO/lse/delta ring
        *([tiles(Ck, bk, bq), tiles(Ck, bk, bq)] if via_smem else []),  # P^T, dS^T
        bars(4 * Ck), bars(S), bars(S), bars(S), bars(S), freed(Ck, S),  # resident; Q, dO, lse, delta; free
    ]
    # fmt: on
    adds = () if dq_add is None else (pad_axis(dq_add, 1, Tp),)
    dq_operands = (qp, kp, vp, dop, outp, lse2, *adds, plan)  # the plan last (the layer's tests find it)
    dq_types = (jax.ShapeDtypeStruct((B, Tp, N, H), dtype), jax.ShapeDtypeStruct((B, N, Tp), F32))
    dq, delta = launch(
        functools.partial(_dq_kernel, adds=bool(adds)), Cq, dq_types, dq_scratch, (N, B, Tp // (Cq * bq)),
        dq_operands,
    )  # fmt: skip
    dq, delta = varying_like((dq, delta), dq_operands)
    dkv_operands = (qp, kp, vp, dop, lse2, delta, plan)
    dk, dv = launch(
        _dkv_kernel, Ck, (jax.ShapeDtypeStruct((B, Lp, K, H), dtype),) * 2, dkv_scratch,
        (K, B, Lp // (Ck * bk)), dkv_operands,
    )  # fmt: skip
    dk, dv = varying_like((dk, dv), dkv_operands)
    return dq[:, :T], dk[:, :L], dv[:, :L]
