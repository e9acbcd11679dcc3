"""Inside ``jax.shard_map`` every value is typed with the mesh axes it varies over, and a few places
of the attention package must set that type themselves (outside ``shard_map`` nothing changes):

- a loop carry started from constants, which must take the axes of the values its body
  accumulates (``blockwise.py``; a loop's carry must keep its type);
- the zeros a VJP is taken at (``halo.py``): left invariant, the transpose would sum the
  cotangents of every device;
- a Pallas kernel's results, which ``plgpu.kernel`` types as invariant although they come from
  this device's operands (``mosaic_gpu/``); the kernels are never differentiated (the layer's
  ``custom_vjp`` calls them), so this only sets the type.
"""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
    """The mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def varying_like(tree, refs):
    """``tree`` with every leaf varying over the mesh axes that some leaf of ``refs`` varies over."""
    axes = frozenset().union(*(varying(r) for r in jax.tree.leaves(refs)))

    def widen(x):
        missing = tuple(sorted(axes - varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(widen, tree)
