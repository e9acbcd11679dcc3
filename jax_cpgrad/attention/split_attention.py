"""A rank's exact attention as a local and a remote part merged by log-sum-exp, with the transfer
of K/V (forward) and dK/dV (backward) running beside the local part's work.

Forward: start the K/V gather; compute the local part (own keys only); finish the gather;
compute the remote part against the gathered keys; merge. Backward: compute the remote part's
backward first, which yields this rank's dK/dV for the whole sequence; start returning them to
their owners; compute the local part's backward; finish the return and add the local dK/dV.

With G head groups (``Config.head_groups``) the transfer is pipelined: group 0's K/V travel
beside the local part (all heads), group g+1's beside group g's remote part; in the backward,
group g's dK/dV return beside group g+1's remote backward, the last group's beside the local
backward. Each transfer starts after the previous one is done (a workspace runs one call at a
time), and only the first group's gather and the last group's return wait on the short local
part.

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
    head_groups: int = 1  # the transfer pipelined over this many groups of key/value heads


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


def _remote_forward(cfg: Config, q, k_glob, v_glob, rank):
    """The remote part's (out, lse) pairs for these heads."""
    kernel = functools.partial(_remote_kernel, cfg, kernels.forward)
    return cfg.plan.remote_forward(kernel, q, k_glob, v_glob, rank)


def _remote_backward(cfg: Config, q, k_glob, v_glob, out, lse, d_out, rank):
    """The remote part's (dq float32, dk, dv over the gathered length) for these heads."""
    kernel = functools.partial(_remote_kernel, cfg, kernels.backward)
    return cfg.plan.remote_backward(kernel, q, k_glob, v_glob, out, lse, d_out, rank)


def _forward(cfg: Config, q, k, v, rank):
    """(out, lse, residuals)."""
    plan = cfg.plan
    if not plan.has_remote:
        out, lse = _local_forward(cfg, q, k, v)
        return out, lse, (q, k, v, ((k, v),), out, lse, rank)
    groups = cfg.head_groups
    qs, ks, vs = (_heads(x, groups) for x in (q, k, v))
    remote = functools.partial(_remote_forward, cfg)
    gathered, local = cfg.transfer.gather((ks[0], vs[0]), functools.partial(_local_forward, cfg), q, k, v)
    kv_glob, remote_parts = [gathered], []
    for g in range(1, groups):
        next_kv = _after(kv_glob[-1], (ks[g], vs[g]))
        gathered, parts = cfg.transfer.gather(next_kv, remote, qs[g - 1], *kv_glob[-1], rank)
        kv_glob.append(gathered)
        remote_parts.append(parts)
    k_glob, v_glob = kv_glob[-1]
    remote_parts.append(remote(qs[-1], k_glob, v_glob, rank))
    # part p of every group, joined along the heads: [(out [B, T, N, H], lse [B, N, T]), ...]
    joined = [
        (_join([o for o, _ in part], axis=2), _join([lp for _, lp in part], axis=1))
        for part in zip(*remote_parts, strict=True)
    ]
    out, lse = merge(local, *joined)
    return out, lse, (q, k, v, tuple(kv_glob), out, lse, rank)


def _heads(x, groups: int, axis: int = 2):
    """``x`` split into ``groups`` equal groups of heads (a list, ``[x]`` for one)."""
    return jnp.split(x, groups, axis=axis) if groups > 1 else [x]


def _join(xs, axis: int):
    return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _after(previous, xs):
    """``xs``, available only once ``previous`` is: the next transfer starts after the previous
    one is done (one workspace runs one call at a time; XLA would otherwise start it as soon as
    its inputs exist)."""
    return jax.lax.optimization_barrier((previous, xs))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: Config, q, k, v, rank):
    """The rank's attention output [B, T, N, H]; ``rank`` is its int32 index on the axis."""
    return _forward(cfg, q, k, v, rank)[0]


def _attention_fwd(cfg: Config, q, k, v, rank):
    out, _, residuals = _forward(cfg, q, k, v, rank)
    return out, residuals


def _attention_bwd(cfg: Config, residuals, d_out):
    q, k, v, kv_glob, out, lse, rank = residuals
    plan = cfg.plan
    d_out = d_out.astype(q.dtype)
    local_backward = functools.partial(_local_backward, cfg)
    if not plan.has_remote:
        return (*local_backward(q, k, v, out, lse, d_out), None)
    groups = cfg.head_groups
    qs, outs, d_outs = (_heads(x, groups) for x in (q, out, d_out))
    lses = _heads(lse, groups, axis=1)
    remote = functools.partial(_remote_backward, cfg)

    def group(g: int):
        """The arguments of group g's remote backward."""
        k_glob, v_glob = kv_glob[g]
        return qs[g], k_glob, v_glob, outs[g], lses[g], d_outs[g], rank

    dq_r, dk_r, dv_r = remote(*group(0))
    dqs, returned, sending = [dq_r], [], (dk_r, dv_r)
    for g in range(1, groups):
        back, (dq_r, dk_r, dv_r) = cfg.transfer.give_back(sending, remote, *group(g))
        dqs.append(dq_r)
        returned.append(back)
        sending = _after(back, (dk_r, dv_r))
    back, (dq_l, dk_l, dv_l) = cfg.transfer.give_back(sending, local_backward, q, k, v, out, lse, d_out)
    returned.append(back)
    dk_back, dv_back = (_join([b[i] for b in returned], axis=2) for i in (0, 1))
    add = lambda a, b, like: (a.astype(F32) + b.astype(F32)).astype(like.dtype)
    return add(_join(dqs, axis=2), dq_l, q), add(dk_back, dk_l, k), add(dv_back, dv_l, v), None


attention.defvjp(_attention_fwd, _attention_bwd)
