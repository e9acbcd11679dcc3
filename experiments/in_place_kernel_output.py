"""Can a Pallas Mosaic GPU kernel write into an existing buffer in place, inside ``jax.shard_map``?

Backs the design of a cheaper remote call for documents (results: finding 12, "Where a documents
rank's excess goes"): the remote call would continue the local call's online softmax where its
out and lse lie, and a program whose queries see no remote key would write nothing. For that the
kernel must take the local part's out and lse as buffers it updates, not return new arrays that
XLA then merges. Two ways, each lowered for CUDA on a machine without a GPU (``jax.export``) and
checked for an aliased custom call (``output_operand_aliases``, no copy):

- ``ref``: ``plgpu.kernel`` given a ``jax.new_ref`` of the buffer as an operand;
- ``aliases``: ``pl.pallas_call`` with ``input_output_aliases`` on the Mosaic GPU backend.

Each outside and inside ``jax.shard_map`` (the layer runs inside one; a one-device mesh suffices),
and inside one made with ``check_vma=False`` (its values carry no varying axes)::

    JAX_PLATFORMS=cpu .venv/bin/python experiments/in_place_kernel_output.py

On jax 0.12.1 (2026-12-07): ``ref`` lowers to one aliased custom call outside ``shard_map`` and
fails inside it ("mpmd_map does not support Refs with varying manual axis types": the buffer
varies over the mesh axis, as every rank's does); ``aliases`` fails both ways (an assertion in
``pallas_call``'s GPU lowering: no rule is registered for ``plgpu.CompilerParams``). Inside a
``shard_map`` with ``check_vma=False`` the ``ref`` way lowers to one aliased custom call (checked
2026-12-07), but the layer runs inside its caller's ``shard_map`` and cannot choose that. So neither
way gives the layer an in-place kernel today; a kernel that copies the rows it does not update
(one read and one write of the local part's out, against the merge's three passes now) needs
neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, PartitionSpec as P

TILE = (128, 128)


def _first_program_adds(x_ref, o_ref):
    """Program 0 adds x to o; the others touch nothing (a program that sees no key)."""

    @pl.when(jax.lax.axis_index("i") == 0)
    def _():
        o_ref[...] = o_ref[...] + x_ref[...]


def by_ref(x, o):
    ref = jax.new_ref(o)
    plgpu.kernel(_first_program_adds, out_type=(), grid=(2,), grid_names=("i",))(x, ref)
    return ref[...]


def by_aliases(x, o):
    def body(x_ref, o_in_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = o_in_ref[...] + x_ref[...]

    spec = pl.BlockSpec(TILE, lambda i: (0, 0))
    out = jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=jax.typeof(o).manual_axis_type)
    return pl.pallas_call(
        body, out_shape=out, grid=(2,), in_specs=[spec, spec], out_specs=spec,
        input_output_aliases={1: 0}, compiler_params=plgpu.CompilerParams(),
    )(x, o)  # fmt: skip


def lowered(f, inside_shard_map: bool, check_vma: bool = True) -> str:
    """How ``f`` lowers for CUDA: its aliased custom calls, or the error."""
    if inside_shard_map:
        mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
        f = jax.shard_map(f, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=check_vma)
    x = jnp.ones(TILE, jnp.float32)
    try:
        text = jax.export.export(jax.jit(f), platforms=["cuda"])(x, x).mlir_module()
    except Exception as e:  # noqa: BLE001 (what fails is the finding)
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return f"lowers, {text.count('output_operand_aliases')} aliased custom call(s)"


def main() -> int:
    print(f"jax {jax.__version__}")
    places = (("outside shard_map", False, True), ("inside shard_map", True, True))
    places += (("inside, no vma check", True, False),)
    for name, f in (("ref", by_ref), ("aliases", by_aliases)):
        for where, inside, check_vma in places:
            print(f"{name:8} {where:21} {lowered(f, inside, check_vma)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
