"""Numpy oracles and small helpers shared by the tests (no JAX collectives involved)."""

from __future__ import annotations

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

DTYPES = ["float32", "bfloat16", "float16"]


def np_dtype(name: str):
    return np.dtype(jax.numpy.dtype(name))


def random_array(rng, shape, dtype: str):
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))


def owner_rows(x, owner: int, n: int, seq_axis: int):
    """Chunks (owner, 2n-1-owner) of a natural-order global array, concatenated."""
    chunks = np.split(x, 2 * n, axis=seq_axis)
    return np.concatenate([chunks[owner], chunks[2 * n - 1 - owner]], axis=seq_axis)


def in_reach(a: int, b: int, reach: int) -> bool:
    """Ranks a and b within a call's reach of each other (``WorkspaceSpec.within``; 0: all)."""
    return reach == 0 or abs(a - b) <= reach


def grad_return_oracle(per_writer, n: int, seq_axis: int, reach: int = 0):
    """Owner o's result: sum over writers 0..n-1 (those within ``reach`` of o) of their chunks
    for o, float32, rounded once."""
    out = []
    for o in range(n):
        acc = None
        for w in range(n):
            if not in_reach(w, o, reach):
                continue
            part = owner_rows(per_writer[w], o, n, seq_axis).astype(np.float32)
            acc = part if acc is None else acc + part
        out.append(acc.astype(per_writer[0].dtype))
    return out


def all_gather_oracle(per_rank_local, n: int, seq_axis: int, reach: int = 0, rank: int = 0):
    """Natural-order global array from every rank's two local chunks (as ``rank`` gets it: zeros
    for the chunks of ranks out of ``reach``)."""
    chunks = [None] * (2 * n)
    for r, local in enumerate(per_rank_local):
        if not in_reach(r, rank, reach):
            local = np.zeros_like(local)
        first, second = np.split(local, 2, axis=seq_axis)
        chunks[r], chunks[2 * n - 1 - r] = first, second
    return np.concatenate(chunks, axis=seq_axis)


def bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))
