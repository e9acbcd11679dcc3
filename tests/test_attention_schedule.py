"""The CP attention layer's order of work around its transfers, as lowered for GPUs (checked on the
CPU): with an overlapped workspace the K/V gather's start comes first, then the local part's cuDNN
attention, then the gather's done, then the remote part (causal: the paired and the far call); in
the backward pass the remote part's backward yields dK/dV, their return starts, the local part's
backward follows, then the return's done. (The lowered text shows the order the data
dependencies allow; the GPU suite checks that XLA's compiled schedule keeps it.) Under
jax.checkpoint the backward recomputes the remote part only: the transfers have side effects, so
their results are kept, never gathered twice. With head_groups=2 the transfers form a pipeline:
each group's gather beside the previous group's work, each return beside the next group's."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_cpgrad as cpg
from jax_cpgrad.attention import layer as attention_layer
from spmd import cp_mesh
from workspace_stub import workspace_spec

P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def as_on_an_h200(monkeypatch):
    """implementation='cudnn' traced here as on an H200 (it refuses a CPU): lowered for CUDA."""
    monkeypatch.setattr(attention_layer, "cudnn_max_head_dim", lambda: 256)


def _lowered_targets(ws, remat: bool, causal: bool = True, head_groups: int = 1) -> list[str]:
    layer = lambda q, k, v: cpg.dot_product_attention(
        q,
        k,
        v,
        axis_name="cp",
        workspace=ws,
        implementation="cudnn",
        is_causal=causal,
        head_groups=head_groups,
    )
    if remat:
        layer = jax.checkpoint(layer)

    def body(q, k, v):
        out, vjp = jax.vjp(layer, q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(4), in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    text = step.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    names = [re.search(r"custom_call @([\w$]+)\(", line) for line in text.splitlines()]
    return [m.group(1) for m in names if m]


FWD, BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


def _transfer_targets(suffix: str) -> tuple[str, str, str]:
    """The overlapped gather's start, the return's start and the done of a protocol."""
    return f"jax_cpgrad_all_gather{suffix}_start", f"jax_cpgrad_grad_return{suffix}_start", "jax_cpgrad_done"


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_local_attention_runs_between_each_transfer_and_its_done(protocol, suffix, remat, causal):
    ws = workspace_spec(4, protocol=protocol, overlap=True)
    gather, give_back, done = _transfer_targets(suffix)
    remote_calls = 2 if causal else 1  # causal: the paired and the far call (plan.py)
    forward = [gather, FWD, done] + [FWD] * remote_calls  # start, local part, done, remote part
    # the remote part's backward, the return's start, the local part's backward, the done
    backward = [BWD] * remote_calls + [give_back, BWD, done]
    recomputed = [FWD] * remote_calls if remat else []
    assert _lowered_targets(ws, remat, causal) == forward + recomputed + backward


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_groups_pipeline_each_transfer_beside_the_previous_groups_work(protocol, suffix, remat, causal):
    """head_groups=2: group 0's K/V travel beside the local part, group 1's beside group 0's remote
    part; group 0's dK/dV return beside group 1's remote backward, group 1's beside the local
    backward; each transfer starts after the previous one's done."""
    ws = workspace_spec(4, protocol=protocol, overlap=True)
    gather, give_back, done = _transfer_targets(suffix)
    remote = 2 if causal else 1  # kernel calls of one group's remote part
    forward = [gather, FWD, done, gather] + [FWD] * remote + [done] + [FWD] * remote
    backward = [BWD] * remote + [give_back] + [BWD] * remote + [done, give_back, BWD, done]
    # Under jax.checkpoint the last group's remote part is recomputed; the first group's results
    # are kept with the transfer they ran beside.
    recomputed = [FWD] * remote if remat else []
    assert _lowered_targets(ws, remat, causal, head_groups=2) == forward + recomputed + backward


def test_without_overlap_the_layer_makes_plain_calls():
    targets = _lowered_targets(workspace_spec(4, protocol="device"), remat=False)
    assert targets.count("jax_cpgrad_all_gather_device") == 1
    assert targets.count("jax_cpgrad_grad_return_device") == 1
    assert not any(t.endswith("_start") or t == "jax_cpgrad_done" for t in targets)


def test_at_n1_the_layer_is_one_attention_call_and_no_transfer():
    mesh = cp_mesh(1)
    layer = lambda q, k, v: cpg.dot_product_attention(q, k, v, axis_name="cp", implementation="cudnn")

    def body(q, k, v):
        out, vjp = jax.vjp(layer, q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.bfloat16)
    text = step.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @([\w$]+)\(", text)
    assert calls == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls
    assert "all_gather" not in text and "reduce_scatter" not in text
