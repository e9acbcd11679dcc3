"""The demo: a few context-parallel training steps of the package's transformer (jax_cpgrad.models).

    python -m jax_cpgrad.demo [--n R] [--seq-len S] [--dtype float32|bfloat16] [--steps STEPS]
        [--documents LEN] [--window W] [--remat]

Picks what the machine has: several GPUs in one process -> both transports (peer and XLA/NCCL),
one GPU -> R processes sharing it (peer transport only: NCCL refuses duplicate GPUs), no GPU ->
8 CPU devices and the XLA transport. Prints the loss per step, the difference against the same
model run unsharded, and the time per step of each transport, and ends with one line: PASS when
every transport's first-step gradients match the unsharded model's within the tolerance (exit
code 0), FAIL otherwise (exit code 1). ``--documents``, ``--window`` and ``--remat``: packed
documents, a sliding-window layer, checkpointed layers (the unsharded model takes the same masks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh

from . import launch
from ._native import HAS_CUDA
from .models.cp_train_step import local_value, make_train_step, replicate, shard_batch, workspace_nbytes
from .models.transformer import Config, init_params, reference_loss_and_grads, synthetic_batch
from .workspace import Workspace


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jax_cpgrad.demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="R, the CP size (default: 8 on CPU, all GPUs, or 4 processes on one GPU)",
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument(
        "--documents",
        type=int,
        default=None,
        metavar="LEN",
        help="pack each row with documents of about LEN tokens (segment ids; default: one sequence)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="W",
        help="the first layer a sliding window of W tokens (local_window_size), the second global",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="each layer under jax.checkpoint, with the policy that keeps the masks",
    )
    p.add_argument("--cpu", action="store_true", help="force 8 CPU devices and the XLA transport")
    return p.parse_args(argv)


def _choose_platform(opts) -> str:
    """'gpu-ranks' (a rank of a launched job), 'gpu-multi' (one process, several GPUs),
    'gpu-shared' (relaunch as R processes sharing the GPU), 'cpu'."""
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        return "gpu-ranks"
    gpus = 0 if opts.cpu or not HAS_CUDA else launch.visible_gpu_count()
    if gpus >= 2:
        return "gpu-multi"
    if gpus == 1:
        return "gpu-shared"
    return "cpu"


# Largest relative error (max |CP - unsharded| / max |unsharded|, per parameter) the gradients may
# have. The CP step sums the same terms in another order: in float32 (full-precision matmuls, set
# below) that moves them by rounding only, about 1e-6; a wrong gradient is off by order 1. In
# bfloat16 every matmul rounds differently: a few 1e-2.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1}


def _rel_err(grads, ref_grads) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-30))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )


def _say(*args):
    if jax.process_index() == 0:
        print(*args, flush=True)


def main(argv=None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    opts = _parse(args)
    platform = _choose_platform(opts)
    if platform == "gpu-shared":
        n = opts.n or 4
        print(f"One GPU: running {n} CP ranks as {n} processes sharing it (peer transport).")
        try:
            results = launch.launch(
                [sys.executable, "-m", "jax_cpgrad.demo", *args],
                n,
                timeout_s=600,
                devices="share",
                echo=False,
            )
        except launch.LaunchError as err:
            for r in err.results:
                print(f"--- rank {r.rank} (exit code {r.returncode}):\n{r.output[-3000:]}")
            print(err)
            return 1
        print(results[0].output, end="")
        return 0 if "\nPASS: " in "\n" + results[0].output else 1

    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    elif platform == "gpu-ranks":
        launch.initialize()
    return _run(opts, platform)


def _run(opts, platform: str) -> int:
    if opts.dtype == "float32":
        # GPUs may run float32 matmuls in TF32 by default: take full precision, for the check.
        jax.config.update("jax_default_matmul_precision", "highest")
    devices = jax.devices()
    n = min(opts.n or len(devices), len(devices))
    mesh = Mesh(np.array(devices[:n]), ("cp",))
    window = () if opts.window is None else ({"local_window_size": opts.window}, {})
    cfg = Config(
        seq_len=opts.seq_len, batch=opts.batch, dtype=opts.dtype, layer_attention=window,
        documents=opts.documents, remat=opts.remat,
    )  # fmt: skip
    shared_gpu = platform == "gpu-ranks" and launch.ranks_share_gpu()
    transports = []
    if platform != "cpu":
        transports.append("peer")
    if not shared_gpu:
        transports.append("xla")  # NCCL cannot run with several processes on one GPU
    kind = {
        "cpu": f"{n} CPU devices",
        "gpu-multi": f"{n} GPUs in one process",
        "gpu-ranks": f"{n} processes sharing one GPU (time-sliced)"
        if shared_gpu
        else f"{n} processes, one GPU each",
    }[platform]
    _say(f"jax_cpgrad demo: {kind}; transports: {', '.join(transports)}")
    _say(
        f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, seq {cfg.seq_len}, "
        f"batch {cfg.batch}, {cfg.dtype}"
        + (f"; documents of about {cfg.documents} tokens" if cfg.documents else "")
        + (f"; layer 0 a window of {opts.window}, layer 1 global" if opts.window is not None else "")
        + ("; layers checkpointed (masks kept)" if cfg.remat else "")
    )

    params0 = init_params(cfg, seed=0)
    batches = [synthetic_batch(cfg, seed=i) for i in range(opts.steps)]
    tokens0, targets0, *ids0 = batches[0]  # ids0: [segment ids] with --documents
    with jax.default_device(jax.local_devices()[0]):
        ref_loss, ref_grads = reference_loss_and_grads(params0, tokens0, targets0, cfg, *ids0)
    ref_loss, ref_grads = float(ref_loss), jax.tree.map(lambda g: np.asarray(g, np.float64), ref_grads)

    report = []
    for transport in transports:
        ws = None
        if transport == "peer":
            ws = Workspace(mesh, "cp", nbytes=workspace_nbytes(cfg, n, params0), name="demo")
        step = make_train_step(cfg, mesh, workspace=ws)
        params = replicate(mesh, params0)
        losses, times = [], []
        diff_loss = diff_grad = rel_grad = None
        for i, batch in enumerate(batches):
            sharded = shard_batch(mesh, *batch)
            t0 = time.perf_counter()
            params, loss, grads = step(params, *sharded)
            loss = float(local_value(loss))
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if i == 0:
                g = local_value(grads)
                diff_loss = abs(loss - ref_loss)
                diff_grad = max(
                    float(np.max(np.abs(a - b)))
                    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads), strict=True)
                )
                rel_grad = _rel_err(g, ref_grads)
            note = ", includes compile" if i == 0 else ""
            _say(f"  [{transport}] step {i}: loss {loss:.4f}  ({times[-1] * 1e3:.1f} ms{note})")
        if ws is not None:
            ws.close()
        steady = times[1:] or times
        report.append((transport, losses, diff_loss, diff_grad, float(np.median(steady)), rel_grad))

    _say("")
    _say(
        f"{'transport':<10} {'first loss':>10} {'last loss':>10} "
        f"{'|dloss| vs ref':>15} {'max|dgrad| vs ref':>18} {'ms/step':>9}"
    )
    for transport, losses, dl, dg, t, _ in report:
        _say(
            f"{transport:<10} {losses[0]:>10.4f} {losses[-1]:>10.4f} {dl:>15.2e} {dg:>18.2e} {t * 1e3:>9.1f}"
        )
    _say(f"reference (unsharded, one device) first-step loss: {ref_loss:.4f}")
    if shared_gpu:
        _say("note: ranks time-slice one GPU; the times say nothing about NVLink speed.")
    tol = TOLERANCE[cfg.dtype]
    worst = float(np.max([np.nan if r[5] is None else r[5] for r in report]))  # NaN if any is
    ok = bool(worst <= tol)  # and NaN fails
    names = " and ".join(r[0] for r in report)
    _say(
        f"{'PASS' if ok else 'FAIL'}: CP gradients ({names} transport) "
        f"{'match' if ok else 'DO NOT match'} the unsharded model "
        f"(max rel err {worst:.1e} {'<=' if ok else '>'} {tol:.0e})"
    )
    code = 0 if ok else 1
    if platform == "gpu-ranks":
        launch.finish(code)  # wait for the other ranks, skip the distributed shutdown barrier
    return code


if __name__ == "__main__":
    sys.exit(main())
