"""The exchange that lets every process of a job map its peers' workspace memory (one host).

Each process publishes public facts in the key-value store (host, pid, socket path, its device
ids), serves its exported memory on its socket to the job's other processes of its host, and
fetches theirs from their sockets (_peer_memory). Everything read from the store is checked
before use, and the same check runs on every process, so a bogus or truncated entry stops every
process with the same message.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable

import jax

from . import _distributed, _peer_memory

# Tests only: called with every process's facts once this process serves its memory, before it
# fetches its peers' (the security tests send an intruder then).
serving_hook: Callable[[list[dict]], None] | None = None


def _bad_entry(key: str, p: int, why: str) -> RuntimeError:
    return RuntimeError(
        f"jax_cpgrad: process {p}'s entry {key!r} in the jax.distributed key-value store is not what "
        f"jax_cpgrad writes ({why}): was it truncated, or written by something else? Every process "
        "stops creating this workspace."
    )


def check_facts(key: str, p: int, entry, devices: set[int]) -> dict:
    """Process ``p``'s facts, checked: a host, a pid, an absolute socket path, and exactly the
    device ids ``devices`` that the mesh gives that process."""
    if not isinstance(entry, dict):
        raise _bad_entry(key, p, f"a {type(entry).__name__}, not an object")
    host, pid, path, listed = (entry.get(k) for k in ("host", "pid", "socket", "devices"))
    if not isinstance(host, str) or not host:
        raise _bad_entry(key, p, f"host {host!r}")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise _bad_entry(key, p, f"pid {pid!r}")
    if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
        raise _bad_entry(key, p, f"socket path {path!r}")
    if (
        not isinstance(listed, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in listed)
        or sorted(listed) != sorted(devices)
    ):
        raise _bad_entry(key, p, f"devices {listed!r}, but the mesh gives it {sorted(devices)}")
    return entry


def _regions(payload, fds: list[int], devices: set[int]) -> dict[int, tuple[int, int, int, int]]:
    """{device id: (header fd, header bytes, slots fd, slots bytes)} from a peer's answer."""
    rows = payload.get("devices") if isinstance(payload, dict) else None
    if (
        not isinstance(rows, list)
        or len(fds) != 2 * len(rows)
        or not all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and v > 0 for v in r[1:])
            for r in rows
        )
        or {r[0] for r in rows} != devices
    ):
        raise _peer_memory.PeerMemoryError(
            f"its answer ({str(payload)[:200]}, {len(fds)} descriptors) does not describe its devices "
            f"{sorted(devices)}"
        )
    return {d: (fds[2 * i], hb, fds[2 * i + 1], sb) for i, (d, hb, sb) in enumerate(rows)}


class MemoryExchange:
    """Within ``with``: every process of the job serves its memory and may fetch its peers'.
    Leave the block only after every process has fetched what it needs (after an exchange of
    the problems, say): leaving closes this process's socket."""

    def __init__(
        self, native, key: str, name: str, local_devices: list, mesh_devices: list, timeout_s: float
    ):
        self._key, self._name, self._timeout_s = f"{key}/peers", name, timeout_s
        self._native, self._local = native, local_devices
        self._devices_of: dict[int, set[int]] = {}
        for d in mesh_devices:
            self._devices_of.setdefault(d.process_index, set()).add(d.id)
        self._server: _peer_memory.MemoryServer | None = None
        self._fetched: dict[int, dict[int, tuple[int, int, int, int]] | str] = {}
        self._received: list[int] = []

    def __enter__(self) -> MemoryExchange:
        try:
            exported = self._native.export_memory()
            payload = {
                "devices": [[d.id, hb, sb] for d, (_, hb, _, sb) in zip(self._local, exported, strict=True)]
            }
            fds = [fd for h_fd, _, s_fd, _ in exported for fd in (h_fd, s_fd)]
            self._server = _peer_memory.MemoryServer(fds, payload)
        except Exception as err:  # the others must not wait for this process's facts
            _distributed.publish(self._key, {"error": f"{type(err).__name__}: {err}"})
            raise
        try:
            self._start()
        except BaseException:
            self._server.close()
            raise
        return self

    def _start(self) -> None:
        assert self._server is not None
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "socket": self._server.path,
            "devices": [d.id for d in self._local],
        }
        entries = _distributed.exchange(self._key, mine, self._timeout_s)
        for p, entry in enumerate(entries):
            if isinstance(entry, dict) and "error" in entry:
                raise RuntimeError(
                    f"jax_cpgrad: process {p} could not create its part of workspace {self._name!r}: "
                    f"{entry['error']}"
                )
        self._facts = [
            check_facts(self._key, p, e, self._devices_of.get(p, set())) for p, e in enumerate(entries)
        ]
        self._process_of = {d: p for p, e in enumerate(self._facts) for d in e["devices"]}
        me = jax.process_index()
        self._server.serve(
            e["pid"] for p, e in enumerate(self._facts) if p != me and e["host"] == mine["host"]
        )
        if serving_hook is not None:
            serving_hook(self._facts)

    def host_of(self, device_id: int) -> str:
        return self._facts[self._process_of[device_id]]["host"]

    def memory_of(self, device_id: int) -> tuple[int, int, int, int]:
        """The memory of a peer device on this host: (header fd, header bytes, slots fd, slots
        bytes), fetched from its process once. Raises PeerMemoryError naming that process."""
        p = self._process_of[device_id]
        if p not in self._fetched:
            facts = self._facts[p]
            try:
                payload, fds = _peer_memory.fetch(facts["socket"], facts["pid"], self._timeout_s)
                self._received += fds
                self._fetched[p] = _regions(payload, fds, self._devices_of[p])
            except _peer_memory.PeerMemoryError as err:
                self._fetched[p] = f"process {p} (pid {facts['pid']}): {err}"
        got = self._fetched[p]
        if isinstance(got, str):
            raise _peer_memory.PeerMemoryError(got)
        return got[device_id]

    def __exit__(self, *exc) -> None:
        for fd in self._received:  # the mappings keep the memory; the descriptors are done
            os.close(fd)
        self._received = []
        assert self._server is not None
        self._server.close()
        for pid, uid in self._server.refused:
            warnings.warn(
                f"jax_cpgrad: workspace {self._name!r} refused its memory to pid {pid} (uid {uid}), "
                "which is not one of this job's processes of this user",
                stacklevel=2,
            )
