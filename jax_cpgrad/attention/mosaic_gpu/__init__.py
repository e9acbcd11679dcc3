"""Pallas Mosaic GPU attention kernels for Hopper (sm_90).

- ``forward.py``: the forward, ``forward(q, k, v, vis, *, scale, config=None) -> (out, lse)``;
- ``config.py``: its ``Config``, ``default_config`` and limits (``check``, ``check_device``);
- ``backward.py``: the dQ and dK/dV kernels, ``backward(...)`` with ``BackwardConfig``;
- ``turns.py``: the ping-pong turns of a kernel's two consumers (the forward's; the backward's
  with ``BackwardConfig.pingpong``); ``packed_plan.py``: a kernel's mask operands as one array;
- ``prime_forward`` and ``prime_backward``: a mask's tile plans made ahead of the calls (the layer
  makes them with its masks, outside its custom VJP).

Inside ``jax.shard_map`` (the layer calls them there) the kernels read their plan scalars with
``forward.read_scalar`` and type their results with ``forward.varying_like``: see why there.

Nothing here touches a device at import: ``check_device`` reads ``jax.local_devices()`` when
called, so the package imports (and lowers with ``jax.export``) on a machine without a GPU.
"""

from .backward import BackwardConfig, backward, prime_backward
from .config import Config, check, check_device, default_config
from .forward import forward, prime_forward

__all__ = [
    "BackwardConfig",
    "Config",
    "backward",
    "check",
    "check_device",
    "default_config",
    "forward",
    "prime_backward",
    "prime_forward",
]
