"""The log-sum-exp merge of parts of the same queries' attention (each part: the rows against
some of the keys).

With L = logsumexp_p L_p and w_p = exp(L_p - L), the whole's output is sum_p w_p O_p: what a
rank's local and remote parts add up to (``schedule.py``), and what a kernel that continues a
previous part's (out, lse) computes in place of it (``kernels.masked_forward``'s ``prev``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from .rounding import rounded

F32 = jnp.float32


def merge(*parts, rounding=rounded):
    """(out, lse) of parts of the same queries' attention, each an (out, lse) pair: summed in
    float32, rounded once to the first part's dtype (with ``rounding``)."""
    lse = functools.reduce(jnp.logaddexp, [lp for _, lp in parts])  # finite: every query sees its own key
    # [B, N, ...rows] -> [B, ...rows, N, 1]: the rows are T, or 2 x span (update_segments' view)
    weight = lambda lp: jnp.moveaxis(jnp.exp(lp - lse), 1, -1)[..., None]
    out = sum(weight(lp) * op.astype(F32) for op, lp in parts)
    return rounding(out, parts[0][0].dtype), lse
