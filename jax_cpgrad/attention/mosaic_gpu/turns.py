"""Ping-pong turns of a kernel's two consumer warpgroups on the tensor cores (FA3's scheme).

An H100 has about 250x more matmul than exponential throughput (989 vs 3.9 TFLOPS in the FA3
paper): two consumers that wait for the same shared-memory slot run in step, both in their
exponentials at once, and leave the tensor cores idle meanwhile. With turns, one consumer's
exponentials overlap the other's matmuls: a barrier of two arrivals, met by both in every step.

In a step a consumer issues its score-side matmuls, then gives the turn (``give``: both meet);
computes its exponentials while the other's matmuls run, says it is done (``done``: arrives)
and takes the turn back (``take``: waits) for its accumulating matmuls. The second consumer
starts half a step behind (``start``) and the first ends half a step after (``end``), so both
meet the barrier equally often; both must run the same number of steps (the kernels plan their
tiles per program, not per consumer, for this). Only the order of the issues changes: each sum
runs over the same tiles in the same order, the same bits.

``Turns(None, wg)`` (one consumer, or turns off): every call does nothing, and the kernel
compiles as without them.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


class Turns:
    def __init__(self, barrier, wg):
        self.barrier, self.wg = barrier, wg

    def _meet(self):
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def start(self):
        if self.barrier is not None:
            pl.when(self.wg == 1)(self._meet)

    def end(self):
        if self.barrier is not None:
            pl.when(self.wg == 0)(self._meet)

    def give(self):
        if self.barrier is not None:
            self._meet()

    def done(self):
        if self.barrier is not None:
            plgpu.barrier_arrive(self.barrier)

    def take(self):
        if self.barrier is not None:
            plgpu.barrier_wait(self.barrier)  # the tensor cores are ours
