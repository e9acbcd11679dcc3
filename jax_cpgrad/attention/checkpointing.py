"""The layer's masks under ``jax.checkpoint``: their arrays carry a name, so that a checkpointed
layer's backward can keep the forward's rather than compute them again from the segment ids.

A checkpointed layer recomputes its forward in the backward, the masks with it: for documents,
about a hundred small launches a layer (benchmarks/results/README.md, "Checkpointed layers keep
their masks"). The masks are small beside the activations (a few int32 a query row and a key, per
call: tens to hundreds of KiB a layer at 32k tokens a rank), so saving them costs little. With the
policy below (called; alone, or joined with the model's own), a checkpointed layer keeps them, on
the device whatever the joined policy does with other values::

    layer = jax.checkpoint(layer, policy=jax_cpgrad.masks_checkpoint_policy())
    layer = jax.checkpoint(layer, policy=jax_cpgrad.masks_checkpoint_policy(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable))

With jax's ``jax_remat3`` flag on (off by default in jax 0.11 and 0.12) jax saves no name made
inside a custom VJP's forward, so the layer makes its masks (and its kernels' tile plans) before
its custom VJP and passes them in (``schedule.attention``). Masks without documents are looked up
from per-rank tables inside the kernels' calls (``Visibility.derive``): under that flag those
lookups (a few launches) are made again in the backward; and a lone checkpointed layer is better
off with the plain checkpoint there (XLA merges its recomputed masks with the forward's), which
two or more layers are not (benchmarks/results/README.md, "Checkpointed layers keep their masks").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

MASKS_CHECKPOINT_NAME = "jax_cpgrad_masks"


def named_masks(tree):
    """``tree`` with each of its traced arrays named ``MASKS_CHECKPOINT_NAME`` (its other leaves,
    constants included, as they are: a policy would save a named constant as a residual)."""
    name = lambda x: checkpoint_name(x, MASKS_CHECKPOINT_NAME) if isinstance(x, jax.core.Tracer) else x
    return jax.tree.map(name, tree)


def masks_checkpoint_policy(policy: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy that saves the layer's masks, and leaves every other value to
    ``policy`` (any policy, offloading ones included; None: recomputed), so that a checkpointed
    layer's backward does not compute the masks again."""
    masks = jax.checkpoint_policies.save_only_these_names(MASKS_CHECKPOINT_NAME)

    def keep_masks(prim, *args, **params):
        if masks(prim, *args, **params):
            return True
        return False if policy is None else policy(prim, *args, **params)

    return keep_masks
