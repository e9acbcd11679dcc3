"""The project's Pallas Mosaic GPU kernels (``attention/mosaic_gpu/``) behind the layer's contract:
masked calls only, which express every mask the layer has (any causal offset, windows,
documents), so plain causal or full attention runs as masked calls too (``plan.RankPlan``'s
``plain_as_masked``); bfloat16/float16, head dims 64 and 128, Hopper GPUs (sm_90).

``implementation=None`` takes it for documents and windows on sm_90: the same bits every run
with no XLA flag, and many times faster than the masked XLA kernel. cuDNN expresses no documents
and no two-sided windows; for causal windows ours took 0.84-0.90 of its plain calls' time per
rank on an H200 at a window of 512 and 1.00-1.05x at 4096 (cuDNN's without the same bits every
run: ``implementation="cudnn"`` asks for them). Plain causal or full calls stay with cuDNN, whose
backward is faster than ours: per rank its split calls took 0.93-0.96 of our one masked call a
part (benchmarks/results/README.md, findings 6, 11 and 13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import mosaic_gpu
from ..mosaic_gpu import config as mosaic_config
from ..mosaic_gpu.backward import HEAD_DIMS  # the backward's (the forward also takes 256)
from .contract import Kernel


def refuses(dtype, head_dim: int) -> str | None:
    """What these inputs lack for the Pallas kernels here ("implementation='mosaic' needs ..."),
    or None."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in mosaic_config.DTYPES]:
        return f"bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if head_dim not in HEAD_DIMS:
        return f"a head dim of {' or '.join(map(str, HEAD_DIMS))}, got {head_dim}"
    device = jax.local_devices()[0]
    if mosaic_config.compute_capability(device) != mosaic_config.COMPUTE_CAPABILITY:
        return (
            f"a Hopper GPU (compute capability {mosaic_config.COMPUTE_CAPABILITY}), not {device.device_kind}"
        )
    return None


KERNEL = Kernel(
    "mosaic",
    masked_forward=mosaic_gpu.forward,
    masked_backward=mosaic_gpu.backward,
    prime=lambda q, k, vis: mosaic_gpu.prime_backward(q, k, mosaic_gpu.prime_forward(q, k, vis)),
    refuses=refuses,
    where="on sm_90 GPUs",
    plain_as_masked=True,
    rows_in_place=True,
    continues=True,
)
