"""Running a per-rank body under shard_map over a 1-D "cp" mesh, in one process or many.

Inputs are numpy arrays stacked over ranks ([n, ...]); each rank's body sees its own slice.
Outputs come back as {rank: numpy array} for the ranks this process holds.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def cp_mesh(n: int | None = None, platform: str | None = None, axis: str = "cp") -> Mesh:
    devices = jax.devices(platform) if platform else jax.devices()
    return Mesh(np.array(devices[: n or len(devices)]), (axis,))


def local_ranks(mesh: Mesh) -> list[int]:
    mine = set(jax.local_devices())
    return [r for r, d in enumerate(mesh.devices.flat) if d in mine]


def place(mesh: Mesh, stacked: np.ndarray, axis: str = "cp"):
    """A global [n, ...] array whose shard r (on rank r's device) is stacked[r]."""
    sharding = NamedSharding(mesh, P(axis))
    if jax.process_count() == 1:
        return jax.device_put(stacked, sharding)
    local = np.concatenate([stacked[r : r + 1] for r in local_ranks(mesh)])
    return jax.make_array_from_process_local_data(sharding, local, stacked.shape)


def per_rank_results(mesh: Mesh, out) -> dict[int, np.ndarray]:
    index = {d: r for r, d in enumerate(mesh.devices.flat)}
    return {index[s.device]: np.asarray(s.data)[0] for s in out.addressable_shards}


def spmd_jit(mesh: Mesh, body, axis: str = "cp"):
    """jit(shard_map(body)): each rank's body gets its slices; outputs gain a leading rank axis."""

    def wrapped(*xs):
        return jax.tree.map(lambda o: o[None], body(*(x[0] for x in xs)))

    wrapped.__name__ = getattr(body, "__name__", "wrapped")  # names XLA's module (jit_<name>)
    return jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def spmd(mesh: Mesh, body, axis: str = "cp"):
    """Like spmd_jit, but takes stacked numpy inputs and returns {rank: numpy} per output."""
    f = spmd_jit(mesh, body, axis)

    def run(*stacked):
        out = f(*(place(mesh, s, axis) for s in stacked))
        return jax.tree.map(lambda o: per_rank_results(mesh, o), out)

    return run
