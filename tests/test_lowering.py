"""What the peer transport compiles to, checked on the CPU by lowering for CUDA: our FFI custom
calls with the right attributes, and no XLA collective anywhere in a whole CP training step."""

import re

import jax
import numpy as np

import jax_cpgrad as cpg
from jax_cpgrad.example.cp_step import make_train_step, replicate, shard_batch, workspace_nbytes
from jax_cpgrad.example.model import Config, init_params, synthetic_batch
from spmd import cp_mesh, place, spmd_jit
from workspace_stub import workspace_stub

XLA_COLLECTIVES = re.compile(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)")


def _cuda_text(jitted, *args):
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_grad_return_lowers_to_one_custom_call_with_its_attributes():
    mesh, ws = cp_mesh(4, "cpu"), workspace_stub(4)
    f = spmd_jit(mesh, lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=1, workspace=ws))
    x = place(mesh, np.zeros((4, 2, 16, 3), np.float32))
    text = _cuda_text(f, x, x)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@jax_cpgrad_grad_return" in calls[0]
    assert "has_side_effect = true" in calls[0]
    for attr in ("axis_size = 4", "seq_axis_from_end = 2", "workspace_id = 7"):
        assert attr in text, attr
    assert not XLA_COLLECTIVES.search(text)


def test_cp_training_step_with_a_workspace_uses_no_xla_collective():
    cfg = Config(vocab=64, d_model=32, heads=2, d_head=16, layers=2, d_ff=64, seq_len=64, batch=2)
    mesh = cp_mesh(4, "cpu")
    params = replicate(mesh, init_params(cfg))
    batch = shard_batch(mesh, *synthetic_batch(cfg, seed=0))
    ws = workspace_stub(4, nbytes=workspace_nbytes(cfg, 4, init_params(cfg)))  # the capacity the demo asks for
    peer = _cuda_text(make_train_step(cfg, mesh, workspace=ws), params, *batch)
    assert not XLA_COLLECTIVES.search(peer), XLA_COLLECTIVES.search(peer)
    # Per layer: K/V gathered forward, dK/dV returned backward; plus the gradient all-reduce.
    assert peer.count("@jax_cpgrad_all_gather(") == cfg.layers + 1
    assert peer.count("@jax_cpgrad_grad_return(") == cfg.layers
    xla = _cuda_text(make_train_step(cfg, mesh), params, *batch)
    assert XLA_COLLECTIVES.search(xla) and "@jax_cpgrad_" not in xla


def test_vmap_adds_leading_axes_and_keeps_the_sequence_axis_counted_from_the_back():
    mesh, ws = cp_mesh(4, "cpu"), workspace_stub(4)
    # Per example [S=16, H=3] with seq_axis 0; vmapped over a leading batch of 5.
    body = lambda a: jax.vmap(lambda x: cpg.grad_return(x, axis_name="cp", seq_axis=0, workspace=ws))(a)
    text = _cuda_text(spmd_jit(mesh, body), place(mesh, np.zeros((4, 5, 16, 3), np.float32)))
    call = next(line for line in text.splitlines() if "@jax_cpgrad_grad_return" in line)
    assert "seq_axis_from_end = 2" in text
    assert "(tensor<5x16x3xf32>) -> tensor<5x4x3xf32>" in call, call
