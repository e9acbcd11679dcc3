"""A whole context-parallel training step, timed end to end: the package's transformer layers
(``jax_cpgrad.models.transformer``) with jax_cpgrad's CP attention layer, forward and full
backward, with the K/V gather and the dK/dV return on each transport side by side (same
parameters, same data). Makes the results' training-step tables ("A CP training step, x2, R = 2",
"Overlap on one H200", the layer's steps at R = 1: ``*_cp_step_*`` in benchmarks/results/).

    python benchmarks/cp_step.py --seq 8k 16k --hidden 2048 --kv-heads mha 4 --transport xla peer none
    python -m jax_cpgrad.launch -n 2 benchmarks/cp_step.py ...      # one process per GPU
    python benchmarks/cp_step.py --cpu --seq 256 --hidden 64 --heads 4 --layers 2   # CPU smoke run
    python benchmarks/cp_step.py --precision --seq 4k --hidden 1024 --heads 8       # errors vs fp32
    python benchmarks/cp_step.py --layers 4 --local-window-size 4096 4096 4096 none  # 3 local : 1 global

Layout: CP rank r of R holds sequence chunks r and 2R-1-r (S/(2R) tokens each). The model is
``transformer.apply_layers`` on random hidden states (no embedding or vocabulary head: the layers
are what is timed): per layer RMSNorm, Q/K/V projections (N query heads, K key/value heads: MHA or
GQA), causal attention with ``jax_cpgrad.dot_product_attention(q, k, v, axis_name="cp",
workspace=ws, implementation=..., head_groups=..., **the layer's options)`` (it gathers K and V
itself, runs the local part of the attention while they travel, and returns dK/dV to their
owners in its VJP: the ops this measures), output projection, residual, RMSNorm, GELU MLP,
residual. ``--local-window-size`` gives each layer its window (cycled over the layers; ``none``:
a global layer), passed through as the layer's ``local_window_size``. Loss: mean of squares of
the final hidden state. Parameters are float32 master weights used in --dtype (bf16);
``jax.value_and_grad`` over all of them inside ``jax.shard_map`` over the 1-D mesh axis "cp", one
jitted step returning loss and grads.

Transports: ``xla`` (no workspace: XLA collectives, i.e. NCCL on GPUs), ``peer`` (a
``jax_cpgrad.Workspace``; --protocol, several protocols give one row each: by default the plain
calls and the overlapped pairs, whose transfers run beside the local part of the attention),
``none`` (``jax_cpgrad.attention.rank_without_transfer``: the same attention with a local copy in
place of every transfer). Communication share = step(transport) - step(none). Per config and
transport: median step time and spread, tokens/s, XLA's memory estimate for the step and the
device's peak bytes, the workspace's own bytes. Before timing, the layer is checked against
``jax.nn.dot_product_attention`` at a small size (--no-attention-check skips it). The JSON rows
name the config as the command line does (hidden, head_dim, ffn, seq; ``n`` is R), as in every
recorded run.

At R = 1 the layer would skip its transfer (one attention call); this benchmark calls it with
``transfer_when_alone=True`` (``jax_cpgrad.attention.layer.attention``, the tests' entry) so
that the rows of one GPU still time the transfer path, a rank gathering from itself.
``rank_without_transfer`` has no such switch: at R = 1 the ``none`` row is one attention call,
not the split.

--precision: instead of timing, one step of a small config per transport in --dtype against the
same model unsharded on one device in float32 (``jax.nn.dot_product_attention``, XLA): errors of
the loss, of dK/dV as they arrive at the owner (the gradient w.r.t. probes added to the local K
and V, ``apply_layers(kv_probes=...)``) and of the parameter gradients.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (NVLS) on the shared GPU machines

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform as platform_mod  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import step_profile  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from workspace_options import workspace_options  # noqa: E402

import jax_cpgrad as cpg  # noqa: E402
from jax_cpgrad import launch  # noqa: E402
from jax_cpgrad.attention import layer as attention_layer, rank_without_transfer  # noqa: E402
from jax_cpgrad.models import transformer  # noqa: E402
from jax_cpgrad.models.transformer import Config  # noqa: E402

AXIS = "cp"
ENV_RECORDED = ("XLA_FLAGS", "NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE")  # into the JSON
TRANSPORTS = ("xla", "peer", "none")
# "auto": the layer's own choice (implementation=None: cuDNN for plain calls, our kernels for
# windows on sm_90, XLA elsewhere)
IMPLEMENTATIONS = ("auto", "cudnn", "xla", "mosaic")
GRADIENT_NAMES = ("out", "dq", "dk", "dv")


# -- configuration ---------------------------------------------------------------------------

# The JSON rows' names for the model's Config fields (the command line's, as in every recorded run).
ROW_FIELDS = {
    "layers": "layers",
    "hidden": "d_model",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "head_dim": "d_head",
    "ffn": "d_ff",
    "seq": "seq_len",
    "batch": "batch",
    "dtype": "dtype",
    "implementation": "implementation",
    "head_groups": "head_groups",
    "layer_attention": "layer_attention",
}


def model_config(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    seq: int,
    batch: int = 1,
    dtype: str = "bfloat16",
    implementation: str = "xla",
    head_groups: int = 1,
    layer_attention=(),
) -> Config:
    """The package model's Config from the benchmark's names (a JSON row's, the command line's)."""
    fields = {ROW_FIELDS[k]: v for k, v in dict(locals()).items()}
    return Config(**{**fields, "layer_attention": tuple(layer_attention)})


def describe(cfg: Config) -> dict:
    """cfg under the benchmark's names: the start of a JSON row (``model_config`` inverts it)."""
    out = {row: getattr(cfg, field) for row, field in ROW_FIELDS.items()}
    out["kv_heads"], out["layer_attention"] = cfg.num_kv_heads, list(cfg.layer_attention)
    return out


def label(cfg: Config) -> str:
    kv = "MHA" if cfg.num_kv_heads == cfg.heads else f"GQA{cfg.num_kv_heads}"
    groups = f" G={cfg.head_groups}" if cfg.head_groups > 1 else ""
    windows = [o.get("local_window_size") for o in cfg.layer_attention]
    local = f" win={'/'.join(human_tokens(w) if w else 'g' for w in windows)}" if any(windows) else ""
    return (
        f"S={human_tokens(cfg.seq_len)} h={cfg.d_model} {cfg.heads}x{cfg.d_head} {kv} "
        f"{cfg.implementation}{groups}{local}"
    )


def workspace_nbytes(cfg: Config, ranks: int) -> int:
    """The workspace capacity: one layer's local K and V (one workspace serves all layers)."""
    return cpg.attention_workspace_nbytes(cfg.local_kv(ranks))


def parse_tokens(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    t = str(text).strip()
    return int(float(t[:-1]) * units[t[-1].upper()]) if t[-1].upper() in units else int(t)


def human_tokens(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % (1 << 10) == 0 else str(n)


def init_params_numpy(cfg: Config, seed: int) -> list[dict]:
    """The model's layers as the package draws them (``transformer.init_params``), as numpy."""
    return jax.tree.map(np.asarray, transformer.init_params(cfg, seed)["layers"])


def init_params_device(mesh, cfg: Config, seed: int):
    """Random layers (``transformer.layer_param_shapes``) generated on the devices, replicated (any
    process count, no host copy)."""
    shapes = transformer.layer_param_shapes(cfg)

    def make(key):
        out = []
        for i in range(cfg.layers):
            keys = jax.random.split(jax.random.fold_in(key, i), len(shapes))
            out.append(
                {
                    name: jnp.ones(shape, jnp.float32)
                    if scale is None
                    else jax.random.normal(k, shape, jnp.float32) * scale
                    for k, (name, (shape, scale)) in zip(keys, shapes.items(), strict=True)
                }
            )
        return out

    return jax.jit(make, out_shardings=NamedSharding(mesh, P()))(jax.random.key(seed))


# -- the model: the package's layers, this benchmark's loss ------------------------------------


def forward_loss_sum(params, x, probes, cfg: Config, attend):
    """Sum of squares of the final hidden state of the given (local) tokens, float32.

    attend(q, k, v, **options) -> [B, T, N, H]: the attention of these tokens. probes: per layer
    (pk, pv) zeros added to the local K and V after the projection (their gradient is dK/dV as the
    owner gets it), or empty.
    """
    x = transformer.apply_layers(params, x, cfg, attend, kv_probes=probes)
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def loss_count(cfg: Config) -> int:
    return cfg.batch * cfg.seq_len * cfg.d_model


reference_attention = functools.partial(transformer.unsharded_attention, implementation="xla")
reference_attention.__doc__ = "Unsharded causal attention (natural order), XLA."
# The layer as cpg.dot_product_attention, but on the transfer's path at R = 1 too (the module
# docstring says why); at R > 1 the two are one.
cp_attention = functools.partial(attention_layer.attention, transfer_when_alone=True)


def reference_loss_and_grads(params, x, probes, cfg: Config):
    """The unsharded model (natural order, plain attention) on the default device:
    (mean loss, parameter grads, probe grads = dK/dV per layer)."""

    def mean_loss(p, pr):
        return forward_loss_sum(p, x, pr, cfg, reference_attention) / loss_count(cfg)

    return jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))(params, probes)


def layer_implementation(cfg: Config) -> str | None:
    """The layer's ``implementation=`` for the config's name ("auto": None)."""
    return None if cfg.implementation == "auto" else cfg.implementation


def make_attention(transport: str, ranks: int, workspace, cfg: Config):
    """attend(q, k, v, **options) of one rank inside the step's shard_map: the layer on the
    transport, or (`none`) the same attention without communication."""
    common = dict(implementation=layer_implementation(cfg), head_groups=cfg.head_groups)
    if transport == "none":
        return lambda q, k, v, **options: rank_without_transfer(
            q, k, v, jax.lax.axis_index(AXIS), ranks, **common, **options
        )
    ws = workspace if transport == "peer" else None
    return lambda q, k, v, **options: cp_attention(q, k, v, axis_name=AXIS, workspace=ws, **common, **options)


def make_step(cfg: Config, mesh, transport: str, workspace=None):
    """jit(shard_map(step)): step(params, x, probes) -> (mean loss, parameter grads, probe grads).

    params replicated; x [B, S, hidden] in CP layout sharded on dim 1. The probes (zeros) only
    serve --precision; the timing passes []. probes: per layer (pk, pv) [B, S, K, H] in CP
    layout sharded on dim 1 (gradient: dK/dV of the local keys, as their owner gets them).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "peer" and workspace is None:
        raise ValueError("the peer transport needs a workspace")
    attend = make_attention(transport, mesh.shape[AXIS], workspace, cfg)

    def body(params, x, probes):
        def local_loss(p, pr):  # this rank's share of the global mean
            return forward_loss_sum(p, x, pr, cfg, attend) / loss_count(cfg)

        loss, (grads, probe_grads) = jax.value_and_grad(local_loss, argnums=(0, 1))(params, probes)
        # The parameter gradients are per-rank partial sums: all-reduce them with psum, on every
        # transport (NCCL on GPUs, for the peer transport too). That choice is deliberate: this
        # benchmark measures the K/V gather and the dK/dV return (jax_cpgrad), not the optimizer's
        # all-reduce, and it keeps that part identical across the transports compared.
        return jax.lax.psum(loss, AXIS), jax.lax.psum(grads, AXIS), probe_grads

    # check_vma=False: parameters enter replicated and their gradients stay per-rank partial
    # sums until the explicit psum above (no implicit reduction is inserted).
    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(None, AXIS), P(None, AXIS)),
        out_specs=(P(), P(), P(None, AXIS)),
        check_vma=False,
    )
    return jax.jit(step)


# -- placement ---------------------------------------------------------------------------------


def place(mesh, array: np.ndarray, spec):
    """A global array from the same host array on every process."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


def random_hidden(mesh, cfg: Config, seed: int):
    """Random input hidden states [B, S, hidden] generated on the devices, sharded on the sequence
    (values do not matter for timing; any process count)."""
    shape, dt = (cfg.batch, cfg.seq_len, cfg.d_model), jnp.dtype(cfg.dtype)
    make = lambda key: jax.random.normal(key, shape, jnp.float32).astype(dt)
    return jax.jit(make, out_shardings=NamedSharding(mesh, P(None, AXIS)))(jax.random.key(seed + 1))


def to_host(x) -> np.ndarray:
    """The whole global array as numpy on this process (any process count)."""
    if jax.process_count() == 1 or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_scalar(x) -> float:
    return float(np.asarray(x.addressable_data(0)))


def rounded(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded to `dtype`, as float32 numpy: the inputs both sides of a comparison see."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def to_cp(mesh, x: np.ndarray, dtype):
    """A natural-order host array [B, S, ...] in the CP layout, in `dtype`, sharded on S."""
    laid = np.asarray(cpg.to_cp_layout(x, mesh.shape[AXIS], seq_axis=1))
    return place(mesh, laid.astype(jnp.dtype(dtype)), P(None, AXIS))


def from_cp(x, n: int) -> np.ndarray:
    """A CP-layout global array [B, S, ...] in natural order, float32 numpy (any process count)."""
    return np.asarray(cpg.from_cp_layout(to_host(x).astype(np.float32), n, seq_axis=1))


# -- workspace -----------------------------------------------------------------------------------


def make_workspace(mesh, nbytes: int, protocol: str):
    """cpg.Workspace for the peer transport; `protocol` is a benchmarks/workspace_options.py name
    ("auto", "device:32:0.5+overlap", ...)."""
    kwargs = workspace_options(protocol)
    return cpg.Workspace(mesh, AXIS, nbytes=int(nbytes), name="cp_step", **kwargs)


# -- timing ----------------------------------------------------------------------------------------


def _memory_analysis(compiled) -> dict:
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return {}
    if m is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    out = {f: int(getattr(m, f, 0) or 0) for f in fields}
    out["xla_peak_bytes_estimate"] = (
        out["argument_size_in_bytes"]
        + out["output_size_in_bytes"]
        + out["temp_size_in_bytes"]
        - out["alias_size_in_bytes"]
    )
    return out


def device_memory() -> dict:
    """The first local device's allocator counters (None on the CPU). peak_bytes_in_use is the
    peak since the process started, not per config."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        stats = None
    if not stats:
        return {"peak_bytes_in_use": None, "bytes_in_use": None, "bytes_limit": None}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def time_step(
    step, args, steps: int, warmup: int, profile_steps: int = 0, hlo_path: str | None = None
) -> dict:
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    if hlo_path:  # the scheduled program: what runs between an async start and its done
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    mem = _memory_analysis(compiled)
    out = None
    for _ in range(max(warmup, 1)):  # at least one: the first call allocates and loads kernels
        out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    loss = local_scalar(out[0])
    del out
    profile = step_profile.profile_step(compiled, args, profile_steps) if profile_steps else None
    del compiled
    t = np.asarray(times)
    return {
        "profile": profile,
        "median_s": float(np.median(t)),
        "min_s": float(t.min()),
        "max_s": float(t.max()),
        "p10_s": float(np.percentile(t, 10)),
        "p90_s": float(np.percentile(t, 90)),
        "steps": steps,
        "compile_s": compile_s,
        "loss": loss,
        "times_s": [float(x) for x in t],
        **mem,
    }


# -- the runs --------------------------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048], help="d_model; a list runs each")
    p.add_argument("--heads", type=int, default=None, help="query heads (default hidden / head-dim)")
    p.add_argument("--kv-heads", nargs="+", default=["mha"], help="KV heads: ints or 'mha' (= heads); a list")
    p.add_argument("--head-dim", type=int, default=None, help="default hidden/heads, or 128 without --heads")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x hidden)")
    p.add_argument("--seq", nargs="+", default=["8k"], help="global sequence lengths (8k, 16k, 1M, ...)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--n", type=int, default=None, help="R, the CP size (default: every device)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--transport",
        nargs="+",
        default=None,
        choices=TRANSPORTS,
        help="default: xla peer none (peer only on GPUs with the CUDA build)",
    )
    p.add_argument(
        "--protocol",
        nargs="+",
        default=["auto", "auto+overlap"],
        help="peer transport workspace(s), one row each: <auto|device|memop>[:B[:S]][+overlap] (SM budget B, "
        "push share S, every transfer a start/done pair on the workspace's stream with the local part of "
        "the attention between); default: with and without overlap, side by side",
    )
    p.add_argument(
        "--implementation",
        default=None,
        choices=IMPLEMENTATIONS,
        help="the layer's attention kernels (default: on GPUs for bfloat16 cudnn, or auto (the "
        "layer's choice) when a layer has a window; xla otherwise)",
    )
    p.add_argument(
        "--head-groups",
        type=int,
        default=1,
        help="the layer's transfer pipelined over this many groups of key/value heads (must divide them)",
    )
    p.add_argument(
        "--local-window-size",
        nargs="+",
        default=None,
        help="per layer, cycled over the layers: a sliding window (the layer's local_window_size) or "
        "'none' (a global causal layer); e.g. 4096 4096 4096 none. Default: every layer global",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after timing, trace this many steps with jax.profiler: per GPU, the communication "
        "kernels' time, the part of it no compute kernel ran beside (exposed), and their streams",
    )
    p.add_argument("--hlo", action="store_true", help="write each compiled step's HLO text next to --json")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no new config after this many seconds (what finished is still written)",
    )
    p.add_argument(
        "--precision", action="store_true", help="errors vs a float32 unsharded reference, no timing"
    )
    p.add_argument(
        "--no-attention-check",
        action="store_true",
        help="skip the startup check of the layer against jax.nn.dot_product_attention",
    )
    p.add_argument("--cpu", action="store_true", help="8 CPU devices")
    p.add_argument("--json", default="cp_step.json")
    p.add_argument("--png", default="cp_step.png")
    opts = p.parse_args(argv)
    for name in opts.protocol:
        try:
            workspace_options(name)
        except ValueError as err:
            p.error(str(err))
    return opts


def layer_attention(windows) -> tuple[dict, ...]:
    """--local-window-size's words as the model's per-layer attention options."""
    if not windows:
        return ()
    out = []
    for w in windows:
        if str(w).lower() in ("none", "global"):
            out.append({})
        elif str(w).isdigit() and int(w) > 0:
            out.append({"local_window_size": int(w)})
        else:
            raise SystemExit(f"--local-window-size {w}: a positive int or 'none'")
    return tuple(out)


def configs(opts, on_gpu: bool) -> list[Config]:
    options = layer_attention(opts.local_window_size)
    windowed = any(o.get("local_window_size") is not None for o in options)
    gpu_choice = "auto" if windowed else "cudnn"
    implementation = opts.implementation or (gpu_choice if on_gpu and opts.dtype == "bfloat16" else "xla")
    out = []
    for seq_text in opts.seq:  # sequence outermost: a time budget cuts the longest ones
        for hidden in opts.hidden:
            if opts.heads:
                heads, head_dim = opts.heads, opts.head_dim or hidden // opts.heads
            else:
                head_dim = opts.head_dim or 128
                heads = hidden // head_dim
            for kv_text in opts.kv_heads:
                kv = heads if str(kv_text).lower() == "mha" else int(kv_text)
                if kv <= 0 or heads % kv:
                    raise SystemExit(f"--kv-heads {kv_text}: must divide the {heads} query heads")
                if opts.head_groups < 1 or kv % opts.head_groups:
                    raise SystemExit(
                        f"--head-groups {opts.head_groups}: must divide the {kv} key/value heads"
                    )
                out.append(
                    model_config(
                        layers=opts.layers,
                        hidden=hidden,
                        heads=heads,
                        kv_heads=kv,
                        head_dim=head_dim,
                        ffn=opts.ffn or 4 * hidden,
                        seq=parse_tokens(seq_text),
                        batch=opts.batch,
                        dtype=opts.dtype,
                        implementation=implementation,
                        head_groups=opts.head_groups,
                        layer_attention=options,
                    )
                )
    return out


def transports_to_run(opts, on_gpu: bool, has_cuda: bool, say) -> list[tuple[str, str, str | None]]:
    """(row name, transport, protocol); `none` first, so every later row can show its comm share."""
    peer_ok = on_gpu and has_cuda
    wanted = opts.transport or (["xla", "peer", "none"] if peer_ok else ["xla", "none"])
    out = []
    for t in sorted(dict.fromkeys(wanted), key=lambda t: t != "none"):
        if t == "peer" and not peer_ok:
            say("peer transport skipped: it needs GPUs and jax_cpgrad built with CUDA")
        elif t == "peer":
            protocols = list(dict.fromkeys(opts.protocol))
            out += [("peer" if len(protocols) == 1 else f"peer-{p}", "peer", p) for p in protocols]
        else:
            out.append((t, t, None))
    return out


def _collective_flag(flag: bool) -> bool:
    """Process 0's decision, on every process (so all of them stop at the same config)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def _free_memory():
    gc.collect()
    jax.clear_caches()
    gc.collect()


def _hlo_path(opts, cfg: Config, transport: str) -> str | None:
    """--hlo: the compiled step's text goes next to the JSON, one file per config and transport."""
    if not opts.hlo:
        return None
    name = f"{label(cfg)}_{transport}".replace(" ", "_").replace("=", "").replace("+", "_")
    return os.path.join(os.path.dirname(os.path.abspath(opts.json)), f"hlo_{name}.txt")


def _row(cfg: Config, n: int, transport: str, protocol: str | None, **fields) -> dict:
    """The start of one result row: the config, R (as ``n``), the row's transport name and protocol."""
    return {**describe(cfg), "n": n, "transport": transport, "protocol": protocol, **fields}


def run_config(cfg: Config, mesh, transports, opts, say) -> list[dict]:
    n = mesh.shape[AXIS]
    if cfg.seq_len % (2 * n):
        raise ValueError(f"sequence {cfg.seq_len} is not divisible by 2R = {2 * n}")
    params = init_params_device(mesh, cfg, opts.seed)
    x = random_hidden(mesh, cfg, opts.seed)
    rows, none_s = [], None
    for name, transport, protocol in transports:
        row = _row(
            cfg,
            n,
            name,
            protocol,
            tokens_per_step=cfg.batch * cfg.seq_len,
            workspace_nbytes=None,
            workspace_bytes_per_device=None,
        )
        ws = None
        try:
            if transport == "peer":
                row["workspace_nbytes"] = workspace_nbytes(cfg, n)
                ws = make_workspace(mesh, row["workspace_nbytes"], protocol)
                row["workspace_bytes_per_device"] = int(ws.bytes_per_device)
                spec = getattr(ws, "spec", None)  # what "auto" chose, where this jax_cpgrad tells
                row["workspace_protocol"] = getattr(spec, "protocol", None) or getattr(ws, "protocol", None)
            row.update(
                time_step(
                    make_step(cfg, mesh, transport, ws),
                    (params, x, []),
                    opts.steps,
                    opts.warmup,
                    opts.profile_steps,
                    _hlo_path(opts, cfg, name),
                )
            )
            if ws is not None:
                ws.check()  # a peer that timed out poisons the workspace: fail the row, not silently
            row["tokens_per_s"] = row["tokens_per_step"] / row["median_s"]
            if transport == "none":
                none_s = row["median_s"]
            if none_s is not None and transport != "none":
                row["comm_s"] = row["median_s"] - none_s
                row["comm_fraction"] = row["comm_s"] / row["median_s"]
        except Exception as err:  # one failing row (e.g. out of memory) must not end the grid
            row["error"] = f"{type(err).__name__}: {err}"[:3000]
        finally:
            if ws is not None:
                ws.close()
            _free_memory()
        row.update(device_memory())
        rows.append(row)
        say(format_row(row))
        for gpu, prof in (row.get("profile") or {}).items():
            say(f"    profile {gpu}: {format_profile(prof)}")
    del params, x
    _free_memory()
    return rows


HEADER = (
    f"{'config':<40} | {'transport':<11} {'ms/step':>9} {'p10-p90 ms':>17} {'Ktok/s':>8} "
    f"{'comm ms':>8} {'comm %':>6} {'XLA GiB':>8} {'peak GiB':>8} {'ws MiB':>7} {'compile s':>9}"
)


def format_profile(prof) -> str:
    if not isinstance(prof, dict):
        return str(prof)
    parts = [f"compute {prof['compute_ms']:.2f}", f"idle {prof['idle_ms']:.2f}"]
    for kind in step_profile.KINDS:
        k = prof[kind]
        if k["kernels_per_step"]:
            parts.append(
                f"{kind} {k['ms']:.2f} (exposed {k['exposed_ms']:.2f}, "
                f"{k['kernels_per_step']:.0f} kernels on {', '.join(k['streams'])})"
            )
    return "ms/step: " + "; ".join(parts)


def format_row(row: dict) -> str:
    cfg = model_config(**{k: row[k] for k in ROW_FIELDS if k in row})
    head = f"{label(cfg):<40} | {row['transport']:<11}"
    if "error" in row:
        return f"{head} FAILED: {row['error'].splitlines()[0][:200]}"
    gib = lambda b: f"{b / 2**30:.1f}" if b else "-"
    comm = row.get("comm_s")
    comm_ms = f"{comm * 1e3:.2f}" if comm is not None else "-"
    comm_pct = f"{100 * row['comm_fraction']:.1f}" if comm is not None else "-"
    spread = f"{row['p10_s'] * 1e3:.2f}-{row['p90_s'] * 1e3:.2f}"
    ws = row.get("workspace_bytes_per_device")
    ws_mib = f"{ws / 2**20:.0f}" if ws else "-"
    return (
        f"{head} {row['median_s'] * 1e3:>9.2f} {spread:>17} {row['tokens_per_s'] / 1e3:>8.1f} "
        f"{comm_ms:>8} {comm_pct:>6} {gib(row.get('xla_peak_bytes_estimate')):>8} "
        f"{gib(row.get('peak_bytes_in_use')):>8} {ws_mib:>7} {row['compile_s']:>9.1f}"
    )


def _out_and_grads(attend, q, k, v, ct):
    """attend's output and the gradients of q, k, v for the output cotangent ct."""
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(ct))


def check_layer(mesh, cfg: Config, chunk: int = 64, seed: int = 0, options=None) -> dict:
    """The layer (XLA collectives; cfg's implementation, dtype and heads, a layer's ``options``) on
    every rank of the mesh at S = 2R x chunk against float32 ``jax.nn.dot_product_attention`` on
    the same rounded inputs: the largest error of the output and of dq, dk, dv (random output
    cotangent), relative to the reference's largest magnitude. On a GPU this catches a wrong cuDNN
    path before anything is timed."""
    n, rng, options = mesh.shape[AXIS], np.random.default_rng(seed), options or {}
    q_shape = (1, 2 * n * chunk, cfg.heads, cfg.d_head)
    kv_shape = (*q_shape[:2], cfg.num_kv_heads, cfg.d_head)
    inputs = [rounded(rng.standard_normal(s), cfg.dtype) for s in (q_shape, kv_shape, kv_shape, q_shape)]
    ref = jax.jit(functools.partial(_out_and_grads, functools.partial(reference_attention, **options)))(
        *inputs
    )
    impl = layer_implementation(cfg)
    layer = functools.partial(cp_attention, axis_name=AXIS, implementation=impl, **options)
    spec = P(None, AXIS)
    run = jax.jit(
        jax.shard_map(functools.partial(_out_and_grads, layer), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    got = run(*(to_cp(mesh, x, cfg.dtype) for x in inputs))
    relative = lambda g, r: float(np.max(np.abs(from_cp(g, n) - r)) / (np.max(np.abs(r)) + 1e-30))
    return {name: relative(g, np.asarray(r)) for name, g, r in zip(GRADIENT_NAMES, got, ref, strict=True)}


def attention_checks(cfgs, mesh, say) -> dict:
    """check_layer once per implementation for MHA and for GQA (the first config of each) and per
    distinct layer options, before anything is timed; every process takes part (the layer runs on
    the whole mesh)."""
    out, seen = {}, set()
    todo = [(c, o) for c in cfgs for o in (c.layer_attention or ({},))]
    for cfg, options in todo:
        what = (cfg.implementation, cfg.num_kv_heads == cfg.heads, tuple(sorted(options.items())))
        if what in seen:
            continue
        seen.add(what)
        key = f"{cfg.implementation} N={cfg.heads} K={cfg.num_kv_heads} H={cfg.d_head} {cfg.dtype}"
        key += "".join(f" {k}={v}" for k, v in sorted(options.items()))
        try:
            errs: dict = check_layer(mesh, cfg, options=options)
            errs["ok"] = max(errs.values()) < 0.05  # bf16 inputs and outputs: a few 1e-3 expected
            say(
                f"attention check {key}: max error relative to max |ref|: "
                + ", ".join(f"{k} {v:.1e}" for k, v in errs.items() if k != "ok")
                + ("" if errs["ok"] else "   <-- WRONG: do not trust the timings of this layer")
            )
        except Exception as err:
            errs = {"ok": False, "error": f"{type(err).__name__}: {err}"[:3000]}
            say(f"attention check {key}: FAILED: {errs['error'].splitlines()[0][:300]}")
        out[key] = errs
    return out


def run_timing(opts, mesh, say, meta) -> list[dict]:
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    cfgs = configs(opts, on_gpu)
    transports = transports_to_run(opts, on_gpu, cpg.HAS_CUDA, say)
    meta["transports"] = [t[0] for t in transports]
    if not opts.no_attention_check:
        meta["attention_check"] = attention_checks(cfgs, mesh, say)
    say(
        f"{len(cfgs)} config(s) x {len(transports)} transport(s), {opts.layers} layer(s), {opts.steps} steps "
        f"after {opts.warmup} warm-up"
        + (f", time budget {opts.time_budget_s:.0f} s" if opts.time_budget_s else "")
    )
    say(HEADER)
    rows, start = [], opts.started
    meta["skipped_configs"] = []
    for i, cfg in enumerate(cfgs):  # the budget counts from the start of the script
        over = opts.time_budget_s is not None and time.perf_counter() - start > opts.time_budget_s
        if _collective_flag(over):
            meta["skipped_configs"] = [describe(c) for c in cfgs[i:]]
            say(f"time budget of {opts.time_budget_s:.0f} s spent: {len(cfgs) - i} config(s) not started")
            break
        rows += run_config(cfg, mesh, transports, opts, say)
        if jax.process_index() == 0:
            write_json(opts.json, meta, rows)  # after every config: partial results survive
    meta["elapsed_s"] = time.perf_counter() - start
    return rows


# -- precision ---------------------------------------------------------------------------------


def _errors(got: np.ndarray, ref: np.ndarray) -> dict:
    d = np.asarray(got, np.float64) - np.asarray(ref, np.float64)
    ref_rms = float(np.sqrt(np.mean(np.square(np.asarray(ref, np.float64)))))
    rms = float(np.sqrt(np.mean(d * d)))
    return {
        "max_abs": float(np.max(np.abs(d))),
        "rms": rms,
        "ref_rms": ref_rms,
        "rel_rms": rms / ref_rms if ref_rms else None,
    }


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])


def _stack_dkdv(probe_grads, convert) -> list[np.ndarray]:
    """[dK of every layer, dV of every layer], each stacked over the layers."""
    return [np.stack([convert(layer[i]) for layer in probe_grads]) for i in range(2)]


def precision_reference(cfg: Config, seed: int):
    """Host inputs (parameters, natural-order x rounded to the run's dtype: only the computation's
    errors count) and the float32 unsharded model's (loss, parameter grads, [dK, dV])."""
    params = init_params_numpy(cfg, seed)
    x = rounded(
        np.random.default_rng(seed + 1).standard_normal((cfg.batch, cfg.seq_len, cfg.d_model)), cfg.dtype
    )
    zeros = [(np.zeros(cfg.local_kv(1).shape, np.float32),) * 2] * cfg.layers  # the global K's shape
    put = functools.partial(jax.device_put, device=jax.local_devices()[0])
    f32 = dataclasses.replace(cfg, dtype="float32")
    loss, (grads, probe_grads) = reference_loss_and_grads(put(params), put(x), put(zeros), f32)
    return (params, x), (float(loss), jax.tree.map(np.asarray, grads), _stack_dkdv(probe_grads, np.asarray))


def precision_row(cfg: Config, mesh, inputs, ref, name: str, transport: str, protocol) -> tuple[dict, list]:
    """One transport's step on the CP mesh against the reference: (row of errors, [dK, dV])."""
    n = mesh.shape[AXIS]
    params, x = inputs
    ref_loss, ref_grads, ref_dkdv = ref
    row = _row(cfg, n, name, protocol, reference_loss=ref_loss)
    zeros = to_cp(mesh, np.zeros(cfg.local_kv(1).shape, np.float32), cfg.dtype)  # the global K's shape
    probes = [(zeros, zeros)] * cfg.layers
    ws = make_workspace(mesh, workspace_nbytes(cfg, n), protocol) if transport == "peer" else None
    try:
        step = make_step(cfg, mesh, transport, ws)
        loss, grads, probe_grads = step(
            jax.tree.map(lambda a: place(mesh, a, P()), params), to_cp(mesh, x, cfg.dtype), probes
        )
        if ws is not None:
            ws.check()
    finally:
        if ws is not None:
            ws.close()
    loss, grads = local_scalar(loss), jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), grads)
    dkdv = _stack_dkdv(probe_grads, lambda a: from_cp(a, n))
    row["loss"] = {
        "value": loss,
        "abs_err": abs(loss - ref_loss),
        "rel_err": abs(loss - ref_loss) / abs(ref_loss),
    }
    row["dk"], row["dv"] = (_errors(dkdv[i], ref_dkdv[i]) for i in range(2))
    for w in ("wk", "wv"):
        row[f"grad_{w}"] = _errors(_flat([g[w] for g in grads]), _flat([g[w] for g in ref_grads]))
    row["grad_all_params"] = _errors(_flat(grads), _flat(ref_grads))
    return row, dkdv


def run_precision(opts, mesh, say, meta) -> list[dict]:
    """One step of the first config per exact transport (not `none`) against the same model in
    float32 on one device: errors of the loss, of dK/dV as the owners get them and of the
    parameter gradients; and how far apart the transports' dK/dV are."""
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    n = mesh.shape[AXIS]
    cfg = configs(opts, on_gpu)[0]
    transports = [t for t in transports_to_run(opts, on_gpu, cpg.HAS_CUDA, say) if t[1] != "none"]
    meta["transports"] = [t[0] for t in transports]
    say(f"precision: {label(cfg)}, {cfg.layers} layer(s), {cfg.dtype} on R={n} vs float32 unsharded")
    inputs, ref = precision_reference(cfg, opts.seed)
    rows, first = [], None
    for name, transport, protocol in transports:
        try:
            row, dkdv = precision_row(cfg, mesh, inputs, ref, name, transport, protocol)
        except Exception as err:
            rows.append(_row(cfg, n, name, protocol, error=f"{type(err).__name__}: {err}"[:3000]))
            continue
        if first is None:
            first = (name, dkdv)
        else:  # same data, same model: how far apart the transports' dK/dV are
            diff = max(float(np.max(np.abs(dkdv[i] - first[1][i]))) for i in range(2))
            row[f"dkdv_max_abs_diff_vs_{first[0]}"] = diff
        rows.append(row)
    print_precision(rows, ref[0], n, say)
    return rows


def print_precision(rows: list[dict], ref_loss: float, n: int, say) -> None:
    say(
        f"{'transport':<11} {'quantity':<16} {'max abs err':>12} {'rms err':>10} {'rms ref':>10} "
        f"{'rel rms':>9}"
    )
    for row in rows:
        if "error" in row:
            say(f"{row['transport']:<11} FAILED: {row['error'].splitlines()[0][:300]}")
            continue
        lo = row["loss"]
        say(
            f"{row['transport']:<11} {'loss':<16} {lo['abs_err']:>12.3e} {'':>10} {abs(ref_loss):>10.3e} "
            f"{lo['rel_err']:>9.2e}"
        )
        for q in ("dk", "dv", "grad_wk", "grad_wv", "grad_all_params"):
            e = row[q]
            say(
                f"{row['transport']:<11} {q:<16} {e['max_abs']:>12.3e} {e['rms']:>10.3e} "
                f"{e['ref_rms']:>10.3e} {e['rel_rms']:>9.2e}"
            )
        for k, v in row.items():
            if k.startswith("dkdv_max_abs_diff"):
                say(f"{row['transport']:<11} {k}: {v:.3e}")
    say(
        "dk/dv (as the owners get them), grad_*: vs the float32 unsharded model (dominated by the "
        "bf16 computation)"
    )
    if n == 2:
        say(
            "note: with R=2 each dK/dV sum has two terms, exact in float32, so one bf16 add and a float32 "
            "add rounded once agree: the transports can differ only from R=3 on"
        )


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1, default=str)


def write_png(path: str, meta: dict, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install jax_cpgrad[bench])")
        return
    ok = [r for r in rows if "median_s" in r]
    group_of = lambda r: (
        r["hidden"],
        r["heads"],
        r["kv_heads"],
        r["implementation"],
        r["layers"],
        r["batch"],
    )
    groups = list(dict.fromkeys(group_of(r) for r in ok))
    if not groups:
        print("no finished row: no plot")
        return
    cols = min(3, len(groups))
    rows_n = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 4 * rows_n), squeeze=False)
    for ax, g in zip(axes.flat, groups, strict=False):  # spare axes are turned off
        pts = [r for r in ok if group_of(r) == g]
        for t in dict.fromkeys(r["transport"] for r in pts):
            sel = sorted((r["seq"], r["median_s"] * 1e3) for r in pts if r["transport"] == t)
            ax.plot([s for s, _ in sel], [m for _, m in sel], marker="o", label=t)
        hidden, heads, kv, implementation, layers, batch = g
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global sequence length (tokens)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(
            f"h={hidden} N={heads} K={kv} {implementation}, {layers} layers, R={meta['n']}", fontsize=9
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    fig.suptitle(f"CP training step, {meta['device_kind']}, jax {meta['jax']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    started = time.perf_counter()
    opts = _parse(argv)
    opts.started = started
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        if opts.cpu:  # one CPU device per process; collectives between the processes over gloo
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        launch.initialize()
    elif opts.cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    devices = jax.devices()
    n = opts.n or len(devices)
    mesh = Mesh(np.array(devices[:n]), (AXIS,))
    me = jax.process_index()
    say = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)
    if devices[0].platform == "gpu" and jax.process_count() > 1:
        if launch.ranks_share_gpu():
            say(
                "ERROR: the processes share one GPU; the step's parameter all-reduce (psum) needs NCCL, "
                "which refuses that mode. Run with one GPU per process."
            )
            return 2
    meta = {
        "benchmark": "cp_step",
        "mode": "precision" if opts.precision else "timing",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform_mod.node(),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "n": n,
        "processes": jax.process_count(),
        "options": {k: v for k, v in vars(opts).items() if k != "started"},
        "env": {k: os.environ.get(k) for k in ENV_RECORDED},
    }
    say(
        f"cp_step: R={n} on {devices[0].device_kind} ({jax.process_count()} process(es)), "
        f"jax {jax.__version__}"
    )
    if n == 1:  # the module docstring says why (cp_attention)
        say(
            "R=1: the layer's transfer path is forced (a rank gathers from itself); "
            "`none` is one attention call"
        )
    meta["transfer_at_n1"] = n == 1
    rows = run_precision(opts, mesh, say, meta) if opts.precision else run_timing(opts, mesh, say, meta)
    if me == 0:
        write_json(opts.json, meta, rows)
        print(f"wrote {opts.json}")
        if not opts.precision:
            print(HEADER)
            for row in rows:
                print(format_row(row))
            write_png(opts.png, meta, rows)
    sys.stdout.flush()
    if jax.process_count() > 1:
        launch.finish()  # rank 0 hosts the coordination service: it must not leave first
    return 0


if __name__ == "__main__":
    sys.exit(main())
