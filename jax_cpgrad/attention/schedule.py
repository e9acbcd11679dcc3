"""A rank's exact attention as a local and a remote part merged by log-sum-exp, with the transfer
of K/V (forward) and dK/dV (backward) running beside the local part's work: the custom VJP.

Before the custom VJP: gather the other ranks' segment ids if documents need them (tiny, before
anything else), and make the rank's calls (their masks and the kernels' tile plans), which the VJP
takes as arguments (where a ``jax.checkpoint`` policy can keep them: ``attention``).
Forward: start the K/V gather; compute the local part (own keys only); finish the gather; compute the
remote part against the gathered keys; merge. Backward: compute the remote part's backward
first, which yields this rank's dK/dV for the whole sequence; start returning them to their
owners; compute the local part's backward; finish the return and add the local dK/dV.

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
with the unscaled dO. Each call's backward runs that way (``kernels/contract.py``).

For a window whose sides fit in a chunk (``RankPlan.halo_window``) the transfer is the halo's
(``Transfer.halo`` / ``return_halo``): only the neighbouring chunks' edge rows travel, in the same
places (beside the local part, the return beside the local backward, pipelined over head groups
the same way), and the remote part runs against them for the chunks' edge rows alone
(``plan.edge_rows``), whose results are merged into the local part's in place; the returned
dK/dV are added to the local part's in the rows the neighbours saw alone, in place.

The calls themselves come from ``plan.py`` as data; this module only runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import kernels
from .checkpointing import named_masks
from .merging import merge
from .plan import Call, Calls, RankPlan, edge_rows, take_segments, update_segments
from .rounding import rounded, rounded_into

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    plan: RankPlan
    scale: float
    impl: str  # a kernels.KERNELS name
    transfer: Any  # a transfer.Transfer (hashable)
    head_groups: int = 1  # the transfer pipelined over this many groups of key/value heads


# -- one call ----------------------------------------------------------------------------------


def _call_forward(cfg: Config, call: Call, q, k, v, k_glob, v_glob, rank, prev=None):
    """The call's (out [B, T, N, H], lse [B, N, T]), 0 and -inf in the rows it does not have;
    with ``prev`` (a masked call's: the local part's (out, lse) of all rows), merged with prev's
    in its rows (``kernels.masked_forward``)."""
    plan = cfg.plan
    qc = plan.take_rows(call, q)
    kc, vc = (plan.take_keys(call, own, glob, rank) for own, glob in ((k, k_glob), (v, v_glob)))
    if prev is not None:
        prev = (plan.take_rows(call, prev[0]), plan.take_lse(call, prev[1]))
    if call.vis is not None:  # masked
        out, lse = kernels.masked_forward(cfg.impl, qc, kc, vc, call.vis, scale=cfg.scale, prev=prev)
    else:
        out, lse = kernels.forward(
            cfg.impl, qc, kc, vc, causal=call.causal, scale=cfg.scale, kv_len=call.kv_len, window=call.window
        )
    return plan.put_rows(call, out, 0), plan.put_lse(call, lse)


def _call_backward(cfg: Config, call: Call, q, k, v, k_glob, v_glob, out, lse, d_out, rank, dq_add=None):
    """The call's (dq [B, T, N, H], dk, dv, own dk, own dv): dk and dv the rank's own [B, T, K, H]
    for a local call, the gathered [B, S, K, H] (or moved rows) for a remote one; own dk and dv
    those of the rank's own keys a remote call read (``RankPlan.own_key_grads``), else None.
    ``dq_add`` (a masked call of all rows: the remote part's dq) is added to its dq."""
    plan = cfg.plan
    qc, oc, dc = (plan.take_rows(call, x) for x in (q, out, d_out))
    lc = plan.take_lse(call, lse)
    kc, vc = (plan.take_keys(call, own, glob, rank) for own, glob in ((k, k_glob), (v, v_glob)))
    if call.vis is not None:  # masked
        dq, dk, dv = kernels.masked_backward(
            cfg.impl, qc, kc, vc, oc, lc, dc, call.vis, scale=cfg.scale, dq_add=dq_add
        )
    else:
        dq, dk, dv = kernels.backward(
            cfg.impl, qc, kc, vc, oc, lc, dc, causal=call.causal, scale=cfg.scale, kv_len=call.kv_len,
            window=call.window,
        )  # fmt: skip
    own_len = q.shape[1]
    return (
        plan.put_rows(call, dq, 0),
        *(plan.put_key_grads(call, g, rank) for g in (dk, dv)),
        *(plan.own_key_grads(call, g, rank, own_len) for g in (dk, dv)),
    )


# -- the two parts -----------------------------------------------------------------------------


def _local_forward(cfg: Config, calls, q, k, v):
    """The local part's (out, lse)."""
    parts = [_call_forward(cfg, call, q, k, v, None, None, None) for call in calls]
    return parts[0] if len(parts) == 1 else merge(*parts)


def _local_backward(cfg: Config, calls, q, k, v, out, lse, d_out, dq_add=None):
    """The local part's (dq, dk, dv); ``dq_add``: the remote part's dq, which its one call adds
    (``_adds_remote_dq``)."""
    if dq_add is not None:
        (call,) = calls
        return _call_backward(cfg, call, q, k, v, None, None, out, lse, d_out, None, dq_add)[:3]
    grads = [_call_backward(cfg, call, q, k, v, None, None, out, lse, d_out, None)[:3] for call in calls]
    if len(grads) == 1:
        return grads[0]
    return tuple(
        rounded(_sum_f32(g), like.dtype) for g, like in zip(zip(*grads, strict=True), (q, k, v), strict=True)
    )


def _remote_forward(cfg: Config, calls, q, k, v, k_glob, v_glob, rank, prev=None):
    """The remote part's (out, lse) pairs, one per call, for these heads (``k``, ``v``: the rank's
    own, which a plain window's halo call reads on rank R-1); with ``prev``, the local part's
    (out, lse) of these heads, its one call's continued from them (``_continues``)."""
    return [_call_forward(cfg, call, q, k, v, k_glob, v_glob, rank, prev) for call in calls]


def _continues(calls: Calls) -> bool:
    """Whether the remote part is one masked call, which continues the local part's (out, lse)
    (``kernels.masked_forward``'s ``prev``) instead of being merged with it afterwards: a kernel
    that ``continues`` then reads and writes the rank's output once, where a merge in XLA would
    take three passes over it and the kernel a pass of its own writing zeros (results, finding
    12: documents whose rows see few remote keys)."""
    return len(calls.remote) == 1 and calls.remote[0].vis is not None


def _adds_remote_dq(calls: Calls) -> bool:
    """Whether the local part's one call adds the remote part's dq to its own (both masked calls
    of all the rank's rows; ``kernels.masked_backward``'s ``dq_add``)."""
    return (
        _continues(calls) and len(calls.local) == 1 and calls.local[0].vis is not None
        and calls.local[0].rows == calls.remote[0].rows == "all"
    )  # fmt: skip


def _remote_backward(cfg: Config, calls, q, k, v, k_glob, v_glob, out, lse, d_out, rank):
    """The remote part's (dq float32, dk, dv over the gathered length, zero where it read no key)
    for these heads, each the float32 sum of its calls' gradients, the key gradients rounded once
    to their dtype; then (own dk, own dv) float32, those of the rank's own keys ``k``, ``v`` it
    read, or None."""
    grads = [_call_backward(cfg, c, q, k, v, k_glob, v_glob, out, lse, d_out, rank) for c in calls]
    dq, dk, dv, *own = (_sum_f32(g) for g in zip(*grads, strict=True))
    return dq, rounded(dk, k_glob.dtype), rounded(dv, v_glob.dtype), *own


def _sum_f32(xs):
    """The float32 sum of the arrays in ``xs`` that are not None (None if all are)."""
    present = [x.astype(F32) for x in xs if x is not None]
    return sum(present) if present else None


# -- the custom VJP ----------------------------------------------------------------------------


def _gathered_ids(cfg: Config, words):
    """The segment ids' words of the whole sequence in natural order, or None."""
    if words is None:
        return None
    return cfg.transfer.gather_ids(words) if cfg.plan.gathers_ids else words


def _transfers(cfg: Config, q):
    """(the K/V move, the dK/dV move back), each ``(xs, fn, *args) -> (moved, fn(*args))``: the
    halo's for a window within a chunk, the reached chunks' for a wider window where the
    transfer moves them alone (as they arrived for masked calls, in natural order for plain
    ones), else the gather and return (of the ranks a window reaches)."""
    c = q.shape[1] // 2
    window = cfg.plan.halo_window(c)
    t = cfg.transfer
    lay = cfg.plan.chunk_layout(c)
    natural = cfg.plan.window_as_plain  # plain calls read the reached chunks in natural order
    if lay is not None:
        return (
            lambda xs, fn, *args: t.chunks(xs, lay, fn, *args, natural=natural),
            lambda grads, fn, *args: t.return_chunks(grads, lay, fn, *args, natural=natural),
        )
    if window is None:  # a wider window: the gather needs the ranks within its reach alone
        near = t.near(cfg.plan.window_reach(c))
        return near.gather, near.return_grads
    return (
        lambda xs, fn, *args: t.halo(xs, window, fn, *args),
        lambda grads, fn, *args: t.return_halo(grads, window, c, fn, *args),
    )


def _rank_calls(cfg: Config, q, k, rank, words_glob) -> Calls:
    """The rank's calls as the forward and the backward take them: their masks, and the kernels'
    tile plans made from them (``kernels.prime_masked``; made once, here, so that a ``lax.scan``
    over layers does not make the backward's in every step). Made before the custom VJP and named,
    so that a checkpoint policy can keep them (checkpointing.py)."""
    calls = cfg.plan.calls(q, rank, words_glob)
    local = tuple(_primed(cfg, call, q, k, groups=1) for call in calls.local)
    remote = tuple(_primed(cfg, call, q, k, groups=cfg.head_groups) for call in calls.remote)
    return named_masks(Calls(local, remote))


def _primed(cfg: Config, call: Call, q, k, *, groups: int) -> Call:
    """``call`` with its masked kernels' plans made, for the call's operands as the forward gives
    them: q's rows (``take_rows``) of one group's heads, against ``vis.k_len`` keys."""
    if call.vis is None or kernels.by_name(cfg.impl).prime is None:
        return call
    heads = lambda x: jax.ShapeDtypeStruct((*x.shape[:2], x.shape[2] // groups, x.shape[3]), x.dtype)
    qc = jax.eval_shape(functools.partial(cfg.plan.take_rows, call), heads(q))
    kc = jax.ShapeDtypeStruct((qc.shape[0], call.vis.k_len, *heads(k).shape[2:]), k.dtype)
    return dataclasses.replace(call, vis=kernels.prime_masked(cfg.impl, qc, kc, call.vis))


def _forward(cfg: Config, q, k, v, rank, words_glob, calls: Calls):
    """(out, lse, residuals); the residuals hold the calls, which the backward takes."""
    if not calls.remote:
        out, lse = _local_forward(cfg, calls.local, q, k, v)
        return out, lse, (q, k, v, ((k, v),), out, lse, rank, calls)
    groups = cfg.head_groups
    qs, ks, vs = (_heads(x, groups) for x in (q, k, v))
    first_kv = (ks[0], vs[0]) if words_glob is None else _after(words_glob, (ks[0], vs[0]))
    remote = functools.partial(_remote_forward, cfg)
    local_fn = functools.partial(_local_forward, cfg)
    gather, _ = _transfers(cfg, q)
    gathered, local = gather(first_kv, local_fn, calls.local, q, k, v)
    continues = _continues(calls)
    # each group's remote call continues the local part's (out, lse) of its heads, or is merged
    prevs = (
        list(zip(_heads(local[0], groups), _heads(local[1], groups, axis=1), strict=True))
        if continues
        else [None] * groups
    )
    kv_glob, remote_parts = [gathered], []
    for g in range(1, groups):
        next_kv = _after(kv_glob[-1], (ks[g], vs[g]))
        gathered, parts = gather(
            next_kv, remote, calls.remote, qs[g - 1], ks[g - 1], vs[g - 1], *kv_glob[-1], rank, prevs[g - 1]
        )
        kv_glob.append(gathered)
        remote_parts.append(parts)
    k_glob, v_glob = kv_glob[-1]
    remote_parts.append(remote(calls.remote, qs[-1], ks[-1], vs[-1], k_glob, v_glob, rank, prevs[-1]))
    # call p of every group, joined along the heads: [(out [B, T, N, H], lse [B, N, T]), ...]
    joined = [
        (_join([o for o, _ in part], axis=2), _join([lp for _, lp in part], axis=1))
        for part in zip(*remote_parts, strict=True)
    ]
    out, lse = _merge_remote(cfg.plan, calls.remote[0], local, joined, continued=continues)
    return out, lse, (q, k, v, tuple(kv_glob), out, lse, rank, calls)


def _merge_remote(plan, call: Call, local, parts, *, continued: bool):
    """The local part merged with the remote parts, which hold ``call``'s rows: all of them, or a
    window's edge rows (merged there and written into the local part's result; elsewhere the
    merge would give the local part's bits back). ``continued``: the one part is the merge
    already (its call continued the local part's), written in place of those rows."""

    def merged(out, lse, *flat):
        if continued:
            return flat
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return merge((out, lse), *pairs, rounding=rounded_into)

    others = [(x, axis) for o, lp in parts for x, axis in ((o, 1), (lp, -1))]
    return plan.update_rows(call, local, merged, axes=(1, -1), others=others)


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


def attention(cfg: Config, q, k, v, rank, words):
    """The rank's attention output [B, T, N, H]; ``rank`` is its int32 index on the axis, ``words``
    its segment ids as int32 words [B, T, W] (``plan.id_words``) or None.

    The ids' gather and the calls (masks, tile plans) are made here, outside the custom VJP, and
    passed to it: jax saves named values made inside a custom VJP's forward only without its
    ``jax_remat3`` flag, so there a checkpoint policy could not keep them."""
    words_glob = _gathered_ids(cfg, words)
    return _attention(cfg, q, k, v, rank, words_glob, _rank_calls(cfg, q, k, rank, words_glob))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, q, k, v, rank, words_glob, calls: Calls):
    return _forward(cfg, q, k, v, rank, words_glob, calls)[0]


def _attention_fwd(cfg: Config, q, k, v, rank, words_glob, calls: Calls):
    out, _, residuals = _forward(cfg, q, k, v, rank, words_glob, calls)
    return out, residuals


def _attention_bwd(cfg: Config, residuals, d_out):
    # the forward's calls (and masks), not computed again: under a lax.scan over layers they
    # depend on the ids alone, and the scan keeps them outside its loop with the forward's
    q, k, v, kv_glob, out, lse, rank, calls = residuals
    d_out = rounded(d_out, q.dtype)
    local_backward = functools.partial(_local_backward, cfg, calls.local)
    if not calls.remote:
        return (*local_backward(q, k, v, out, lse, d_out), None, None, None)
    groups = cfg.head_groups
    qs, ks, vs, outs, d_outs = (_heads(x, groups) for x in (q, k, v, out, d_out))
    lses = _heads(lse, groups, axis=1)
    remote = functools.partial(_remote_backward, cfg)
    _, return_grads = _transfers(cfg, q)

    def group(g: int):
        """The arguments of group g's remote backward."""
        k_glob, v_glob = kv_glob[g]
        return calls.remote, qs[g], ks[g], vs[g], k_glob, v_glob, outs[g], lses[g], d_outs[g], rank

    dq_r, dk_r, dv_r, *own_r = remote(*group(0))
    dqs, owns, returned, sending = [dq_r], [own_r], [], (dk_r, dv_r)
    for g in range(1, groups):
        back, (dq_r, dk_r, dv_r, *own_r) = return_grads(sending, remote, *group(g))
        dqs.append(dq_r)
        owns.append(own_r)
        returned.append(back)
        sending = _after(back, (dk_r, dv_r))
    adds = _adds_remote_dq(calls)  # the local call adds the remote dq: exact in q's dtype (one call's)
    dq_add = rounded(_join(dqs, axis=2), q.dtype) if adds else None
    back, (dq_l, dk_l, dv_l) = return_grads(sending, local_backward, q, k, v, out, lse, d_out, dq_add)
    returned.append(back)
    dk_back, dv_back = (_join([b[i] for b in returned], axis=2) for i in (0, 1))
    total = lambda like, *xs: rounded(_sum_f32(xs), like.dtype)
    # the rank's own keys a remote call read (a plain window's halo on rank R-1): a share of their
    # own, rounded like the others, and summed with them in float32
    own = [
        None if owns[0][i] is None else rounded(_join([o[i] for o in owns], axis=2), like.dtype)
        for i, like in ((0, k), (1, v))
    ]
    call, plan = calls.remote[0], cfg.plan  # the remote dq holds its rows (a window's edge rows alone)
    added = lambda like: lambda rows, back: (rounded_into(_sum_f32((back, rows)), like.dtype),)
    if adds:
        dq = dq_l
    else:
        (dq,) = plan.update_rows(call, (dq_l,), added(q), axes=(1,), others=[(_join(dqs, axis=2), 1)])
    returned_rows = _returned_rows(cfg, q.shape[1] // 2) if own[0] is None else None
    if returned_rows is not None:  # the returned halo gradients are 0 elsewhere: add these rows alone
        at = lambda x: take_segments(x, returned_rows)
        (dk,) = update_segments((dk_l,), added(k), returned_rows, axes=(1,), others=[(at(dk_back), 1)])
        (dv,) = update_segments((dv_l,), added(v), returned_rows, axes=(1,), others=[(at(dv_back), 1)])
        return dq, dk, dv, None, None, None
    return dq, total(k, dk_back, dk_l, own[0]), total(v, dv_back, dv_l, own[1]), None, None, None


def _returned_rows(cfg: Config, c: int):
    """The rows of the rank's own keys that a halo's return can give a gradient to (each chunk's
    last ``left`` and first ``right`` rows, which its neighbours see: ``edge_rows`` with the
    sides swapped), or None where it may give one to every row (no halo, or the rows cover all).
    The sum with the local dK/dV then touches these rows alone, in place."""
    window = cfg.plan.halo_window(c)
    if window is None:
        return None
    rows = edge_rows(c, window[1], window[0])
    return None if rows == ((0, 2 * c),) else rows


_attention.defvjp(_attention_fwd, _attention_bwd)
