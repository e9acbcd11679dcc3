"""What a call needs to know of its workspace: a small immutable description.

The API checks every call against it at trace time and lowers the call with it; a
:class:`jax_cpgrad.Workspace` has one (``ws.spec``). Being plain data, it also lets code be traced
and lowered for GPUs on machines that have none (the lowering tests do).
"""

from __future__ import annotations

import dataclasses

from ._native import DONE_TARGET, START_TARGETS, TARGETS

PROTOCOLS = ("device", "memop")


@dataclasses.dataclass(frozen=True)
class WorkspaceSpec:
    """id: the native workspace's id (an attribute of every call); name: for messages; axis_name
    and num_ranks: the mesh axis and its size R; nbytes: the most bytes one call moves per device,
    in local shapes; protocol: "device" (one kernel per call, device-resident epochs, CUDA-graph
    capturable) or "memop" (stream memory operations; for ranks that share a GPU); overlap: every
    call runs on the workspace's own stream, as a start/done pair (see Workspace); reach: the
    ranks whose data a call moves, 0 for every rank, k > 0 for those within k of the caller alone
    (a window's halo: 1; see :meth:`within`)."""

    id: int
    name: str
    axis_name: str
    num_ranks: int
    nbytes: int
    protocol: str
    overlap: bool = False
    reach: int = 0

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
        reach_ok = isinstance(self.reach, int) and not isinstance(self.reach, bool)
        if not reach_ok or not 0 <= self.reach < max(self.num_ranks, 1):
            raise ValueError(f"reach must be an int in [0, num_ranks), got {self.reach!r}")

    def within(self, reach: int) -> WorkspaceSpec:
        """This workspace, for calls that move only the data of ranks within ``reach`` of the
        caller (r - reach .. r + reach, no wrap-around): an all-gather gives zeros for the other
        ranks' chunks, a grad_return leaves their contributions out of its sum (they must be
        zeros for it to equal the whole sum). Every rank still signals every other, so calls
        with different reaches can follow one another on the workspace."""
        return dataclasses.replace(self, reach=reach)

    def target(self, op: str) -> tuple[str, bool]:
        """(FFI target name, has_side_effect) of a whole ``op`` ("grad_return" or "all_gather")."""
        return TARGETS[(op, self.protocol)]

    def start_target(self, op: str) -> tuple[str, bool]:
        """(FFI target name, has_side_effect) of the start of ``op`` (overlap=True)."""
        return START_TARGETS[(op, self.protocol)]

    done_target = DONE_TARGET

    def check_call(self, axis_name: str, num_ranks: int, nbytes: int, op: str) -> None:
        """ValueError at trace time for a call this workspace cannot serve."""
        if axis_name != self.axis_name:
            raise ValueError(
                f"jax_cpgrad.{op}: axis_name {axis_name!r} but workspace '{self.name}' "
                f"was created for axis {self.axis_name!r}"
            )
        if num_ranks != self.num_ranks:
            raise ValueError(
                f"jax_cpgrad.{op}: the {axis_name!r} axis has {num_ranks} devices but workspace "
                f"'{self.name}' was created for {self.num_ranks}"
            )
        if nbytes > self.nbytes:
            raise ValueError(
                f"jax_cpgrad.{op}: this call moves {nbytes} bytes per device (local shapes) "
                f"but workspace '{self.name}' holds {self.nbytes}: create it with a larger nbytes"
            )
