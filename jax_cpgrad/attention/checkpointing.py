"""The layer's masks under ``jax.checkpoint``: their arrays carry a name, so that a checkpointed
layer's backward can keep the forward's rather than compute them again from the segment ids.

A checkpointed layer recomputes its forward in the backward, the masks with it: for documents,
about a hundred small launches a layer (finding in benchmarks/results/README.md, "Layers under
``lax.scan``"). The masks are small (int32 intervals and tile plans: a few KiB a call), so saving
them costs next to nothing. With the policy below (alone, or joined with the model's own), a
checkpointed layer keeps them::

    layer = jax.checkpoint(layer, policy=jax_cpgrad.masks_checkpoint_policy())
    layer = jax.checkpoint(layer, policy=jax_cpgrad.masks_checkpoint_policy(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

MASKS_CHECKPOINT_NAME = "jax_cpgrad_masks"


def named_masks(tree):
    """``tree`` with each of its arrays named ``MASKS_CHECKPOINT_NAME`` (its other leaves as
    they are)."""
    name = lambda x: checkpoint_name(x, MASKS_CHECKPOINT_NAME) if isinstance(x, jax.Array) else x
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
