"""The collective set-up of a workspace: what every process must agree on before and while the
native memory is created, and the connection of every GPU to its peers' memory.

Every function here is collective in a multi-process job: every process calls it, in the same
order, and a problem seen by one process is raised by all of them (instead of leaving the others
waiting at a timeout).
"""

from __future__ import annotations

import socket

import numpy as np

from . import _distributed
from ._memory_exchange import MemoryExchange
from ._native import ext
from ._peer_memory import PeerMemoryError

SETUP_TIMEOUT_S = 300.0


def cp_groups(mesh, axis_name: str) -> dict:
    """For each device of the mesh: (its CP rank, the devices of its CP group in rank order)."""
    axis = mesh.axis_names.index(axis_name)
    devices = np.moveaxis(np.asarray(mesh.devices), axis, -1)
    groups = devices.reshape(-1, devices.shape[-1])
    return {dev: (rank, list(group)) for group in groups for rank, dev in enumerate(group)}


def gpu_ids(key: str, arguments: list, local_devices: list) -> dict[int, str]:
    """{JAX device id: PCI bus id} of every GPU of the job. In a multi-process job the processes
    also check here, before anything is allocated, that they were given the same arguments."""
    mine = {str(d.id): ext.pci_bus_id(d.local_hardware_id) for d in local_devices}
    if not _distributed.is_multiprocess():
        return {int(k): v for k, v in mine.items()}
    entries = _distributed.exchange(f"{key}/config", {"arguments": arguments, "gpus": mine}, SETUP_TIMEOUT_S)
    if any(e["arguments"] != entries[0]["arguments"] for e in entries):
        raise ValueError(
            "jax_cpgrad.Workspace was created with different arguments on different processes "
            "(axis, R, nbytes, timeout, protocol, SM budget, mesh devices): "
            + "; ".join(f"process {p}: {e['arguments']}" for p, e in enumerate(entries))
        )
    return {int(k): v for e in entries for k, v in e["gpus"].items()}


def shared_gpus(groups: dict, pci_of: dict[int, str]) -> list[str]:
    """The pairs of CP ranks of one group that are the same physical GPU (time-sliced processes)."""
    shared = []
    for dev, (rank, group) in groups.items():
        for other_rank, other in enumerate(group):
            if other_rank > rank and pci_of[other.id] == pci_of[dev.id]:
                shared.append(f"CP ranks {rank} and {other_rank} (GPU {pci_of[dev.id]})")
    return sorted(set(shared))


def resolve_protocol(requested: str, shared: list[str]) -> str:
    """'auto' is the device protocol when every rank has its own GPU, the memop protocol
    when ranks share one (spinning kernels of time-sliced processes would crawl)."""
    if requested == "auto":
        return "memop" if shared else "device"
    if requested == "device" and shared:
        raise ValueError(
            "protocol='device' needs one GPU per CP rank, but " + ", ".join(shared) + " share one: "
            "their spinning kernels would be time-sliced. Use protocol='memop' (or 'auto') there."
        )
    return requested


def publish_failure(key: str, err: BaseException) -> None:
    """Tell the other processes that this one could not create its part (they raise at once)."""
    if _distributed.is_multiprocess():
        _distributed.publish(f"{key}/peers", {"error": f"{type(err).__name__}: {err}"})


def connect(native, key: str, name: str, local_devices: list, groups: dict, pci_of: dict[int, str]) -> None:
    """Map every peer's memory on every local GPU (peers in other processes pass theirs over a
    private socket: _memory_exchange), agree on the problems, and activate the workspace. Raises
    RuntimeError (on every process) when some peers cannot reach each other by peer memory."""
    local = {d: i for i, d in enumerate(local_devices)}
    if not _distributed.is_multiprocess():
        _raise_or_activate(native, native.connect([[local[p] for p in groups[d][1]] for d in local_devices]))
        return
    # Every device of the mesh is a key of `groups`.
    with MemoryExchange(native, key, name, local_devices, list(groups), SETUP_TIMEOUT_S) as exchange:
        problems: list[str] = []
        peers: list[list[int | tuple[int, int, int, int]]] = []
        for d in local_devices:
            rank, group = groups[d]
            row: list[int | tuple[int, int, int, int]] = []
            for r, peer in enumerate(group):
                if peer in local:
                    row.append(local[peer])
                elif (host := exchange.host_of(peer.id)) != socket.gethostname():
                    problems.append(
                        f"CP rank {rank} on {socket.gethostname()} -> CP rank {r} on {host}: another host"
                    )
                elif reason := ext.peer_unreachable_reason(d.local_hardware_id, pci_of[peer.id]):
                    problems.append(f"CP rank {rank} -> CP rank {r}: {reason}")
                else:
                    try:
                        row.append(exchange.memory_of(peer.id))
                    except PeerMemoryError as err:
                        problems.append(f"CP rank {rank} -> CP rank {r}: {err}")
            peers.append(row)
        if not problems:
            problems = native.connect(peers)
        # Also the barrier after which no process fetches any more: the sockets may close.
        problems = sum(_distributed.exchange(f"{key}/problems", problems, SETUP_TIMEOUT_S), [])
    _raise_or_activate(native, problems)


def _raise_or_activate(native, problems: list[str]) -> None:
    if problems:
        raise RuntimeError(
            "jax_cpgrad: these CP peers cannot reach each other by peer memory, so the peer "
            "transport cannot run on this mesh; call grad_return/all_gather without a workspace "
            "to use the XLA transport instead:\n  " + "\n  ".join(problems)
        )
    native.activate()
