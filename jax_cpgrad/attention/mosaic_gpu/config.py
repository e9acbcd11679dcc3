"""The forward kernel's configuration and limits: what it supports, checked before tracing.

:class:`Config` is frozen and validated on construction; :func:`default_config` picks one per
head dimension; :func:`check` validates the inputs of a call (head dim, dtypes, shapes, the
visibility, the shared-memory budget) and :func:`check_device` the GPU. Every failure is a
``ValueError`` naming what is supported and what to use instead.

The device check reads ``jax.local_devices()[0]`` when it is called, never at import: importing
this package on a machine without a GPU (CI, interpret mode, lowering with ``jax.export``) is
always fine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

#: Head dimensions the kernel is built and tested for.
HEAD_DIMS = (64, 128, 256)
#: Element types of q, k and v (the wgmma operands); out has q's dtype, lse is float32.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: The GPU generation it is written for (wgmma, TMA and warpgroup register reallocation).
COMPUTE_CAPABILITY = "9.0"
#: Streaming multiprocessors of an H100/H200 SXM.
HOPPER_SXM_SMS = 132
#: Shared memory a Hopper thread block may use (227 KiB), less a little for barriers.
SMEM_BYTES = 227 * 1024 - 1024

_USE_INSTEAD = "use implementation='cudnn' or 'xla'"


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling and pipeline of the forward kernel.

    - ``block_q``: query rows per consumer warpgroup (the wgmma M: a multiple of 64);
    - ``block_k``: keys per key tile (the inner tile of the plan: a multiple of 64);
    - ``num_stages``: K/V tiles in flight in the shared-memory ring (>= 2);
    - ``consumers``: consumer warpgroups per thread block (1 or 2), each with its own block_q
      rows of the same query tile, sharing every K/V tile the producer loads; the thread
      block's query tile is ``consumers * block_q`` rows;
    - ``pingpong``: with two consumers, a named barrier makes them take turns on the tensor
      cores, so that one's softmax overlaps the other's matmuls (FA3's ping-pong schedule);
    - ``p_via_smem``: P (the probabilities, 16-bit) reaches the PV matmul through shared
      memory and a fresh accumulator instead of from registers into the carried one. GPU
      interpret mode simulates wgmma only with operands in memory and cannot run
      ``pl.run_state``, so interpret mode needs True; False (FA3: P stays in registers) is
      what the GPU should run. Both forms lower and are tested.
    """

    block_q: int = 64
    block_k: int = 128
    num_stages: int = 2
    consumers: int = 2
    pingpong: bool = True
    p_via_smem: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 64:
                raise ValueError(
                    f"Config.{name} must be a positive multiple of 64 (wgmma tiles), got {value!r}"
                )
        if self.block_k > 256:
            raise ValueError(f"Config.block_k must be at most 256 (the wgmma N), got {self.block_k}")
        if self.block_q > 128:
            raise ValueError(
                f"Config.block_q must be 64 or 128 (rows per consumer warpgroup), got {self.block_q}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(
                f"Config.num_stages must be an int >= 2 (at least a double buffer), got {self.num_stages!r}"
            )
        if self.consumers not in (1, 2):
            raise ValueError(f"Config.consumers must be 1 or 2 consumer warpgroups, got {self.consumers!r}")
        if self.pingpong and self.consumers != 2:
            raise ValueError(
                "Config.pingpong needs consumers=2 (two warpgroups take turns); set pingpong=False"
            )

    @property
    def tile_q(self) -> int:
        """Query rows per thread block: the outer tile of the plan."""
        return self.consumers * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the kernel allocates with this config (bytes)."""
        q_out = self.consumers * self.block_q * head_dim * itemsize  # Q, then the output tile
        kv = 2 * self.num_stages * self.block_k * head_dim * itemsize
        p = self.consumers * self.block_q * self.block_k * itemsize if self.p_via_smem else 0
        rows = self.consumers * self.block_q * 4 * 3  # row_lo, row_hi, lse
        return q_out + kv + p + rows

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


def default_config(head_dim: int, *, interpret: bool = False) -> Config:
    """The config to use for ``head_dim`` (FA3's tiles for Hopper; see forward.py's docstring).

    ``interpret=True`` gives the form GPU interpret mode can simulate (``p_via_smem``)."""
    check_head_dim(head_dim)
    if head_dim == 64:
        config = Config(block_q=64, block_k=128, num_stages=4)
    elif head_dim == 128:
        config = Config(block_q=64, block_k=128, num_stages=2)
    else:  # 256: the accumulator alone is 128 registers a thread; smaller key tiles
        config = Config(block_q=64, block_k=64, num_stages=2)
    return config.replace(p_via_smem=True) if interpret else config


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"implementation='mosaic' supports head dimensions {', '.join(map(str, HEAD_DIMS))}, "
            f"got {head_dim}; {_USE_INSTEAD}, or pad the head dimension"
        )


def check(q, k, v, vis, config: Config) -> None:
    """``ValueError`` unless the kernel supports these inputs with this config."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"implementation='mosaic': query [B, T, N, H], key and value [B, L, K, H], got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    B, T, N, H = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        raise ValueError(
            f"implementation='mosaic': key and value must be [B, L, K, H] with q's B={B} and H={H}, "
            f"got key {k.shape}, value {v.shape}"
        )
    K = k.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"implementation='mosaic': the KV heads K={K} must divide the query heads N={N}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise ValueError(
            "implementation='mosaic' supports query, key and value of one dtype, bfloat16 or float16, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}; cast them, or {_USE_INSTEAD} (float32)"
        )
    check_head_dim(H)
    L = k.shape[1]
    if vis.row_lo.ndim == 2:  # the call's rows: q's first T (q may hold more, read in place)
        T = vis.row_lo.shape[1]
        if T > q.shape[1]:
            raise ValueError(
                f"implementation='mosaic': vis describes {T} query rows, more than q's {q.shape[1]}"
            )
    for name, length, letter in (
        ("row_lo", T, "T"),
        ("row_hi", T, "T"),
        ("col_lo", L, "L"),
        ("col_hi", L, "L"),
    ):
        a = getattr(vis, name)
        if a.ndim != 2 or a.shape[0] not in (1, B) or a.shape[1] != length:
            raise ValueError(
                f"implementation='mosaic': vis.{name} must be [1 or B={B}, {letter}={length}], got {a.shape}"
            )
    need = config.smem_bytes(H)
    if need > SMEM_BYTES:
        raise ValueError(
            f"implementation='mosaic': {config} needs {need} bytes of shared memory for head dim {H}, "
            f"more than the {SMEM_BYTES} a Hopper thread block has; lower num_stages or block_k "
            f"(default_config({H}) fits)"
        )


def sm_count(device=None) -> int:
    """The device's streaming multiprocessors; an H100/H200 SXM's 132 where the device is not a
    GPU (lowering for CUDA on a CPU, interpret mode) or does not say."""
    device = jax.local_devices()[0] if device is None else device
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return count if isinstance(count, int) and count > 0 else HOPPER_SXM_SMS


def compute_capability(device=None) -> str | None:
    """The device's compute capability ("9.0"), None for a device that is not a CUDA GPU."""
    device = jax.local_devices()[0] if device is None else device
    if device.platform != "gpu":
        return None
    return getattr(device, "compute_capability", None)


def check_device(device=None) -> None:
    """``ValueError`` unless ``device`` (default: the first local device) is an sm_90 GPU.

    Read when called, never at import."""
    device = jax.local_devices()[0] if device is None else device
    cc = compute_capability(device)
    if cc != COMPUTE_CAPABILITY:
        what = f"a {device.platform} device" if cc is None else f"a GPU of compute capability {cc}"
        raise ValueError(
            f"implementation='mosaic' runs on Hopper GPUs (H100/H200, compute capability "
            f"{COMPUTE_CAPABILITY}), this is {what} ({device.device_kind}); {_USE_INSTEAD}"
        )
