"""What XLA makes of one rank's attention for a Hopper GPU, without a GPU: its launches by kind.

Compiles a rank's fwd + bwd (``rank_without_transfer``, as ``benchmarks/attention.py`` and
``rank_timeline.py`` read it, with our Pallas kernels) for an H100 or H200 on this machine, with
no GPU and no driver: the CUDA PJRT plugin compiles for a device it is told of (a "compile-only"
topology with the GPU's spec, which the plugin carries for the GPUs it knows), all the way to
machine code. XLA's thunk sequence (``xla_dump_to``) is then the program as the GPU would run
it: every XLA kernel, copy, custom call (our kernels) and command buffer. This backs changes to
the small XLA work around the kernels (finding 12: a few us a launch at 2k-token chunks) before
any GPU time: count the launches of two trees, then time the better one on a GPU.

Set up once (the plugin's wheel, about 135 MB, into an ignored folder; jax's own version)::

    .venv/bin/python -m pip install --no-deps --target .pjrt \
        "jax-cuda13-pjrt==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"

Run (``JAX_PLATFORMS=cpu``: jax must not open the plugin as a backend, which needs a GPU)::

    JAX_PLATFORMS=cpu PYTHONPATH=.pjrt .venv/bin/python experiments/rank_thunks.py \
        --seq 32k --n 8 --cases window512 causal documents4096 [--layers 1 2] [--gpu h200] \
        [--checkpoint [--save-masks]] [--scan] [--dump DIR] [--json out.json]

``--layers L``: L calls in one program, each layer's output the next one's queries (what a model's
step shares between its layers: masks of one configuration are computed once). ``--checkpoint``:
each call inside ``jax.checkpoint``, as a model that recomputes its layers in the backward
(``--save-masks``: with ``jax_cpgrad.masks_checkpoint_policy()``, which keeps the layer's masks).
``--scan``: the layers as the body of one ``lax.scan`` (as models that scan over their layers);
the launches in the loops' bodies, which run once a layer, are counted apart.

Not compiled as on a GPU: without a device XLA cannot autotune (its GEMM and fusion tiles may
differ), which leaves the launches' count and kinds as they are.

Our kernels are compiled here all the way to sm_90a machine code too: with
``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR`` Mosaic GPU writes each
kernel's PTX and ptxas' report (registers, spills) to DIR, one file pair per kernel (the dK/dV
kernels are those with 135168 bytes of shared memory in their ``.resources.txt``). A kernel
change that must not change the default form can be checked by its PTX without the ``.loc`` and
``.file`` lines (source positions), and a spill placed by its SASS (``ptxas`` on the PTX, then
``cuobjdump -sass`` from the ``nvidia-cuda-cuobjdump`` wheel).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib.util
import itertools
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention import document_ids, fwd_bwd, human_tokens, parse_tokens, rank_attention  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jax_cpgrad.attention import kernels, masks_checkpoint_policy  # noqa: E402

# name -> (window, documents' length: the sequence cut in documents of that many tokens, whether
# the layer is told that length: max_document_length, the window it implies)
CASES = {
    "causal": (None, None, False),
    "window512": (512, None, False),
    "window4096": (4096, None, False),
    "documents4096": (None, 4096, False),
    "documents4096bounded": (None, 4096, True),
}


def case_options(case: str, seq: int) -> dict:
    """``rank_attention``'s mask options for ``case`` (``CASES``) at ``seq`` tokens."""
    window, length, bounded = CASES[case]
    ids = None if length is None else np.asarray(document_ids(seq, length))
    return dict(ids=ids, window=window, max_document_length=length if bounded else None)


# the device_description_str of the specs the plugin carries
GPUS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e"}


def gpu_spec(name: str) -> str:
    """The GpuTargetConfigProto text of GPU ``name`` (``GPUS``), read from the CUDA PJRT plugin's
    binary, which embeds XLA's specs of the GPUs it knows (so it matches the plugin's version)."""
    found = importlib.util.find_spec("jax_plugins.xla_cuda13")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("no jax-cuda13-pjrt: see this file's docstring for the one-time set-up")
    (folder,) = found.submodule_search_locations
    with open(os.path.join(folder, "xla_cuda_plugin.so"), "rb") as fh:
        binary = fh.read()
    for m in re.finditer(rb"gpu_device_info \{\n", binary):
        text = binary[m.start() : binary.index(b"\x00", m.start())].decode()
        if f'device_description_str: "{GPUS[name]}"' in text:
            return text
    raise SystemExit(f"the plugin carries no spec of {GPUS[name]!r}")


def compile_only_device(gpu: str):
    """A device to compile for, of a one-GPU topology of ``gpu``, without a GPU."""
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name=gpu, target_config=gpu_spec(gpu), topology="1x1x1"
    )
    return topology.devices[0]


def thunks(text: str) -> dict:
    """Launches by kind from a thunk sequence's text (nested thunks counted where they run)."""
    counts = collections.Counter()
    xla_kernels = collections.Counter()
    in_body, per_iteration = False, 0  # launches in a while loop's body (``--scan``: each layer's)
    for line in text.splitlines():
        if line.strip() == "body:":
            in_body = True
        m = re.match(r"(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        indent, kind = m.groups()
        in_body = in_body and bool(indent)  # a thunk of the top level ends a loop's body
        counts[kind] += 1
        per_iteration += in_body and kind in ("kCustomKernel", "kCopy", "kCustomCall")
        if kind == "kCustomKernel":
            xla_kernels[line.split("]")[1].split()[0]] += 1
    return dict(
        xla_kernels=counts["kCustomKernel"],
        copies=counts["kCopy"],
        custom_calls=counts["kCustomCall"],
        command_buffers=counts["kCommandBuffer"],
        launches=counts["kCustomKernel"] + counts["kCopy"] + counts["kCustomCall"],
        in_loop_bodies=per_iteration,
        by_name=dict(sorted(xla_kernels.items())),
    )


_SHAPE = r"[a-z0-9]+\[([0-9,]*)\]"


def attention_calls(hlo: str) -> list[str]:
    """Our kernels in an optimized (scheduled) HLO module's order of execution, each named by what
    it is: the forward (``fwd``; ``continues`` with a previous part's out and lse), the dQ kernel
    (``dQ``; ``adds dQ`` with another part's), the dK/dV kernel, and the keys it reads (``L``,
    operand 1's length: a rank's own, the other ranks', a halo's). A profile lists the kernels in
    launch order under shared names; these say which is which. A scheduled computation runs in
    its text's order; a kernel inside a called computation (a fusion reading a dynamic slice in
    place, a command buffer, a scanned layer's loop body) runs where the call does; a loop body
    is listed once."""
    # computation -> its lines' kernels and called computations, in order: ("kernel" | "call", name)
    items: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    computation, entry = None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(2)
            entry = computation if header.group(1) else entry
        elif computation and 'custom_call_target="mosaic_gpu' in line:
            items[computation].append(("kernel", _kernel_name(line)))
        elif computation:
            called = re.findall(r"(?:calls|to_apply|body)=%([\w.\-]+)", line)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            called += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            items[computation] += [("call", name) for name in called]

    def expand(computation: str, depth: int = 0) -> list[str]:
        out = []
        for kind, name in items.get(computation, []) if depth < 16 else []:
            out += expand(name, depth + 1) if kind == "call" else [name]
        return out

    return expand(entry) if entry else []


def _kernel_name(line: str) -> str:
    """What a line's Mosaic GPU custom call is (``attention_calls``)."""
    result = line.split("custom-call(")[0]
    operands = re.search(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", line)
    shapes = re.findall(_SHAPE, operands.group(1)) if operands else []
    keys = int(shapes[1].split(",")[1]) if len(shapes) > 1 else -1
    outputs = re.findall(_SHAPE, result)
    if len(outputs) == 2 and outputs[1].count(",") == 2:  # (out or dq [B, T, N, H], lse or delta [B, N, T])
        kind = {4: "fwd", 6: "fwd continues", 7: "dQ", 8: "dQ adds dQ"}.get(len(shapes), f"? {len(shapes)}")
    else:
        kind = "dK/dV"
    return f"{kind} L={keys}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=parse_tokens, default=32 * 1024)
    p.add_argument("--n", type=int, nargs="+", default=[8])
    p.add_argument("--cases", nargs="+", default=["window512", "causal"], choices=sorted(CASES))
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, nargs="+", default=[1])
    p.add_argument("--checkpoint", action="store_true", help="each layer inside jax.checkpoint")
    p.add_argument("--scan", action="store_true", help="the layers as the body of a lax.scan")
    p.add_argument(
        "--save-masks", action="store_true", help="with --checkpoint: the policy that keeps the masks"
    )
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--dump", help="a folder: each case's XLA dump (the optimized HLO, the thunks)")
    p.add_argument("--json")
    opts = p.parse_args(argv)
    if opts.save_masks and not opts.checkpoint:
        p.error("--save-masks is a policy of --checkpoint: give both")
    if jax.default_backend() != "cpu":
        raise SystemExit("run with JAX_PLATFORMS=cpu (see the docstring)")
    # the layer refuses our kernels off Hopper: here there is no device at all to ask
    kernels.KERNELS = tuple(
        dataclasses.replace(k, refuses=lambda dtype, head_dim: None) if k.name == "mosaic" else k
        for k in kernels.KERNELS
    )
    sharding = SingleDeviceSharding(compile_only_device(opts.gpu))
    rows = []
    for case, n, layers in itertools.product(opts.cases, opts.n, opts.layers):
        local = opts.seq // n
        arg = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
        args = (
            arg(1, local, 32, 128), arg(1, local, opts.kv_heads, 128), arg(1, local, opts.kv_heads, 128),
            arg(1, local, 32, 128), arg(dt=jnp.int32),
        )  # fmt: skip
        options = case_options(case, opts.seq)

        def attend(q, k, v, rank, n=n, options=options, layers=layers):
            layer = lambda q, k, v, rank: rank_attention(q, k, v, rank, n, implementation="mosaic", **options)
            policy = masks_checkpoint_policy() if opts.save_masks else None
            step = jax.checkpoint(layer, policy=policy) if opts.checkpoint else layer
            if opts.scan:  # the layers as one loop body, as models that scan over their layers
                return jax.lax.scan(lambda q, _: (step(q, k, v, rank), None), q, None, length=layers)[0]
            for _ in range(layers):
                q = step(q, k, v, rank)
            return q

        f = fwd_bwd(attend)
        folder = os.path.join(opts.dump, f"{case}_n{n}_l{layers}") if opts.dump else tempfile.mkdtemp()
        compiled = f.lower(*args).compile(compiler_options={"xla_dump_to": folder})
        sequences = sorted(glob.glob(os.path.join(folder, "*thunk_sequence*.txt")))
        # the sequence after XLA's thunk passes (command buffers) where they changed it
        after = [s for s in sequences if "after_thunk_passes" in s] or sequences
        with open(after[-1]) as fh:
            row = dict(
                case=case, n=n, layers=layers, checkpoint=opts.checkpoint, save_masks=opts.save_masks,
                scan=opts.scan, seq=opts.seq,
                gpu=opts.gpu,
            )  # fmt: skip
            row |= thunks(fh.read())
        row["attention_calls"] = attention_calls(compiled.as_text())
        rows.append(row)
        print(
            f"{case} S={human_tokens(opts.seq)} R={n}, {layers} layer(s){' scanned' * opts.scan}"
            f"{' checkpointed' * opts.checkpoint}{' (masks saved)' * opts.save_masks} "
            f"({opts.gpu}): {row['launches']} "
            f"launches: {row['xla_kernels']} XLA kernels, {row['copies']} copies, "
            f"{row['custom_calls']} custom calls (our kernels); {row['command_buffers']} command buffer(s)"
            + (f"; {row['in_loop_bodies']} of them in loop bodies (each layer's)" if opts.scan else ""),
            flush=True,
        )
        print(f"      our kernels in order: {', '.join(row['attention_calls'])}")
        for name, count in row["by_name"].items():
            print(f"      x{count:<3} {name}")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
