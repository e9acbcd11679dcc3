"""One context-parallel training step of the transformer (``transformer.py``), inside ``jax.shard_map``.

Each rank holds its two sequence chunks (the load-balanced layout). Every layer's attention is
``jax_cpgrad.dot_product_attention``: it gathers K and V and, in the backward pass, returns dK/dV
to their owners (peer transport with a workspace, XLA transport without), with the config's
``implementation``, ``head_groups`` and per-layer options. Parameter gradients are per-rank
partial sums reduced over the CP axis: with ``psum`` on the XLA transport, and on the peer
transport with an NCCL-free all-reduce built from ``all_gather`` (so a step with a workspace uses
no NCCL at all; it is also what lets R processes share one GPU, where NCCL refuses to run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

from ..api import all_gather
from ..attention import attention_workspace_nbytes, dot_product_attention
from ..layout import to_cp_layout
from .transformer import Config, forward_loss


def _ordered_allreduce(vector, axis: str, ranks: int, workspace):
    """Sum of a float32 vector over the axis (R = ``ranks``), in rank order, through all_gather (no NCCL)."""
    length = vector.shape[0]
    half = -(-length // 2)
    padded = jnp.pad(vector, (0, 2 * half - length)).reshape(2, half)
    everyone = all_gather(padded, axis_name=axis, seq_axis=0, workspace=workspace)  # [2R, half]

    def part(r):  # rank r's vector: its two chunks, r and 2R-1-r
        return jnp.concatenate([everyone[r], everyone[2 * ranks - 1 - r]])

    total = part(0)
    for r in range(1, ranks):
        total = total + part(r)
    return total[:length]


def workspace_nbytes(cfg: Config, ranks: int, params) -> int:
    """Workspace capacity for one train step on R = ``ranks``: the larger of one layer's local K and
    V (gathered forward, returned backward) and the packed parameter gradients (the NCCL-free
    all-reduce)."""
    kv = attention_workspace_nbytes(cfg.local_kv(ranks))
    flat, _ = ravel_pytree(params)
    return max(kv, 4 * (flat.size + 2))


def make_train_step(cfg: Config, mesh, *, workspace=None, lr: float = 0.5, axis: str = "cp"):
    """jit-compiled step(params, tokens, targets[, segment_ids]) -> (new_params, mean_loss, grads).

    ``tokens``/``targets`` (and, for packed documents, their ``segment_ids``: each document one
    run of equal ids, as ``synthetic_batch`` makes them with ``cfg.documents``) are [batch,
    seq_len] in CP layout, sharded over ``axis`` on dim 1 (``shard_batch``).
    """
    ranks = mesh.shape[axis]

    def body(params, batch):
        if len(batch) not in (2, 3):
            raise ValueError(f"step(params, tokens, targets[, segment_ids]): got {len(batch)} batch arrays")
        tokens, targets, *segment_ids = batch

        def attend(q, k, v, **options):  # options: the layer's, from cfg.layer_attention
            return dot_product_attention(
                q,
                k,
                v,
                axis_name=axis,
                workspace=workspace,
                implementation=cfg.implementation,
                head_groups=cfg.head_groups,
                **options,
            )

        ids = segment_ids[0] if segment_ids else None
        loss_sum, grads = jax.value_and_grad(forward_loss)(params, tokens, targets, cfg, attend, ids)
        flat, unravel = ravel_pytree(grads)
        packed = jnp.concatenate([flat, loss_sum[None].astype(jnp.float32)])
        if workspace is None:
            total = jax.lax.psum(packed, axis)
        else:
            total = _ordered_allreduce(packed, axis, ranks, workspace)
        count = cfg.batch * cfg.seq_len
        grads = jax.tree.map(lambda g: g / count, unravel(total[:-1]))
        new_params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return new_params, total[-1] / count, grads

    # check_vma=False: parameters enter replicated and their gradients stay per-rank partial
    # sums until the explicit reduction above (no implicit psum is inserted).
    # The batch as one tuple, its one spec for each of its arrays: the step takes segment ids or not.
    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(None, axis)),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )
    return jax.jit(lambda params, *batch: step(params, batch))


def shard_batch(mesh, *arrays: np.ndarray, axis: str = "cp"):
    """Natural-order [batch, seq] arrays (tokens, targets and any segment ids) -> CP layout, sharded
    over the axis (any process count)."""
    ranks = mesh.shape[axis]
    sharding = NamedSharding(mesh, P(None, axis))

    def place(a):
        laid = np.asarray(to_cp_layout(a, ranks, seq_axis=1))
        if jax.process_count() == 1:
            return jax.device_put(laid, sharding)
        return jax.make_array_from_callback(laid.shape, sharding, lambda idx: laid[idx])

    return [place(a) for a in arrays]


def replicate(mesh, tree):
    """Place every leaf, replicated, on every device of the mesh (any process count)."""
    sharding = NamedSharding(mesh, P())

    def place(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(place, tree)


def local_value(tree):
    """This process's copy of replicated outputs, as numpy."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
