"""The peer transport's workspace: symmetric buffers and epoch flags on every GPU of a mesh axis.

A workspace is collective: every process calls ``Workspace(...)`` with the same arguments, in
the same order relative to other workspaces. Its memory is allocated outside XLA, so create it
before XLA takes the GPU's memory or leave XLA room (see the out-of-memory error's advice).
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import weakref

import jax
import numpy as np

from . import _distributed
from ._native import HAS_CUDA, MAX_RANKS, ext, require_cuda

DEFAULT_TIMEOUT_S = 600.0  # like NCCL's and PyTorch's default collective timeouts
_SETUP_TIMEOUT_S = 300.0
_creation_counter = itertools.count()
_open_workspaces: "weakref.WeakSet[Workspace]" = weakref.WeakSet()


def workspace_bytes(n: int, nbytes: int) -> int:
    """Device memory a Workspace(nbytes=...) holds on each GPU of an N-way CP group: two sets
    (double buffering) of N slots of ``nbytes``, plus 1 KiB of flags. One workspace serves every
    layer and microbatch, so this does not grow with the model's depth."""
    return int(ext.region_bytes(n, nbytes))


def _default_timeout() -> float:
    return float(os.environ.get("JAX_CPGRAD_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _cp_groups(mesh, axis_name: str):
    """For each device of the mesh: (its CP rank, the devices of its CP group in rank order)."""
    axis = mesh.axis_names.index(axis_name)
    devices = np.moveaxis(np.asarray(mesh.devices), axis, -1)
    groups = devices.reshape(-1, devices.shape[-1])
    return {dev: (rank, list(group)) for group in groups for rank, dev in enumerate(group)}


class Workspace:
    """Symmetric slot buffers and epoch flags for ``grad_return`` / ``all_gather`` on a mesh axis.

    Args:
      mesh: the ``jax.sharding.Mesh`` the ``shard_map`` runs over.
      axis_name: the context-parallel axis of ``mesh``.
      nbytes: capacity of one call, per device: the bytes of all tensors of a call in their
        local (per-rank) shape, e.g. ``dk_local.nbytes + dv_local.nbytes``. Each device holds
        ``2 * N * nbytes`` (double-buffered slots) plus 1 KiB of flags.
      timeout_s: how long a device waits for its peers at one call before the call fails
        (default 600 s, or ``JAX_CPGRAD_TIMEOUT_S``); 0 waits forever.
      name: shown in error messages.
    """

    def __init__(self, mesh, axis_name: str = "cp", nbytes: int = 0, *, timeout_s: float | None = None,
                 name: str | None = None, _initial_epoch: int = 0):
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int (bytes per call per device), got {nbytes!r}")
        n = int(mesh.shape[axis_name])
        if n > MAX_RANKS:
            raise ValueError(f"the {axis_name!r} axis has {n} devices; at most {MAX_RANKS} are supported")
        not_gpu = sorted({d.platform for d in mesh.devices.flat} - {"gpu", "cuda"})
        if not_gpu:
            raise ValueError(
                f"the peer transport needs GPUs, but the mesh has {', '.join(not_gpu)} devices: "
                "use grad_return/all_gather without a workspace (the XLA transport) there")
        require_cuda("jax_cpgrad.Workspace")
        self.mesh = mesh
        self.axis_name = axis_name
        self.n = n
        self.nbytes = int(nbytes)
        self.timeout_s = _default_timeout() if timeout_s is None else float(timeout_s)
        self._key = f"jax_cpgrad/ws{next(_creation_counter)}"
        self._handles_key = f"{self._key}/handles"
        self.name = name or self._key
        self._closed = True
        groups = _cp_groups(mesh, axis_name)
        me = jax.process_index()
        self._local = [d for d in mesh.devices.flat if d.process_index == me]
        if _distributed.is_multiprocess():
            self._agree_on_arguments(int(_initial_epoch))  # before anything is allocated
        try:
            self._native = ext.NativeWorkspace(
                self.name, n, self.nbytes, self.timeout_s, int(_initial_epoch) % 2**32,
                [(d.local_hardware_id, groups[d][0]) for d in self._local])
        except Exception as err:
            if _distributed.is_multiprocess():  # tell the peers now, instead of at their timeout
                _distributed.publish(self._handles_key, {"error": f"{type(err).__name__}: {err}"})
            raise
        try:
            self._connect(groups)
        except BaseException:
            self._native.release()
            raise
        self._closed = False
        _open_workspaces.add(self)

    # -- setup ---------------------------------------------------------------------------------

    def _agree_on_arguments(self, initial_epoch: int) -> None:
        config = [self.axis_name, self.n, self.nbytes, self.timeout_s, initial_epoch,
                  [d.id for d in self.mesh.devices.flat]]
        configs = _distributed.exchange(f"{self._key}/config", config, _SETUP_TIMEOUT_S)
        if any(c != configs[0] for c in configs):
            raise ValueError(
                "jax_cpgrad.Workspace was created with different arguments on different processes "
                "(axis, N, nbytes, timeout, initial epoch, mesh devices): " + "; ".join(
                    f"process {p}: {c}" for p, c in enumerate(configs)))

    def _connect(self, groups) -> None:
        local_index = {d: i for i, d in enumerate(self._local)}
        handles = self._native.ipc_handles()
        multi = _distributed.is_multiprocess()
        remote = {}
        if multi:
            mine = {str(d.id): [socket.gethostname(), ext.pci_bus_id(d.local_hardware_id), h.hex()]
                    for d, h in zip(self._local, handles)}
            for p, entries in enumerate(_distributed.exchange(self._handles_key, {"devices": mine},
                                                              _SETUP_TIMEOUT_S)):
                if "error" in entries:
                    raise RuntimeError(f"jax_cpgrad: process {p} could not create its part of workspace "
                                       f"{self.name!r}: {entries['error']}")
                remote.update({int(k): v for k, v in entries["devices"].items()})
        problems, peers = [], []
        for d in self._local:
            rank, group = groups[d]
            row = []
            for r, peer in enumerate(group):
                if peer in local_index:
                    row.append(local_index[peer])
                    continue
                host, pci, handle = remote[peer.id]
                if host != socket.gethostname():
                    problems.append(f"CP rank {rank} on {socket.gethostname()} -> CP rank {r} on {host}: another host")
                elif reason := ext.peer_unreachable_reason(d.local_hardware_id, pci):
                    problems.append(f"CP rank {rank} -> CP rank {r}: {reason}")
                row.append(bytes.fromhex(handle))
            peers.append(row)
        if not problems:
            problems = self._native.connect(peers)
        if multi:
            problems = sum(_distributed.exchange(f"{self._key}/problems", problems, _SETUP_TIMEOUT_S), [])
        if problems:
            raise RuntimeError(
                "jax_cpgrad: these CP peers cannot reach each other by peer memory, so the peer "
                "transport cannot run on this mesh; call grad_return/all_gather without a workspace "
                "to use the XLA transport instead:\n  " + "\n  ".join(problems))
        self._native.activate()

    # -- use -----------------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self._native.id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def bytes_per_device(self) -> int:
        """Device memory this workspace holds on each GPU."""
        return self._native.region_bytes_per_device

    def status(self) -> dict:
        """Epochs, failure state and sizes, for diagnostics."""
        return dict(self._native.status(), closed=self._closed)

    def check(self) -> None:
        """Raise RuntimeError if a call on this workspace timed out (the workspace is then unusable)."""
        status = self._native.status()
        if status["failed"]:
            raise RuntimeError(status["failure"])

    def check_call(self, axis_name: str, n: int, nbytes: int, op: str) -> None:
        """ValueError at trace time for a call this workspace cannot serve."""
        if self._closed:
            raise ValueError(f"jax_cpgrad.{op}: workspace '{self.name}' is closed")
        if axis_name != self.axis_name:
            raise ValueError(f"jax_cpgrad.{op}: axis_name {axis_name!r} but workspace '{self.name}' "
                             f"was created for axis {self.axis_name!r}")
        if n != self.n:
            raise ValueError(f"jax_cpgrad.{op}: the {axis_name!r} axis has {n} devices but workspace "
                             f"'{self.name}' was created for {self.n}")
        if nbytes > self.nbytes:
            raise ValueError(f"jax_cpgrad.{op}: this call moves {nbytes} bytes per device (local shapes) "
                             f"but workspace '{self.name}' holds {self.nbytes}: create it with a larger nbytes")

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the workspace. Collective, like creation: every process calls it."""
        if self._closed:
            return
        self._closed = True
        _open_workspaces.discard(self)
        self._native.quiesce()
        if _distributed.is_multiprocess() and not self._native.status()["failed"]:
            try:  # no peer may still write into our memory when we free it
                _distributed.barrier(f"{self._key}/close", min(self.timeout_s or _SETUP_TIMEOUT_S, _SETUP_TIMEOUT_S))
            except Exception:
                pass  # a dead peer writes nothing more
        self._native.release()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Workspace({self.name!r}, axis={self.axis_name!r}, n={self.n}, nbytes={self.nbytes}, {state})"


def _release_at_exit() -> None:
    # No barrier at exit (peers may be gone): stop the watchdog, free what this process holds.
    if not HAS_CUDA:
        return
    for ws in list(_open_workspaces):
        ws._closed = True
        ws._native.release()
    ext.watchdog_stop()


atexit.register(_release_at_exit)
