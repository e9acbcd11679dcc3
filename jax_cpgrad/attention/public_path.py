"""The layer through public jax API only: used when this jax lacks the private cuDNN primitives.

K/V are gathered with :func:`jax_cpgrad.all_gather` (its VJP returns dK/dV), and each query
chunk attends with ``jax.nn.dot_product_attention`` and a boolean mask of global positions,
differentiated by jax. Exact, but cuDNN cannot skip the masked tiles (it reads the mask as an
additive bias): chunk r against the first N chunks of keys, chunk 2N-1-r against all of them,
about 1.5x the causal work plus the bias, and nothing runs beside the gather.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from ..api import all_gather

Implementation = Literal["xla", "cudnn"]


def attention(
    q, k, v, *, axis_name: str, spec, rank, n: int, causal: bool, scale: float, implementation: Implementation
):
    """The rank's output [B, T, N, H] (``implementation``: jax.nn.dot_product_attention's)."""
    k_glob, v_glob = all_gather((k, v), axis_name=axis_name, seq_axis=1, workspace=spec) if n > 1 else (k, v)
    attend = lambda q, k, v, mask: jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, implementation=implementation
    )
    if not causal:
        return attend(q, k_glob, v_glob, None)
    c = q.shape[1] // 2
    first = rank * c + jnp.arange(c)  # global positions of the rank's two query chunks
    second = (2 * n - 1 - rank) * c + jnp.arange(c)
    keys_a = n * c  # chunk r < N never needs more than the first N chunks
    mask_a = (jnp.arange(keys_a)[None, :] <= first[:, None])[None, None]
    mask_b = (jnp.arange(2 * n * c)[None, :] <= second[:, None])[None, None]
    out_a = attend(q[:, :c], k_glob[:, :keys_a], v_glob[:, :keys_a], mask_a)
    out_b = attend(q[:, c:], k_glob, v_glob, mask_b)
    return jnp.concatenate([out_a, out_b], axis=1)
