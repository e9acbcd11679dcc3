"""Train the package's causal transformer (jax_cpgrad.models) with context parallelism.

    python examples/train_cp_transformer.py [--n R] [--seq-len 1024] [--steps 20] [--peer]
    python -m jax_cpgrad.launch -n 4 examples/train_cp_transformer.py --peer   # one process per rank

Each of the R ranks holds two chunks of the sequence (the load-balanced layout). Every layer's
attention is jax_cpgrad.dot_product_attention: it gathers K/V in the forward pass and returns
dK/dV to their owners in its VJP, over the peer transport with --peer (one Workspace serves every
layer and the parameter-gradient all-reduce, so the step uses no NCCL), over XLA collectives
otherwise. The step itself is jax_cpgrad.models.cp_train_step.make_train_step.
"""

import argparse
import os

import jax
import numpy as np
from jax.sharding import Mesh

import jax_cpgrad as cpg
from jax_cpgrad import launch
from jax_cpgrad.models.cp_train_step import (
    local_value,
    make_train_step,
    replicate,
    shard_batch,
    workspace_nbytes,
)
from jax_cpgrad.models.transformer import Config, init_params, synthetic_batch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--n", type=int, default=None, help="R, the CP size (default: 8 on the CPU, every device otherwise)"
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--peer", action="store_true", help="peer transport (GPUs and a Workspace)")
    opts = p.parse_args()
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        launch.initialize()
    elif not opts.peer:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", opts.n or 8)

    devices = jax.devices()
    mesh = Mesh(np.array(devices[: opts.n or len(devices)]), ("cp",))
    n = mesh.shape["cp"]
    cfg = Config(seq_len=opts.seq_len, dtype=opts.dtype)
    params = init_params(cfg, seed=0)
    ws = None
    if opts.peer:
        ws = cpg.Workspace(mesh, "cp", nbytes=workspace_nbytes(cfg, n, params))
    step = make_train_step(cfg, mesh, workspace=ws, lr=opts.lr)
    params = replicate(mesh, params)
    for i in range(opts.steps):
        params, loss, _ = step(params, *shard_batch(mesh, *synthetic_batch(cfg, seed=i)))
        if jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(local_value(loss)):.4f}", flush=True)
    if ws is not None:
        ws.close()
    if jax.process_count() > 1:
        launch.finish()  # every rank's queued work done, then all leave together


if __name__ == "__main__":
    main()
