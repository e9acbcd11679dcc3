"""The jax.distributed key-value store: the one private JAX import of this package.

Workspaces use it to agree on their arguments and on errors, so that a problem seen by one process
is raised by every process instead of leaving the others waiting, and to publish the public facts
(pids, socket paths) with which the processes of a host pass each other their memory. The store is
unauthenticated: nothing published here may be a capability.
"""

from __future__ import annotations

import json

import jax


def _client():
    from jax._src.distributed import global_state  # private: kept to this module

    return global_state.client


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def publish(key: str, value) -> None:
    """Publish this process's JSON-able ``value`` under ``key``."""
    client = _client()
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, but this is a multi-process run")
    client.key_value_set_bytes(f"{key}/{jax.process_index()}", json.dumps(value).encode())


def collect(key: str, timeout_s: float) -> list:
    """Every process's value under ``key``, in process order (waiting up to ``timeout_s`` for each)."""
    client = _client()
    timeout_ms = int(timeout_s * 1000)
    out = []
    for p in range(jax.process_count()):
        try:
            raw = client.blocking_key_value_get_bytes(f"{key}/{p}", timeout_ms)
        except Exception as err:  # the client raises its own error type on timeout
            raise RuntimeError(
                f"jax_cpgrad: process {p} did not reach '{key}' within {timeout_s:.0f} s: did it fail "
                "(see its output), or do the processes not create the workspace with the same "
                "arguments, in the same order?"
            ) from err
        out.append(_decode(key, p, raw))
    return out


def _decode(key: str, p: int, raw) -> object:
    """Process ``p``'s value; every process reads the same bytes, so a bad entry fails them all alike."""
    try:
        return json.loads(raw)
    except (ValueError, TypeError) as err:  # UnicodeDecodeError is a ValueError
        raise RuntimeError(
            f"jax_cpgrad: process {p}'s entry '{key}/{p}' in the jax.distributed key-value store is "
            f"not JSON ({err}; {len(raw)} bytes): was it truncated, or written by something other "
            "than jax_cpgrad?"
        ) from err


def exchange(key: str, value, timeout_s: float) -> list:
    """Publish this process's ``value`` under ``key``; return every process's, in order."""
    publish(key, value)
    return collect(key, timeout_s)


def barrier(name: str, timeout_s: float) -> None:
    _client().wait_at_barrier(name, int(timeout_s * 1000))
