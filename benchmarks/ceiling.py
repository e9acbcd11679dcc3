"""The physical ceiling of a CP gradient return or gather on the GPUs of a workspace.
The ceiling column of grad_return.py's tables (the results' finding 1); not run alone.

Every GPU pushes its bytes to every peer at once (the transfer part), then the owner's local
memory traffic runs at device-copy speed (the accumulation of grad_return, the layout of
all_gather). Both parts are measured on the same GPUs, in the same run, with the native
benchmark module (`jax_cpgrad.benchmarking.bench_ext`, None in a CPU-only build).

The native contract this module codes against:

- ``ws.push_targets()`` -> one entry per GPU of this process in the workspace:
  ``(cuda_ordinal, rank, pci_bus_id, [(device_pointer, owner_pci_bus_id), ...])``, one target
  per peer owner in rotated order, each writable for ``ws.slot_bytes`` bytes;
- ``bench_ext.push_bandwidth(members, bytes_per_peer, iters, reps, engine)`` with
  ``members = [(cuda_ordinal, [device_pointer, ...]), ...]`` and engine ``"sm"`` (rotated store
  kernel) or ``"ce"`` (copy engines, one stream per peer) -> ``{"median_ms", "min_ms", "max_ms"}``
  per push (already divided by ``iters``), for the slowest local GPU;
- ``bench_ext.copy_bench(src_ordinal, dst_ordinal, nbytes, iters, reps)`` -> the same keys for
  one plain copy of ``nbytes``.
"""

from __future__ import annotations

import itertools

ENGINES = ("sm", "ce")
BARRIER_TIMEOUT_S = 120.0
_barrier_ids = itertools.count()


def load_bench():
    """(the native benchmark module, None) or (None, why there is none)."""
    from jax_cpgrad.benchmarking import bench_ext

    if bench_ext is None:
        return None, "the native benchmark module was not built (CPU-only build of jax_cpgrad)"
    return bench_ext, None


def _pci_key(bus_id: str):
    """A PCI bus id in a comparable form: '0000:18:00.0' and '00000000:18:00.0' are one GPU."""
    text = str(bus_id).strip().lower()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return text


def check_cross_gpu(targets) -> None:
    """ValueError if any writer's target lies on the writer's own GPU: a copy within one GPU
    measures HBM, not the links between GPUs, so it is no cross-GPU ceiling."""
    same = [
        f"CP rank {rank} (GPU {ordinal}, {pci}) -> peer {p} at {owner_pci}"
        for ordinal, rank, pci, peers in targets
        for p, (_, owner_pci) in enumerate(peers)
        if _pci_key(owner_pci) == _pci_key(pci)
    ]
    if same:
        raise ValueError(
            "push ceiling refused: these targets are on the writer's own GPU, so pushing "
            "to them is a device copy, not a transfer between GPUs: " + "; ".join(same)
        )


def _default_sync(name: str) -> None:
    """Every process of a multi-process run reaches this point before any goes on."""
    import jax

    if jax.process_count() > 1:
        from jax_cpgrad import benchmarking

        benchmarking.barrier(name, BARRIER_TIMEOUT_S)


def _seconds(result: dict) -> dict:
    return {
        "median_s": result["median_ms"] / 1e3,
        "min_s": result["min_ms"] / 1e3,
        "max_s": result["max_ms"] / 1e3,
    }


def push_ceiling(ws, bytes_per_peer: int, iters: int, reps: int, *, bench=None, sync=None) -> dict:
    """Time of every local GPU pushing ``bytes_per_peer`` to each of its peers at once.

    Collective in a multi-process run: every process calls it at the same point (each pushes
    from its own GPUs; a barrier before each engine makes them push at the same time). Measures
    both engines and keeps the faster: ``{"engine", "median_s", "min_s", "max_s", "engines": {...}}``.
    Raises ValueError, before anything is measured, when a target is on its writer's own GPU.
    """
    targets = list(ws.push_targets())
    check_cross_gpu(targets)
    if not any(peers for *_, peers in targets):
        raise ValueError("push ceiling refused: the workspace has no peers (R = 1)")
    slot_bytes = getattr(ws, "slot_bytes", None)
    if slot_bytes is not None and bytes_per_peer > slot_bytes:
        raise ValueError(
            f"push ceiling refused: {bytes_per_peer} bytes per peer exceed the workspace's "
            f"slot of {slot_bytes} bytes"
        )
    if bench is None:
        bench, why = load_bench()
        if bench is None:
            raise RuntimeError(f"no push ceiling: {why}")
    sync = sync or _default_sync
    members = [(int(ordinal), [int(ptr) for ptr, _ in peers]) for ordinal, _, _, peers in targets]
    engines = {}
    for engine in ENGINES:
        sync(f"jax_cpgrad_bench/ceiling/{next(_barrier_ids)}/{engine}")
        engines[engine] = _seconds(bench.push_bandwidth(members, int(bytes_per_peer), iters, reps, engine))
    best = min(engines, key=lambda e: engines[e]["median_s"])
    return {"engine": best, **engines[best], "bytes_per_peer": int(bytes_per_peer), "engines": engines}


def local_copy_bytes(op: str, n: int, local_bytes: int, tensors: int) -> int:
    """Bytes of the plain device copy whose memory traffic equals the owner's local work.

    A copy of B bytes reads B and writes B: 2B of traffic.
    - grad_return: the accumulation reads R contributions of local_bytes per tensor (its own from
      the input, R-1 from the slots) and writes one output: (R+1) * local_bytes * tensors of
      traffic, i.e. a copy of half that.
    - all_gather: the layout reads R pieces of local_bytes per tensor (its own from the input,
      R-1 from the slots) and writes all R into the global output: 2 * R * local_bytes * tensors
      of traffic, i.e. a copy of R * local_bytes * tensors (the global bytes).
    """
    if op == "grad_return":
        return (n + 1) * local_bytes * tensors // 2
    if op == "all_gather":
        return n * local_bytes * tensors
    raise ValueError(f"unknown op {op!r}")


def copy_time(ordinal: int, nbytes: int, iters: int, reps: int, *, bench=None) -> dict:
    """Median/min/max seconds of one plain device-to-device copy of ``nbytes`` within GPU ``ordinal``."""
    if bench is None:
        bench, why = load_bench()
        if bench is None:
            raise RuntimeError(f"no device copy timing: {why}")
    return _seconds(bench.copy_bench(int(ordinal), int(ordinal), max(int(nbytes), 256), iters, reps))


def first_ordinal(ws) -> int:
    """The CUDA ordinal of this process's first GPU in the workspace (where the copy is timed)."""
    return int(ws.push_targets()[0][0])


def ceilings(
    ws, ops, n: int, local_bytes: int, tensors: int, iters: int, reps: int, *, bench=None, sync=None
) -> dict:
    """For each op: the ceiling time of one call moving ``tensors`` tensors of ``local_bytes`` per
    rank = the push (every rank sends tensors * local_bytes to each peer, all at once) + a device
    copy with the op's local traffic (`local_copy_bytes`). Collective, like `push_ceiling`."""
    sync = sync or _default_sync
    push = push_ceiling(ws, tensors * local_bytes, iters, reps, bench=bench, sync=sync)
    ordinal = first_ordinal(ws)
    out = {}
    for op in ops:
        nbytes = local_copy_bytes(op, n, local_bytes, tensors)
        sync(f"jax_cpgrad_bench/ceiling/{next(_barrier_ids)}/copy")  # no peer still pushes into us
        copy = copy_time(ordinal, nbytes, iters, reps, bench=bench)
        out[op] = {
            "total_s": push["median_s"] + copy["median_s"],
            "push_s": push["median_s"],
            "push": push,
            "local_copy_s": copy["median_s"],
            "local_copy": {**copy, "bytes": nbytes},
        }
    return out
