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
from jax_cpgrad.attention import kernels
from spmd import cp_mesh
from workspace_stub import workspace_spec

P = jax.sharding.PartitionSpec


@pytest.fixture(autouse=True)
def as_on_an_h200(monkeypatch):
    """implementation='cudnn' traced here as on an H200 (it refuses a CPU): lowered for CUDA."""
    monkeypatch.setattr(kernels.cudnn, "max_head_dim", lambda: 256)


def _lowered_grad(layer) -> str:
    """The text of ``layer``'s output and VJP on 4 ranks (bf16, 4 query and 2 KV heads of 16, 64
    tokens), lowered for CUDA."""

    def body(q, k, v):
        out, vjp = jax.vjp(layer, q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(4), in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    return step.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


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
    text = _lowered_grad(jax.checkpoint(layer) if remat else layer)
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
    gather, back, done = _transfer_targets(suffix)
    remote_calls = 2 if causal else 1  # causal: the paired and the far call (plan.py)
    forward = [gather, FWD, done] + [FWD] * remote_calls  # start, local part, done, remote part
    # the remote part's backward, the return's start, the local part's backward, the done
    backward = [BWD] * remote_calls + [back, BWD, done]
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
    gather, back, done = _transfer_targets(suffix)
    remote = 2 if causal else 1  # kernel calls of one group's remote part
    forward = [gather, FWD, done, gather] + [FWD] * remote + [done] + [FWD] * remote
    backward = [BWD] * remote + [back] + [BWD] * remote + [done, back, BWD, done]
    # Under jax.checkpoint the last group's remote part is recomputed; the first group's results
    # are kept with the transfer they ran beside.
    recomputed = [FWD] * remote if remat else []
    assert _lowered_targets(ws, remat, causal, head_groups=2) == forward + recomputed + backward


def _cudnn_window_calls(protocol: str, left: int) -> list[tuple[str, str]]:
    """The custom calls of the layer's forward and backward with implementation='cudnn' and a
    causal window of ``left`` (R = 4, chunks of 8 tokens, an overlapped workspace), in program
    order: (target, cuDNN's sliding window length, or the transfer's reach)."""
    ws = workspace_spec(4, protocol=protocol, overlap=True)
    layer = lambda q, k, v: cpg.dot_product_attention(
        q, k, v, axis_name="cp", workspace=ws, implementation="cudnn", local_window_size=(left, 0)
    )
    calls = []
    for line in _lowered_grad(layer).splitlines():
        target = re.search(r"custom_call @([\w$]+)\(", line)
        if target:
            window = re.search(r"sliding_window_length\\22: (\d+)", line)
            reach = re.search(r"reach = (\d+)", line)
            calls.append((target.group(1), (window or reach).group(1)))
    return calls


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
def test_a_causal_window_on_cudnn_runs_the_diagonal_blocks_beside_the_halo(protocol, suffix):
    """implementation='cudnn' with a causal window shorter than a chunk (5 of 8 tokens): the
    diagonal blocks with cuDNN's sliding window of 6 run between the halo's start and its done
    (a gather with a reach of 1), the halo call (no window) after it; in the backward the halo
    call's backward, the return's start, the diagonal blocks' backward, the done."""
    calls = _cudnn_window_calls(protocol, left=5)
    gather, back, done = _transfer_targets(suffix)
    assert calls == [
        (gather, "1"), (FWD, "6"), (done, "1"), (FWD, "0"),
        (BWD, "0"), (back, "1"), (BWD, "6"), (done, "1"),
    ], calls  # fmt: skip


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
def test_a_wide_causal_window_on_cudnn_gathers_only_its_reach_beside_the_diagonal_blocks(protocol, suffix):
    """implementation='cudnn' with a causal window of more than a chunk (13 of 8 tokens): the
    gather of the ranks within its reach (2) with the diagonal blocks (causal, no window)
    between its start and its done, then the keys just before each chunk (a whole call) and
    the band before them (a causal call); in the backward the two remote calls' backward, the
    return's start, the diagonal blocks' backward, the done."""
    calls = _cudnn_window_calls(protocol, left=13)
    gather, back, done = _transfer_targets(suffix)
    assert calls == [
        (gather, "2"), (FWD, "0"), (done, "2"), (FWD, "0"), (FWD, "0"),
        (BWD, "0"), (BWD, "0"), (back, "2"), (BWD, "0"), (done, "2"),
    ], calls  # fmt: skip


def test_a_wide_causal_window_on_cudnn_over_xla_moves_the_reached_chunks_alone():
    """implementation='cudnn' with a causal window of 13 (chunks of 8, R = 4) and no workspace:
    XLA's collective-permutes of whole chunks (K and V forward, dK and dV back), no all-gather or
    reduce-scatter, beside the same three cuDNN calls each way as on the peer transport."""
    layer = lambda q, k, v: cpg.dot_product_attention(
        q, k, v, axis_name="cp", implementation="cudnn", local_window_size=(13, 0)
    )
    text = _lowered_grad(layer)
    permutes = re.findall(r"stablehlo.collective_permute.*?-> tensor<([\dx]+)x(?:bf16|f32)>", text)
    assert permutes and set(permutes) == {"1x8x2x16"}, permutes
    assert "all_gather" not in text and "reduce_scatter" not in text
    targets = re.findall(r"custom_call @([\w$]+)\(", text)
    assert targets.count(FWD) == 3 and targets.count(BWD) == 3, targets


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


def _masked_lowered_text(ws, remat: bool, ranks: int = 4, window=(20, 0), documents=True, causal=True) -> str:
    """The lowered text of the layer with documents (or not) and a window (XLA's masked
    kernels); chunks of 64 / (2 ranks) tokens."""
    layer = lambda q, k, v, ids: cpg.dot_product_attention(
        q, k, v, axis_name="cp", workspace=ws, segment_ids=ids if documents else None,
        local_window_size=window, is_causal=causal, implementation="xla",
    )  # fmt: skip
    if remat:
        layer = jax.checkpoint(layer)

    def body(q, k, v, ids):
        out, vjp = jax.vjp(lambda q, k, v: layer(q, k, v, ids), q, k, v)
        return vjp(out)

    step = jax.jit(jax.shard_map(body, mesh=cp_mesh(ranks), in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    return step.trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_masked_layer_gathers_the_ids_first_then_kv_beside_the_local_part(remat):
    """Documents on an overlapped workspace: the segment ids travel first, over the same
    workspace (a start and its done with nothing between), never beside K/V; then the K/V gather
    with the local part's masked attention (dot products) between its start and done, and the
    dK/dV return with the local part's backward between its start and done. Nothing travels
    twice under jax.checkpoint."""
    gather, back, done = _transfer_targets("_device")
    text = _masked_lowered_text(workspace_spec(4, protocol="device", overlap=True), remat)
    lines = [line for line in text.splitlines() if "custom_call @" in line or "dot_general" in line]
    events = [
        re.search(r"custom_call @([\w$]+)\(", line).group(1) if "custom_call" in line else "dot"
        for line in lines
    ]
    calls = [e for e in events if e != "dot"]
    assert calls == [gather, done, gather, done, back, done], calls
    starts = [i for i, e in enumerate(events) if e.endswith("_start")]
    dones = [i for i, e in enumerate(events) if e == done]
    assert starts[0] + 1 == dones[0]  # the ids: nothing beside them
    for start, end in zip(starts[1:], dones[1:], strict=True):  # K/V forward, dK/dV backward
        assert "dot" in events[start:end], events


def test_masked_layer_at_r1_moves_nothing():
    text = _masked_lowered_text(workspace_spec(1, protocol="device", overlap=True), remat=False, ranks=1)
    assert "jax_cpgrad" not in text and "all_gather" not in text


def _events(text: str) -> list[str]:
    """The custom calls' targets and "dot" for each dot product, in the lowered order."""
    lines = [line for line in text.splitlines() if "custom_call @" in line or "dot_general" in line]
    return [
        re.search(r"custom_call @([\w$]+)\(", line).group(1) if "custom_call" in line else "dot"
        for line in lines
    ]


@pytest.mark.parametrize("protocol,suffix", [("memop", ""), ("device", "_device")])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("documents", [False, True], ids=["window", "documents"])
def test_the_halo_travels_beside_the_local_part(protocol, suffix, remat, documents):
    """A window within a chunk (c = 8, left 3) on an overlapped workspace: the halo's K/V move
    (the peer transport's all-gather of the edge rows, only 2 x 3 rows a rank) has the local part's
    masked attention between its start and done, and the dK/dV return the local backward;
    the ids (with documents) first, alone. Nothing travels twice under jax.checkpoint."""
    gather, back, done = _transfer_targets(suffix)
    text = _masked_lowered_text(
        workspace_spec(4, protocol=protocol, overlap=True), remat, window=(3, 0), documents=documents
    )
    events = _events(text)
    calls = [e for e in events if e != "dot"]
    ids = [gather, done] if documents else []
    assert calls == ids + [gather, done, back, done], calls
    starts = [i for i, e in enumerate(events) if e.endswith("_start")][len(ids) // 2 :]
    dones = [i for i, e in enumerate(events) if e == done][len(ids) // 2 :]
    for start, end in zip(starts, dones, strict=True):  # K/V forward, dK/dV backward
        assert "dot" in events[start:end], events
    # the halo's rows: every rank's 2 x 3 edge rows gathered (bfloat16 [1, 6, 2, 16] from each)
    assert re.search(r"custom_call @jax_cpgrad_all_gather\w*\(.*tensor<1x6x2x16xbf16>", text)
    moves = [line for line in text.splitlines() if "custom_call @jax_cpgrad_" in line]
    assert not any("1x64x2x16" in line for line in moves)  # never K/V of the whole sequence
    # the halo moves to and from the neighbours alone; the ids (a document may span every rank)
    # come from all
    reaches = [re.search(r"reach = (\d+)", line).group(1) for line in moves if "_start" in line]
    assert reaches == ["0"] * (len(ids) // 2) + ["1", "1"], reaches


@pytest.mark.parametrize(
    "window,causal,reach",
    [((9, 0), True, 2), ((17, 0), True, 0), ((3, 9), False, 2)],
    ids=["two_ranks", "all", "right_side"],
)
def test_a_wider_window_on_the_peer_transport_gathers_from_the_ranks_it_reaches(window, causal, reach):
    """R = 4, c = 8: a side of 9 reaches two chunks, so the K/V gather and its return move the
    data of the ranks within 2 alone; a side of 17 reaches three, every other rank (reach 0)."""
    ws = workspace_spec(4, protocol="device", overlap=False)
    text = _masked_lowered_text(ws, False, window=window, documents=False, causal=causal)
    moves = [line for line in text.splitlines() if "custom_call @jax_cpgrad_" in line]
    assert [re.search(r"@(jax_cpgrad_\w+)\(", line).group(1) for line in moves] == [
        "jax_cpgrad_all_gather_device", "jax_cpgrad_grad_return_device",
    ], moves  # fmt: skip
    assert all("1x64x2x16" in line for line in moves)  # the whole K/V's shape, the far rows zeros
    assert all(f"reach = {reach}" in line for line in moves), moves


def test_the_halo_with_head_groups_pipelines_like_the_gather():
    """head_groups=2 with a halo window: group 1's halo travels beside group 0's remote part,
    group 0's return beside group 1's remote backward, each start after the previous done."""
    gather, back, done = _transfer_targets("_device")
    layer = lambda q, k, v: cpg.dot_product_attention(
        q, k, v, axis_name="cp", workspace=workspace_spec(4, protocol="device", overlap=True),
        local_window_size=(3, 2), is_causal=False, head_groups=2,
    )  # fmt: skip

    events = _events(_lowered_grad(layer))
    calls = [e for e in events if e != "dot"]
    assert calls == [gather, done, gather, done, back, done, back, done], calls
    starts = [i for i, e in enumerate(events) if e.endswith("_start")]
    dones = [i for i, e in enumerate(events) if e == done]
    for start, end in zip(starts, dones, strict=True):
        assert "dot" in events[start:end], events
