"""Test hooks, available only in test builds of the extension (JAX_CPGRAD_TEST_HOOKS=ON, what
scripts/setup.sh builds); a production build has none of them.

They are collective and must run on every process right after the workspace is created, before
any call on it.
"""

from __future__ import annotations

from ._native import HAS_TEST_HOOKS
from .workspace import native_of


def _native(ws):
    if not HAS_TEST_HOOKS:
        raise RuntimeError("this jax_cpgrad build has no test hooks: rebuild with JAX_CPGRAD_TEST_HOOKS=ON")
    return native_of(ws)


def set_epoch(ws, epoch: int) -> None:
    """Start the workspace's epochs at ``epoch`` (the wrap test starts just below 2^32)."""
    _native(ws).test_set_epoch(epoch % 2**32)


def remove_war_protection(ws) -> None:
    """Every call uses slot set 0: the write-after-read protection is gone (the race test's
    negative control shows that results then go wrong)."""
    _native(ws).test_set_single_buffer(True)


def skip_done_waits(ws) -> None:
    """The dones of an overlapped workspace's calls no longer make XLA's stream wait: the results
    are read while the workspace's stream may still write them (the overlap test's negative
    control shows that they then come out wrong)."""
    _native(ws).test_set_skip_join(True)


def delay_finishing(ws, rank: int, ns: int) -> None:
    """The GPU of CP rank ``rank`` waits ``ns`` nanoseconds before it reads each tile (device
    protocol) or each call's slots (memop protocol): a slow owner, whose peers run ahead
    into the next call. With the protection removed that overwrites what it has not read yet."""
    _native(ws).test_set_finish_delay(rank, ns)
