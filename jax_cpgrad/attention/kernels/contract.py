"""What every attention kernel of the layer takes, returns and refuses.

A kernel computes one block of queries against one block of keys and returns the natural-log
log-sum-exp with the output; its backward takes an *external* output and log-sum-exp (the
merged ones of all the parts of a rank's attention, ``schedule.py``) and returns dq, dk, dv.

Shapes (``jax.nn.dot_product_attention``'s letters): q ``[B, T, N, H]``, k/v ``[B, L, K, H]``
with K dividing N (MHA, GQA, MQA); out ``[B, T, N, H]`` in q's dtype; lse ``[B, N, T]`` float32,
the natural log of the summed exponentials of the scaled scores of the keys a row sees.

Two kinds of call:

- **plain** (causal or full, optionally only the first ``kv_len[b]`` keys of entry b):
  ``forward(q, k, v, *, causal, scale, kv_len=None, window=None) -> (out, lse)`` and
  ``backward(q, k, v, out, lse, d_out, *, causal, scale, kv_len=None, window=None) -> (dq, dk, dv)``;
  ``causal``: query i sees keys 0..i (T == L); ``kv_len``: int32 ``[B]``, a run-time value;
  ``window`` (an int w, with ``causal`` and no ``kv_len``, kernels with ``plain_windows`` only):
  query i sees keys i - w .. i alone (cuDNN's sliding window).
- **masked** (documents, windows, anything :class:`~jax_cpgrad.attention.masks.Visibility`
  describes: per query row the key indices ``[row_lo, row_hi)`` it sees, per key the query
  indices ``[col_lo, col_hi)`` that see it, leading dimension 1 or B):
  ``forward(q, k, v, vis, *, scale) -> (out, lse)`` and
  ``backward(q, k, v, out, lse, d_out, vis, *, scale) -> (dq, dk, dv)``. q, out and d_out may
  hold more rows than ``vis`` (T = ``vis.q_len``): the call is that of their first T rows, and
  its out, lse and dq have T rows. A kernel with ``rows_in_place`` reads them where they lie;
  the others are given the first T rows (``kernels.masked_forward``).

A kernel that ``continues`` takes two more arguments in its masked calls: ``prev=(out, lse)``,
the same rows' result against other keys (out's rows read as q's are), which the forward
continues and returns merged with its own; and ``dq_add``, another part's dq of the same rows,
which the backward adds to its own in float32 before rounding once. ``kernels.masked_forward``
and ``masked_backward`` take both for every kernel and merge or add in XLA for the others.

Every kernel, both kinds: a row that sees no key has lse = -inf and output 0, and its gradients
(and those of keys no row sees) are 0, whatever it would compute there; dq, dk, dv come back in
their inputs' dtypes. The backward is the softmax gradient with P = exp(S - lse) and
D = rowsum(d_out * out) for the lse and out it is given.

A kernel that cannot run some inputs says why (:attr:`Kernel.refuses`, a phrase that completes
"implementation='name' needs ..."), and the layer turns that into a ``ValueError`` at trace time
(or, with ``implementation=None``, tries the next kernel of ``kernels.KERNELS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..masks import Visibility

# Which windows plain calls with ``window=`` can run, in messages.
PLAIN_WINDOWS = "with is_causal=True (a left side only; any length)"


def _anything(dtype, head_dim: int) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation: its name (``implementation=``), its plain and masked calls (None where
    it has none), what it refuses, and where it runs (for messages: ``"on sm_90 GPUs"``)."""

    name: str
    forward: Callable | None = None
    backward: Callable | None = None
    masked_forward: Callable | None = None
    masked_backward: Callable | None = None
    # (q, k, vis) -> vis with what masked_forward and masked_backward of these q and k (arrays
    # or shapes) make of it made already (``Visibility.with_derived``), for the layer to make with
    # its masks (with the configs those calls use, or they make their own): None where they make
    # nothing
    prime: Callable | None = None
    refuses: Callable[[Any, int], str | None] = _anything  # (dtype, head dim) -> why not, or None
    where: str = ""
    # Plain causal/full attention given to the masked calls (a kernel with masked calls only).
    plain_as_masked: bool = False
    # Masked calls read the first rows of a longer q, out and d_out in place (else a copy).
    rows_in_place: bool = False
    # Taken by implementation=None (where it can run); False: only when asked for by name.
    by_default: bool = True
    # Plain causal calls take a left window (``window=``): the layer then runs a causal window
    # without masks (``plan.RankPlan.plain_windows``).
    plain_windows: bool = False
    # Masked calls continue a previous part of the same rows: the forward takes ``prev=(out,
    # lse)`` and returns both merged, the backward takes ``dq_add`` and returns the summed dq
    # (``kernels.masked_forward``, ``masked_backward``; for the others they merge and add in XLA).
    continues: bool = False

    @property
    def takes_masks(self) -> bool:
        return self.masked_forward is not None

    def takes(self, masked: bool, plain_window: bool = False) -> bool:
        """Whether it can express the mask: ``masked`` (documents or a window), of which
        ``plain_window`` says whether it is a window that plain calls can run (a causal window, no
        documents: ``plan.plain_window``)."""
        return not masked or self.takes_masks or (plain_window and self.plain_windows)

    def why_not(self, dtype, head_dim: int, masked: bool, plain_window: bool = False) -> str | None:
        """None where this kernel can run such a call; otherwise why not (see the module)."""
        if not self.takes(masked, plain_window):
            if self.plain_windows:
                return f"no documents (segment_ids), and a local window only {PLAIN_WINDOWS}"
            return "no documents and no local window (segment_ids, local_window_size)"
        if not masked and self.forward is None and not self.plain_as_masked:
            return "documents or a local window"
        return self.refuses(dtype, head_dim)


def check_visibility(q, k, vis: Visibility) -> None:
    """ValueError unless ``vis`` describes these q rows and k rows (leading dim 1 or B)."""
    b, t = q.shape[:2]
    if vis.q_len != t or vis.k_len != k.shape[1] or vis.row_lo.shape[0] not in (1, b):
        raise ValueError(
            f"attention kernel: a Visibility of {vis.row_lo.shape[0]} x {vis.q_len} rows and "
            f"{vis.k_len} keys does not fit q {list(q.shape)} and k {list(k.shape)}"
        )
