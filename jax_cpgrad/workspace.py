"""The peer transport's workspace: symmetric buffers and epoch flags on every GPU of a mesh axis.

A workspace is collective: every process calls ``Workspace(...)`` with the same arguments, in
the same order relative to other workspaces, and so with ``close()``. Its memory is allocated
outside XLA, so create it before XLA takes the GPU's memory or leave XLA room (see the
out-of-memory error's advice).
"""

from __future__ import annotations

import atexit
import itertools
import os
import warnings
import weakref

import jax
import numpy as np

from . import _distributed, _setup
from ._native import HAS_CUDA, MAX_RANKS, ext, require_cuda
from .spec import PROTOCOLS, WorkspaceSpec

DEFAULT_TIMEOUT_S = 600.0  # like NCCL's and PyTorch's default collective timeouts
# The device protocol's share of each GPU: by default every SM (one block each) per call, half of
# them pushing and half finishing. On 2 H200s (README "Results") that was the fastest of the
# budgets swept from 64 KiB to 1 GiB; lower sm_budget to leave SMs to kernels XLA runs beside it.
DEFAULT_PUSH_SHARE = 0.5
# How processes pass each other their memory: file descriptors over a private socket, between the
# processes of one host (docs/peer-memory.md); "fabric" handles are detected, not exchanged yet.
HANDLE_TYPES = ("posix_fd", "fabric")
PROTOCOL_CHOICES = ("auto", *PROTOCOLS)  # "auto": device where every rank has its own GPU, else memop
ON_TIMEOUT_CHOICES = ("raise", "abort")
_creation_counter = itertools.count()
_open_workspaces: weakref.WeakSet[Workspace] = weakref.WeakSet()


def workspace_bytes(num_ranks: int, nbytes: int) -> int:
    """Device memory a Workspace(nbytes=...) holds on each GPU of an R-way CP group (R =
    ``num_ranks``): two sets (double buffering) of R slots of ``nbytes``, plus the flags (8 KiB per
    rank) and two sets of R slots for the device protocol's small calls (LL words: twice
    ``nbytes``, at most 512 KiB each). One workspace serves every layer and microbatch, so this
    does not grow with the model's depth."""
    return int(ext.region_bytes(num_ranks, nbytes))


def _one_of(choices: tuple) -> str:
    """The choices as a message lists them: 'a', 'b' or 'c'."""
    quoted = [repr(c) for c in choices]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _default_timeout() -> float:
    return float(os.environ.get("JAX_CPGRAD_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _check_arguments(
    mesh, axis_name, nbytes, protocol, sm_budget, push_share, on_timeout, overlap, handle_type
) -> int:
    """ValueError for arguments no process could use; returns R, the CP size."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int (bytes per call per device), got {nbytes!r}")
    if protocol not in PROTOCOL_CHOICES:
        raise ValueError(f"protocol must be {_one_of(PROTOCOL_CHOICES)}, got {protocol!r}")
    if sm_budget is not None and (not isinstance(sm_budget, int) or sm_budget < 2):
        raise ValueError(f"sm_budget must be an int >= 2 (SMs one call may occupy), got {sm_budget!r}")
    if push_share is not None and not 0 < push_share <= 1:
        raise ValueError(f"push_share must be in (0, 1], got {push_share!r}")
    if on_timeout not in ON_TIMEOUT_CHOICES:
        raise ValueError(f"on_timeout must be {_one_of(ON_TIMEOUT_CHOICES)}, got {on_timeout!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    if handle_type not in HANDLE_TYPES:
        raise ValueError(f"handle_type must be one of {HANDLE_TYPES}, got {handle_type!r}")
    num_ranks = int(mesh.shape[axis_name])
    if num_ranks > MAX_RANKS:
        raise ValueError(
            f"the {axis_name!r} axis has {num_ranks} devices (CP ranks); at most {MAX_RANKS} are supported"
        )
    not_gpu = sorted({d.platform for d in mesh.devices.flat} - {"gpu", "cuda"})
    if not_gpu:
        raise ValueError(
            f"the peer transport needs GPUs, but the mesh has {', '.join(not_gpu)} devices: "
            "use grad_return/all_gather without a workspace (the XLA transport) there"
        )
    return num_ranks


def _device_blocks(
    local_devices, sm_budget: int | None, push_share: float | None, overlap: bool = False
) -> tuple[int, int]:
    """(blocks, pushing blocks) of a device-protocol call on this process's GPUs: at most the SM
    budget and the GPU's SMs, one block per SM; push_share 1 means every block pushes, then
    finishes. An overlapped workspace's calls run beside other kernels, so by default they take
    half the SMs: kernels that wait for peers must all fit on the GPU together, or two of them
    resident in a different order on two GPUs would wait for each other until the timeout."""
    sms = min((ext.multiprocessor_count(d.local_hardware_id) for d in local_devices), default=2)
    budget = min(sm_budget or (max(2, sms // 2) if overlap else sms), sms)
    share = push_share or DEFAULT_PUSH_SHARE
    return budget, budget if share >= 1 else max(1, min(budget - 1, round(budget * share)))


def _fabric_support(local_devices) -> bool:
    return all(ext.memory_support(d.local_hardware_id)["fabric"] for d in local_devices)


def _check_handle_type(handle_type: str, fabric_supported: bool) -> None:
    """Raise where this process cannot pass its memory the way asked (every process then raises)."""
    if handle_type == "posix_fd":
        return
    if not fabric_supported:
        raise RuntimeError(
            "jax_cpgrad: handle_type='fabric' needs GPUs that export fabric handles "
            "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: hosts of one NVLink domain with IMEX, "
            "e.g. GB200 NVL72), and this process's GPUs do not; use handle_type='posix_fd' (the "
            "default) between the processes of one host"
        )
    raise NotImplementedError(
        "jax_cpgrad: handle_type='fabric': these GPUs export fabric handles, but jax_cpgrad does not "
        "exchange them between hosts yet (docs/peer-memory.md says how it would); use "
        "handle_type='posix_fd' (the default) between the processes of one host"
    )


class Workspace:
    """Symmetric slot buffers and epoch flags for ``grad_return`` / ``all_gather`` on a mesh axis.

    Args:
      mesh: the ``jax.sharding.Mesh`` the ``shard_map`` runs over.
      axis_name: the context-parallel axis of ``mesh``.
      nbytes: capacity of one call, per device: the bytes of all tensors of a call in their
        local (per-rank) shape, e.g. ``dk_local.nbytes + dv_local.nbytes``. Each device holds
        ``workspace_bytes(R, nbytes)`` for R CP ranks (double-buffered slots and the flags).
      timeout_s: how long a device waits for its peers at one call before the call fails
        (default 600 s, or ``JAX_CPGRAD_TIMEOUT_S``); 0 waits forever.
      name: shown in error messages.
      protocol: ``"device"`` (one kernel per call that pushes, signals and waits from the GPU,
        with the epoch in device memory: the fastest, and XLA records it into CUDA graphs),
        ``"memop"`` (a copy kernel, CUDA stream memory operations to signal and wait, a sum
        kernel: for ranks that share one GPU), or ``"auto"`` (device when every rank has its own
        GPU, memop otherwise).
      sm_budget: device protocol: the most SMs one call occupies (default: all of the GPU's, or half
        with overlap=True); a lower budget leaves SMs to kernels XLA runs beside it.
      push_share: device protocol: the share of those SMs that push (the rest finish); 1: every
        block pushes its share, then finishes its share.
      on_timeout: ``"raise"`` (the call's outputs are NaN, the workspace fails, ``check()``
        raises) or ``"abort"`` (the process aborts after printing the message, for schedulers
        that restart failed jobs).
      overlap: run every call on a stream of the workspace's own, as a start/done pair of custom
        calls, so that work placed between them runs beside the transfer:
        :func:`jax_cpgrad.all_gather_overlapped` and :func:`jax_cpgrad.grad_return_overlapped`
        place given work there (and its VJP beside the transposed call). Plain calls on such a
        workspace are a start and its done with nothing placed between on purpose. Pairs are
        never recorded into CUDA graphs (XLA splits its graphs around them). The device protocol
        then takes half the SMs unless ``sm_budget`` says otherwise; keep the budgets of
        device-protocol calls that may run at once (this workspace's and another's, placed
        between a start and its done) within the GPU's SMs. Off by default: that it pays has not
        been measured on GPUs with their own links yet (README, Results).
      handle_type: how the processes of the job pass each other their workspace memory:
        ``"posix_fd"`` (default: file descriptors over a Unix socket that only this user's
        processes of the job may use, between the processes of one host) or ``"fabric"``
        (``CU_MEM_HANDLE_TYPE_FABRIC``, hosts of one NVLink domain): fails with a clear error where
        the GPUs cannot export fabric handles, and with NotImplementedError where they can (the
        exchange between hosts is not built; docs/peer-memory.md). ``fabric_supported`` says which.
    """

    def __init__(
        self,
        mesh,
        axis_name: str = "cp",
        nbytes: int = 0,
        *,
        timeout_s: float | None = None,
        name: str | None = None,
        protocol: str = "auto",
        sm_budget: int | None = None,
        push_share: float | None = None,
        on_timeout: str = "raise",
        overlap: bool = False,
        handle_type: str = "posix_fd",
    ):
        num_ranks = _check_arguments(
            mesh, axis_name, nbytes, protocol, sm_budget, push_share, on_timeout, overlap, handle_type
        )
        nbytes = int(nbytes)
        require_cuda("jax_cpgrad.Workspace")
        self._closed = True
        self._native: ext.NativeWorkspace | None = None
        self._failure = ""
        self.mesh = mesh
        timeout_s = _default_timeout() if timeout_s is None else float(timeout_s)
        key = f"jax_cpgrad/ws{next(_creation_counter)}"
        name = name or key
        groups = _setup.cp_groups(mesh, axis_name)
        me = jax.process_index()
        self._local = [d for d in mesh.devices.flat if d.process_index == me]
        arguments = [
            axis_name,
            num_ranks,
            nbytes,
            timeout_s,
            protocol,
            sm_budget,
            push_share,
            on_timeout,
            overlap,
            handle_type,
            [d.id for d in mesh.devices.flat],
        ]
        self._pci_of = _setup.gpu_ids(key, arguments, self._local)  # agreed before allocating
        resolved = _setup.resolve_protocol(protocol, _setup.shared_gpus(groups, self._pci_of))
        budget, push_blocks = _device_blocks(self._local, sm_budget, push_share, overlap)
        try:
            self._fabric_supported = _fabric_support(self._local)
            _check_handle_type(handle_type, self._fabric_supported)
            native = ext.NativeWorkspace(
                name,
                num_ranks,
                nbytes,
                timeout_s,
                resolved,
                budget,
                push_blocks,
                on_timeout == "abort",
                overlap,
                [(d.local_hardware_id, groups[d][0]) for d in self._local],
            )
        except Exception as err:
            _setup.publish_failure(key, err)
            raise
        try:
            _setup.connect(native, key, name, self._local, groups, self._pci_of)
        except BaseException:
            native.begin_close()
            native.finish_close()
            raise
        self._native = native
        self._key = key
        self.timeout_s = timeout_s
        self.spec = WorkspaceSpec(
            id=native.id,
            name=name,
            axis_name=axis_name,
            num_ranks=num_ranks,
            nbytes=nbytes,
            protocol=resolved,
            overlap=overlap,
        )
        self.sm_budget, self.push_blocks = budget, push_blocks
        self._closed = False
        _open_workspaces.add(self)

    @property
    def _open_native(self) -> ext.NativeWorkspace:
        if self._native is None:
            raise ValueError(f"workspace '{self.name}' is closed")
        return self._native

    # -- what calls see --------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def axis_name(self) -> str:
        return self.spec.axis_name

    @property
    def num_ranks(self) -> int:
        """R: the CP size, the devices of the mesh axis."""
        return self.spec.num_ranks

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def protocol(self) -> str:
        """ "device" or "memop": the protocol this workspace runs (``protocol="auto"`` resolved)."""
        return self.spec.protocol

    @property
    def fabric_supported(self) -> bool:
        """Whether every GPU of this process can export its memory as a fabric handle
        (``CU_MEM_HANDLE_TYPE_FABRIC``), the way ranks on several hosts of one NVLink domain would
        share memory (docs/peer-memory.md); ``handle_type="fabric"`` is refused where not."""
        return self._fabric_supported

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def bytes_per_device(self) -> int:
        """Device memory this workspace holds on each GPU."""
        return workspace_bytes(self.num_ranks, self.nbytes)

    def status(self) -> dict:
        """Epochs, failure state and sizes, for diagnostics."""
        if self._native is None:
            return {"name": self.name, "protocol": self.protocol, "closed": True, "failure": self._failure}
        return dict(self._native.status(), closed=self._closed)

    def check(self) -> None:
        """Raise RuntimeError if a call on this workspace timed out (the workspace is then unusable)."""
        failure = self._failure if self._native is None else self._native.status()["failure"]
        if failure:
            raise RuntimeError(failure)

    def push_targets(self) -> list:
        """For the benchmarks' ceiling (``benchmarks/ceiling.py``): per local GPU (CUDA ordinal, CP
        rank, PCI bus id, [(device pointer, owner's PCI bus id)] per peer in rotated order), each
        pointer where this rank may write up to ``slot_bytes`` into that owner's memory."""
        groups = _setup.cp_groups(self.mesh, self.axis_name)
        by_ordinal = {d.local_hardware_id: d for d in self._local}
        out = []
        for ordinal, rank, targets in self._open_native.push_targets():
            group = groups[by_ordinal[ordinal]][1]
            out.append(
                (
                    ordinal,
                    rank,
                    self._pci_of[by_ordinal[ordinal].id],
                    [(ptr, self._pci_of[group[owner].id]) for ptr, owner in targets],
                )
            )
        return out

    @property
    def slot_bytes(self) -> int:
        return self._open_native.slot_bytes

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the workspace. Collective, like creation: every process calls it, after the work
        that uses it. A function compiled earlier fails cleanly if called afterwards."""
        if self._closed:
            return
        native = self._open_native
        self._closed = True
        _open_workspaces.discard(self)
        problems = list(native.begin_close())
        self._failure = native.status()["failure"]
        if _distributed.is_multiprocess() and not self._failure:
            try:  # no peer may still write into our memory when we free it
                _distributed.barrier(
                    f"{self._key}/close",
                    min(self.timeout_s or _setup.SETUP_TIMEOUT_S, _setup.SETUP_TIMEOUT_S),
                )
            except Exception as err:  # a dead peer writes nothing more: free anyway, but say so
                problems.append(f"the closing barrier failed ({err}); a peer process probably died")
        problems += native.finish_close()
        self._native = None  # a closed workspace holds no native object
        if problems:
            warnings.warn(
                f"jax_cpgrad: closing workspace '{self.name}': " + "; ".join(problems), stacklevel=2
            )

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Workspace({self.name!r}, axis={self.axis_name!r}, num_ranks={self.num_ranks}, "
            f"nbytes={self.nbytes}, protocol={self.protocol!r}, {state})"
        )


def native_of(ws: Workspace) -> ext.NativeWorkspace:
    """The native workspace behind an open ``ws`` (for the test hooks, ``jax_cpgrad._testing``);
    ValueError once it is closed."""
    return ws._open_native


def _release_at_exit() -> None:
    # No barrier at exit (peers may be gone): stop the watchdog, free what this process holds.
    if not HAS_CUDA:
        return
    for ws in list(_open_workspaces):
        ws._closed = True
        native, ws._native = ws._native, None
        if native is not None:
            native.begin_close()
            native.finish_close()
    ext.watchdog_stop()


atexit.register(_release_at_exit)
