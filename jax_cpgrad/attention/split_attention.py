"""A rank's exact attention as a local and a remote part merged by log-sum-exp, with the transfer
of K/V (forward) and dK/dV (backward) running beside the local part's work.

Forward: start the K/V gather; compute the local part (own keys only); finish the gather;
compute the remote part against the gathered keys; merge. Backward: compute the remote part's
backward first, which yields this rank's dK/dV for the whole sequence; start returning them to
their owners; compute the local part's backward; finish the return and add the local dK/dV.

The merge has its own VJP. With O = sum_p w_p O_p over the parts p, w_p = exp(L_p - L) and
L = logsumexp_p L_p, part p's scores S_p take the merged probabilities P = exp(S_p - L), so the
exact score gradient is dS_p = P * (dO V_p^T - rowsum(dO * O)) with the *merged* O and L: what a
flash-attention backward computes when it is given (O, L) instead of the part's own (O_p, L_p),
with the unscaled dO. Each part's backward runs that way (kernels.backward).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import kernels
from .plan import RankPlan

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    plan: RankPlan
    scale: float
    impl: str  # kernels.KERNELS key
    transfer: Any  # transfer.OnMeshAxis or transfer.NoTransfer (hashable)


def merge(*parts):
    """(out, lse) of parts of the same queries' attention, each an (out, lse) pair: summed in
    float32, rounded once to the first part's dtype."""
    lse = functools.reduce(jnp.logaddexp, [lp for _, lp in parts])  # finite: every query sees its own key
    weight = lambda lp: jnp.swapaxes(jnp.exp(lp - lse), -1, -2)[..., None]  # [B, T, N, 1]
    out = sum(weight(lp) * op.astype(F32) for op, lp in parts)
    return out.astype(parts[0][0].dtype), lse


def _local_forward(cfg: Config, q, k, v):
    plan = cfg.plan
    out, lse = kernels.forward(cfg.impl, *plan.local_operands(q, k, v), causal=plan.causal, scale=cfg.scale)
    return plan.local_result(out, lse)


def _local_backward(cfg: Config, q, k, v, out, lse, d_out):
    plan = cfg.plan
    grads = kernels.backward(
        cfg.impl,
        *plan.local_operands(q, k, v),
        *plan.local_cotangents(out, lse, d_out),
        causal=plan.causal,
        scale=cfg.scale,
    )
    return plan.local_grads(*grads)


def _remote_kernel(cfg: Config, kernel, *arrays):
    """One call of the remote part: ``kernel`` (kernels.forward or kernels.backward) on
    ``arrays``, the last of which is kv_len."""
    return kernel(cfg.impl, *arrays[:-1], causal=False, scale=cfg.scale, kv_len=arrays[-1])


def _forward(cfg: Config, q, k, v, rank):
    """(out, lse, residuals)."""
    plan = cfg.plan
    if not plan.has_remote:
        out, lse = _local_forward(cfg, q, k, v)
        return out, lse, (q, k, v, k, v, out, lse, rank)
    (k_glob, v_glob), local = cfg.transfer.gather((k, v), functools.partial(_local_forward, cfg), q, k, v)
    remote_kernel = functools.partial(_remote_kernel, cfg, kernels.forward)
    out, lse = merge(local, *plan.remote_forward(remote_kernel, q, k_glob, v_glob, rank))
    return out, lse, (q, k, v, k_glob, v_glob, out, lse, rank)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: Config, q, k, v, rank):
    """The rank's attention output [B, T, N, H]; ``rank`` is its int32 index on the axis."""
    return _forward(cfg, q, k, v, rank)[0]


def _attention_fwd(cfg: Config, q, k, v, rank):
    out, _, residuals = _forward(cfg, q, k, v, rank)
    return out, residuals


def _attention_bwd(cfg: Config, residuals, d_out):
    q, k, v, k_glob, v_glob, out, lse, rank = residuals
    plan = cfg.plan
    d_out = d_out.astype(q.dtype)
    local_backward = functools.partial(_local_backward, cfg)
    if not plan.has_remote:
        return (*local_backward(q, k, v, out, lse, d_out), None)
    dq_r, dk_r, dv_r = plan.remote_backward(
        functools.partial(_remote_kernel, cfg, kernels.backward), q, k_glob, v_glob, out, lse, d_out, rank
    )
    (dk_back, dv_back), (dq_l, dk_l, dv_l) = cfg.transfer.give_back(
        (dk_r, dv_r), local_backward, q, k, v, out, lse, d_out
    )
    add = lambda a, b, like: (a.astype(F32) + b.astype(F32)).astype(like.dtype)
    return add(dq_r, dq_l, q), add(dk_back, dk_l, k), add(dv_back, dv_l, v), None


attention.defvjp(_attention_fwd, _attention_bwd)
