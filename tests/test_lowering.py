"""What the peer transport compiles to, checked on the CPU by lowering for CUDA: our FFI custom
calls with the right attributes, and no XLA collective anywhere in a whole CP training step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cpgrad as cpg
from jax_cpgrad.models.cp_train_step import make_train_step, replicate, shard_batch, workspace_nbytes
from jax_cpgrad.models.transformer import Config, init_params, synthetic_batch
from spmd import cp_mesh, place, spmd_jit
from workspace_stub import workspace_spec

XLA_COLLECTIVES = re.compile(
    r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"
)


def _cuda_text(jitted, *args):
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "protocol,target,side_effect",
    [
        ("memop", "@jax_cpgrad_grad_return(", True),  # host-side epochs: no call may be dropped
        ("device", "@jax_cpgrad_grad_return_device(", False),  # device epochs: XLA may record it in graphs
    ],
)
def test_grad_return_lowers_to_one_custom_call_with_its_attributes(protocol, target, side_effect):
    mesh, ws = cp_mesh(4, "cpu"), workspace_spec(4, protocol=protocol)
    f = spmd_jit(mesh, lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=1, workspace=ws))
    x = place(mesh, np.zeros((4, 2, 16, 3), np.float32))
    text = _cuda_text(f, x, x)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and target in calls[0]
    assert ("has_side_effect = true" in calls[0]) == side_effect
    for attr in ("axis_size = 4", "seq_axis_from_end = 2", "workspace_id = 7", "reach = 0"):
        assert attr in text, attr
    assert not XLA_COLLECTIVES.search(text)


def test_only_the_device_protocol_handlers_are_command_buffer_compatible():
    """XLA records a custom call into its CUDA graphs only when the handler says so (asked the
    way XLA asks: a metadata call frame). A memop handler must never say so: its epochs
    are host-chosen, and a replayed graph would pass stale waits."""
    if not cpg.HAS_CUDA:
        pytest.skip("the handlers are in the CUDA build only (no nvcc at build time)")
    from jax_cpgrad._native import ext

    compatible = {
        name: bool(ext.handler_traits(name) & ext.COMMAND_BUFFER_COMPATIBLE)
        for name in (
            "grad_return",
            "all_gather",
            "grad_return_device",
            "all_gather_device",
            "grad_return_start",
            "all_gather_start",
            "grad_return_device_start",
            "all_gather_device_start",
            "done",
        )
    }
    # A pair forks work onto the workspace's stream and joins it in another command: never in a graph.
    assert compatible == {
        "grad_return": False,
        "all_gather": False,
        "grad_return_device": True,
        "all_gather_device": True,
        "grad_return_start": False,
        "all_gather_start": False,
        "grad_return_device_start": False,
        "all_gather_device_start": False,
        "done": False,
    }


def test_cp_training_step_with_a_workspace_uses_no_xla_collective():
    cfg = Config(vocab=64, d_model=32, heads=2, d_head=16, layers=2, d_ff=64, seq_len=64, batch=2)
    mesh = cp_mesh(4, "cpu")
    params = replicate(mesh, init_params(cfg))
    batch = shard_batch(mesh, *synthetic_batch(cfg, seed=0))
    ws = workspace_spec(
        4, nbytes=workspace_nbytes(cfg, 4, init_params(cfg))
    )  # the capacity the demo asks for
    for protocol, suffix in (("memop", ""), ("device", "_device")):
        ws = workspace_spec(4, nbytes=ws.nbytes, protocol=protocol)
        peer = _cuda_text(make_train_step(cfg, mesh, workspace=ws), params, *batch)
        assert not XLA_COLLECTIVES.search(peer), XLA_COLLECTIVES.search(peer)
        # Per layer: K/V gathered forward, dK/dV returned backward; plus the gradient all-reduce.
        assert peer.count(f"@jax_cpgrad_all_gather{suffix}(") == cfg.layers + 1
        assert peer.count(f"@jax_cpgrad_grad_return{suffix}(") == cfg.layers
    xla = _cuda_text(make_train_step(cfg, mesh), params, *batch)
    assert XLA_COLLECTIVES.search(xla) and "@jax_cpgrad_" not in xla


def test_vmap_adds_leading_axes_and_keeps_the_sequence_axis_counted_from_the_back():
    mesh, ws = cp_mesh(4, "cpu"), workspace_spec(4)
    # Per example [S=16, H=3] with seq_axis 0; vmapped over a leading batch of 5.
    body = lambda a: jax.vmap(lambda x: cpg.grad_return(x, axis_name="cp", seq_axis=0, workspace=ws))(a)
    text = _cuda_text(spmd_jit(mesh, body), place(mesh, np.zeros((4, 5, 16, 3), np.float32)))
    call = next(line for line in text.splitlines() if "@jax_cpgrad_grad_return" in line)
    assert "seq_axis_from_end = 2" in text
    assert "(tensor<5x16x3xf32>) -> tensor<5x4x3xf32>" in call, call


def _ssa(line: str) -> str:
    """The SSA name a lowered line defines ("%5" of "%5:2 = ...")."""
    return re.match(r"(%\w+)(?::\d+)? = ", line).group(1)


def _operands(line: str) -> list[str]:
    return re.findall(r"(%\w+)(?:#\d+)?", line.split(" = ", 1)[1].split("{")[0])


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_an_overlapped_workspace_takes_every_call_as_a_start_and_its_done(protocol, suffix, remat):
    """Workspace(overlap=True): a plain call (the backward's too) lowers to our start and our done,
    both with side effects, the done taking the start's results and inputs and returning a token,
    and the results released by a barrier with that very token; under jax.checkpoint too (a start
    without side effects would be recomputed there, without a done); nothing on XLA's own streams."""
    mesh, ws = cp_mesh(4, "cpu"), workspace_spec(4, protocol=protocol, overlap=True)

    def loss(k, v):
        k_all, v_all = cpg.all_gather((k, v), axis_name="cp", seq_axis=1, workspace=ws)
        return (jnp.cos(k_all) * v_all).sum()

    f = spmd_jit(mesh, lambda k, v: jax.grad(jax.checkpoint(loss) if remat else loss, argnums=(0, 1))(k, v))
    x = place(mesh, np.zeros((4, 2, 16, 3), np.float32))
    lines = [line.strip() for line in _cuda_text(f, x, x).splitlines()]
    calls = [line for line in lines if "stablehlo.custom_call" in line]
    targets = [re.search(r"@(\w+)\(", c).group(1) for c in calls]
    assert targets == [f"jax_cpgrad_all_gather{suffix}_start", "jax_cpgrad_done"] + [
        f"jax_cpgrad_grad_return{suffix}_start",
        "jax_cpgrad_done",
    ]
    assert all("has_side_effect = true" in c for c in calls)
    for start, done in zip(calls[::2], calls[1::2], strict=True):
        assert "output_operand_aliases" not in done and re.search(r"-> tensor<1xi32>$", done), done
        # The done's operands: the start's results (through the ties) and the start's inputs.
        assert _operands(done)[2:] == _operands(start), (start, done)
        # The results reach the program only through a barrier with this done's token.
        # (Under checkpoint that barrier also carries the remat's own residuals.)
        releases = [ln for ln in lines if "optimization_barrier" in ln and _ssa(done) in _operands(ln)]
        assert len(releases) == 1, releases
    assert "_xla_stream_annotation" not in "\n".join(lines)


@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "overlapped"])
@pytest.mark.parametrize("protocol", ["memop", "device"])
def test_no_call_takes_a_slice_directly(protocol, overlap):
    """Every operand of our custom calls is a barrier's result, never a slice, though the caller
    passes slices: XLA's GPU compiler wraps a custom call on slices in a fusion that reads them in
    place, and jax 0.11.2's kept the original call too when it had side effects, so the call ran
    twice (a start without its done: compiled for an H100 without a GPU, results finding 12)."""
    mesh, ws = cp_mesh(4, "cpu"), workspace_spec(4, protocol=protocol, overlap=overlap)

    def step(k, v):
        kv = cpg.all_gather((k[:, 2:6], v[:, 4:8]), axis_name="cp", seq_axis=1, workspace=ws)
        return cpg.grad_return(
            tuple(jnp.tile(x, (1, 4, 1)) for x in kv), axis_name="cp", seq_axis=1, workspace=ws
        )

    x = place(mesh, np.zeros((4, 2, 64, 3), np.float32))
    lines = [line.strip() for line in _cuda_text(spmd_jit(mesh, step), x, x).splitlines()]
    barriers = {_ssa(ln) for ln in lines if "stablehlo.optimization_barrier" in ln}
    calls = [ln for ln in lines if "stablehlo.custom_call @jax_cpgrad_" in ln]
    assert len(calls) == (4 if overlap else 2) and any("stablehlo.slice" in ln for ln in lines)
    for call in calls:
        assert set(_operands(call)) <= barriers, call
