"""The transport on its own: `all_gather` of K/V into natural order and `grad_return` of dK/dV to
their owners, inside `jax.shard_map`; the peer transport on GPUs, XLA collectives on 8 CPU devices
elsewhere. Run: python examples/transport_collectives.py"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_cpgrad as cpg

jax.config.update("jax_num_cpu_devices", 8)  # 8 CPU devices where there is no GPU (before any JAX call)

n = len(jax.devices())
mesh = Mesh(np.array(jax.devices()), ("cp",))
B, S, H, D = 1, 256 * n, 8, 128  # global sequence S: a multiple of 2R (R = n ranks)
dtype = jnp.bfloat16
# A workspace is sized for one call: dK + dV in their local (per-rank) shapes. One serves every
# layer. Without one (None), the same code runs over XLA collectives.
local_kv_bytes = 2 * B * (S // n) * H * D * jnp.dtype(dtype).itemsize
on_gpus = cpg.HAS_CUDA and jax.devices()[0].platform == "gpu"
ws = cpg.Workspace(mesh, "cp", nbytes=local_kv_bytes) if on_gpus else None


def forward_piece(k, v):  # per rank: local K/V [B, S/R, H, D] (chunks r, 2R-1-r)
    return cpg.all_gather((k, v), axis_name="cp", seq_axis=1, workspace=ws)


def backward_piece(dk, dv):  # per rank: dK/dV for the whole sequence [B, S, H, D]
    return cpg.grad_return((dk, dv), axis_name="cp", seq_axis=1, workspace=ws)


gather = jax.jit(
    jax.shard_map(
        forward_piece, mesh=mesh, in_specs=(P(None, "cp"), P(None, "cp")), out_specs=(P("cp"), P("cp"))
    )
)
ret = jax.jit(
    jax.shard_map(
        backward_piece, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=(P(None, "cp"), P(None, "cp"))
    )
)

k = jnp.arange(B * S * H * D, dtype=jnp.float32).reshape(B, S, H, D).astype(dtype)  # CP layout
k_all, _ = gather(k, k)  # [N * B, S, H, D]: every rank's copy of the natural-order K
assert (k_all[:B] == cpg.from_cp_layout(k, n, seq_axis=1)).all()
dk = jnp.ones((n * B, S, H, D), dtype)  # rank r's dK is rows [r * B, (r + 1) * B)
dk_local, _ = ret(dk, dk)  # [B, S, H, D] in CP layout: the sum over the R ranks
assert (dk_local == n).all()
print(f"{n} ranks ({'peer' if ws else 'XLA'}): gathered K {k_all.shape}, returned dK {dk_local.shape}")
if ws is not None:
    ws.close()  # or `with cpg.Workspace(...) as ws:`
