"""all_gather_overlapped / grad_return_overlapped on the CPU: values and gradients equal to the
plain calls beside the plain work, over the XLA transport and over a stand-in for the overlapped
peer transport (its start and done replaced by the XLA transport and a pass-through), so that
the custom VJP that places the work's VJP beside the transposed call is checked here too; and
the reading of a compiled schedule that the GPU tests rely on."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_schedule
import jax_cpgrad as cpg
from jax_cpgrad import peer_transport, xla_transport
from spmd import cp_mesh, place, spmd_jit
from workspace_stub import workspace_spec

N, SEQ = 4, 1
LOCAL, GLOBAL = (2, 8, 3, 8), (2, 8 * N, 3, 8)  # global S = 8N, local S/N


@pytest.fixture
def stand_in_peer_transport(monkeypatch):
    """start runs the XLA transport, done passes the start's results through: the API's own
    logic (ties, custom VJP, closure conversion) runs unchanged on the CPU."""

    def start(op, xs, seq_axis, n, spec):
        one = xla_transport.grad_return_xla if op == "grad_return" else xla_transport.all_gather_xla
        return tuple(one(x, spec.axis_name, seq_axis, n) for x in xs)

    calls = []
    monkeypatch.setattr(peer_transport, "start", lambda *a: calls.append(a[0]) or start(*a))
    monkeypatch.setattr(peer_transport, "done", lambda pending, *_: pending)
    return calls


def _data(seed=0):
    rng = np.random.default_rng(seed)
    make = lambda shape: rng.standard_normal((N,) + shape).astype(np.float32)
    return make(LOCAL), make(LOCAL), make((5, 6)), make((6, 6)), make(GLOBAL), make(GLOBAL)


def _gather_step(ws, overlapped: bool):
    """Per rank: values and gradients of a loss through a gather with a projection beside it."""

    def body(k, v, h, w, ck, cv):
        def loss(k, v, h, w):
            project = lambda h: jnp.tanh(h @ w)  # closes over w: it must still get its gradient
            if overlapped:
                (ka, va), q = cpg.all_gather_overlapped(
                    (k, v), project, h, axis_name="cp", seq_axis=SEQ, workspace=ws
                )
            else:
                ka, va = cpg.all_gather((k, v), axis_name="cp", seq_axis=SEQ, workspace=None)
                q = project(h)
            return jnp.sum(ka * ck) + jnp.sum(va * cv) + jnp.sum(q * q)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(k, v, h, w)

    return body


def _return_step(ws, overlapped: bool):
    def body(dk, h, w, c):
        def loss(dk, h, w):
            scale = lambda h, w: jnp.sin(h) @ w
            if overlapped:
                r, y = cpg.grad_return_overlapped(dk, scale, h, w, axis_name="cp", seq_axis=SEQ, workspace=ws)
            else:
                r, y = cpg.grad_return(dk, axis_name="cp", seq_axis=SEQ), scale(h, w)
            return jnp.sum(r * c) + jnp.sum(y)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(dk, h, w)

    return body


def _run(body, *arrays):
    mesh = cp_mesh(N, "cpu")
    out = spmd_jit(mesh, body)(*(place(mesh, a) for a in arrays))
    return [np.asarray(x) for x in jax.tree.leaves(out)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ws", [None, workspace_spec(N, overlap=False)], ids=["xla", "peer-no-overlap"])
def test_without_overlap_it_is_the_plain_pair_of_calls(ws):
    k, v, h, w, ck, cv = _data()
    want = _run(_gather_step(None, False), k, v, h, w, ck, cv)
    if ws is None:
        _assert_same(_run(_gather_step(None, True), k, v, h, w, ck, cv), want)
    else:  # lowered only: the peer transport's calls are CUDA custom calls
        mesh = cp_mesh(N, "cpu")
        args = [place(mesh, a) for a in (k, v, h, w, ck, cv)]
        text = (
            spmd_jit(mesh, _gather_step(ws, True)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        )
        # no start, no done, and no tie: the only barriers are the calls' own operands'
        calls = text.count("stablehlo.custom_call @jax_cpgrad_")
        assert "@jax_cpgrad_all_gather(" in text and "_start" not in text
        assert text.count("stablehlo.optimization_barrier") == calls


def test_gather_values_and_gradients_equal_the_plain_ones(stand_in_peer_transport):
    k, v, h, w, ck, cv = _data(1)
    got = _run(_gather_step(workspace_spec(N, overlap=True), True), k, v, h, w, ck, cv)
    _assert_same(got, _run(_gather_step(None, False), k, v, h, w, ck, cv))
    # The gather forward, the return of dK/dV backward: both through the pairs.
    assert stand_in_peer_transport == ["all_gather", "grad_return"]


def test_return_values_and_gradients_equal_the_plain_ones(stand_in_peer_transport):
    rng = np.random.default_rng(2)
    dk = rng.standard_normal((N,) + GLOBAL).astype(np.float32)
    h, w = (
        rng.standard_normal((N, 5, 6)).astype(np.float32),
        rng.standard_normal((N, 6, 6)).astype(np.float32),
    )
    c = rng.standard_normal((N,) + LOCAL).astype(np.float32)
    got = _run(_return_step(workspace_spec(N, overlap=True), True), dk, h, w, c)
    _assert_same(got, _run(_return_step(None, False), dk, h, w, c))
    assert stand_in_peer_transport == ["grad_return", "all_gather"]


def test_work_with_integer_inputs_differentiates(stand_in_peer_transport):
    """Integer inputs of the work get float0 cotangents, which the ties leave alone."""
    ws = workspace_spec(N, overlap=True)
    k, _, h, *_ = _data(3)

    def body(k, h, idx):
        def loss(k, h):
            ka, q = cpg.all_gather_overlapped(
                k, lambda h, i: h[i], h, idx, axis_name="cp", seq_axis=SEQ, workspace=ws
            )
            return jnp.sum(ka) + jnp.sum(q)

        return jax.grad(loss, argnums=(0, 1))(k, h)

    idx = np.tile(np.arange(3, dtype=np.int32), (N, 1))
    dk, dh = _run(body, k, h, idx)
    np.testing.assert_array_equal(dk, np.full_like(dk, N))  # every rank's cotangent of ones, summed
    assert dh[:, :3].sum() == N * 3 * 6 and not dh[:, 3:].any()


def test_the_work_is_tied_between_start_and_done_forward_and_backward():
    """Lowered for CUDA: each start takes its arrays from a barrier of their own (never a slice:
    test_lowering.py says why); its results go through a barrier with the work's inputs, the
    work reads the barrier's copies, its result goes through a second barrier with the start's
    results, the done takes those (and the start's inputs) and returns a token, and the results
    reach the rest of the program only through a third barrier with that token."""
    ws = workspace_spec(N, protocol="device", overlap=True)
    mesh = cp_mesh(N, "cpu")
    k, v, h, w, ck, cv = (place(mesh, a) for a in _data())
    lowered = (
        spmd_jit(mesh, _gather_step(ws, True)).trace(k, v, h, w, ck, cv).lower(lowering_platforms=("cuda",))
    )
    lines = [ln.strip() for ln in lowered.as_text().splitlines()]
    kinds = []
    for ln in lines:
        if "@jax_cpgrad_all_gather_device_start(" in ln or "@jax_cpgrad_grad_return_device_start(" in ln:
            kinds.append("start")
        elif "optimization_barrier" in ln:
            kinds.append("tie")
        elif "dot_general" in ln:
            kinds.append("dot")
        elif "@jax_cpgrad_done(" in ln:
            kinds.append("done")
            assert "has_side_effect = true" in ln and "output_operand_aliases" not in ln
            assert re.search(r"-> tensor<1xi32>$", ln), ln  # a token, not the results
    # forward: the projection's matmul between start and done; backward: the same, its VJP.
    pair = lambda *work: ["tie", "start", "tie", *work, "tie", "done", "tie"]
    assert kinds == pair("dot") + pair("dot", "dot"), kinds
    ties = [ln for ln in lines if "optimization_barrier" in ln]
    for value_tie, release in zip(ties[2::4], ties[3::4], strict=True):
        # XLA drops a barrier's unused outputs, and the order with them: the work's results and
        # the released call results are what the rest of the program reads.
        n_value, n_release = (int(re.match(r"%\w+:(\d+) = ", t).group(1)) for t in (value_tie, release))
        # value tie: (2 start results, work results...); release: (2 call results, token).
        for tie, used in ((value_tie, range(2, n_value)), (release, range(0, n_release - 1))):
            name = re.match(r"(%\w+):", tie).group(1)
            later = "\n".join(lines[lines.index(tie) + 1 :])
            assert all(re.search(rf"{name}#{i}\b", later) for i in used), (tie, list(used))


def test_fn_must_be_callable():
    mesh = cp_mesh(N, "cpu")
    body = lambda k: cpg.all_gather_overlapped(k, "not a function", k, axis_name="cp", seq_axis=SEQ)
    with pytest.raises(ValueError, match="fn must be callable"):
        spmd_jit(mesh, body)(place(mesh, _data()[0]))


MODULE = """\
%fused_dot (a: f32[4,4]) -> f32[4,4] {
  ROOT %d = f32[4,4] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (a: f32[4,4]) -> f32[4,4] {
  ROOT %s = f32[4,4] add(%a, %a)
}

ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %s = (f32[4,4]) custom-call(%x), custom_call_target="jax_cpgrad_all_gather_device_start"
  %f = f32[4,4] fusion(%x), kind=kLoop, calls=%WORK
  ROOT %d = f32[4,4] custom-call(%s, %x), custom_call_target="jax_cpgrad_done"
}
"""


@pytest.mark.parametrize("work,between", [("fused_dot", 1), ("fused_add", 0)])
def test_schedule_reading_counts_only_matmuls_between_a_start_and_its_done(work, between):
    assert hlo_schedule.matmuls_between_pairs(MODULE.replace("WORK", work)) == [
        ("jax_cpgrad_all_gather_device_start", between)
    ]


@pytest.mark.parametrize("target,between", [("mosaic_gpu_v2", 1), ("jax_cpgrad_done", 0)])
def test_schedule_reading_counts_the_pallas_kernels_as_attention(target, between):
    """The masked calls' attention on sm_90 is a Mosaic GPU custom call, not a cuDNN one."""
    kernel = f'  %a = f32[4,4] custom-call(%x), custom_call_target="{target}"\n'
    module = MODULE.replace("WORK", "fused_add").replace("  ROOT %d", kernel + "  ROOT %d")
    assert hlo_schedule.matmuls_between_pairs(module) == [("jax_cpgrad_all_gather_device_start", between)]


DATAFLOW = """\
ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %s = (f32[4,4], f32[4,4]) custom-call(%x), custom_call_target="jax_cpgrad_all_gather_device_start"
  %r0 = f32[4,4] get-tuple-element(%s), index=0
  %t = (f32[4,4], f32[4,4]) tuple(%r0, %x)
  %w = f32[4,4] get-tuple-element(%t), index=1
  %m = f32[4,4] dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  EARLY
  %tok = s32[1] custom-call(%r0, %x), custom_call_target="jax_cpgrad_done"
  ROOT %late = f32[4,4] add(%r0, %m)
}
"""


@pytest.mark.parametrize("early", [False, True])
def test_schedule_reading_finds_readers_of_a_start_s_results_before_its_done(early):
    """Data flow, not text order: the work reads the tuple's other element (not the results), the
    done is found through the start's result, a reader of the result before the done is caught."""
    text = DATAFLOW.replace("EARLY", "%e = f32[4,4] negate(%r0)" if early else "")
    (pair,) = hlo_schedule.pairs(text)
    assert (pair.target, pair.matmuls_between, pair.done is not None) == (
        "jax_cpgrad_all_gather_device_start",
        1,
        True,
    )
    assert pair.early_readers == (["e"] if early else [])


@pytest.mark.parametrize("element,early", [(1, False), (0, True)])
def test_schedule_reading_follows_a_tuple_s_elements_named_with_a_hash(element, early):
    """XLA prints an operand that is one element of a tuple as ``%t#i``: reading element 1 (not
    the start's results) before the done is no early read; reading element 0 is."""
    text = DATAFLOW.replace(
        "EARLY", f"%b = (f32[4,4], f32[4,4]) opt-barrier(%t)\n  %e = f32[4,4] negate(%b#{element})"
    )
    (pair,) = hlo_schedule.pairs(text)
    assert pair.done is not None and pair.early_readers == (["e"] if early else [])


WRAPPED = """\
%dynamic-slice-fusion (p0: f32[8,4]) -> (f32[4,4]) {
  %p0 = f32[8,4] parameter(0)
  %slice.1 = f32[4,4] slice(%p0), slice={[4:8], [0:4]}
  ROOT %s = (f32[4,4]) custom-call(%slice.1), custom_call_target="jax_cpgrad_all_gather_start"
}

%dynamic-slice-fusion.1 (p0.1: f32[8,4], p1: f32[4,4]) -> s32[1] {
  %p1 = f32[4,4] parameter(1)
  %p0.1 = f32[8,4] parameter(0)
  %slice.2 = f32[4,4] slice(%p0.1), slice={[4:8], [0:4]}
  ROOT %d = s32[1] custom-call(%p1, %slice.2), custom_call_target="jax_cpgrad_done"
}

ENTRY %main (x: f32[8,4], w: f32[4,4]) -> f32[4,4] {
  %start = (f32[4,4]) fusion(%x), kind=kCustom, calls=%dynamic-slice-fusion
  %r = f32[4,4] get-tuple-element(%start), index=0
  %m = f32[4,4] dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  EARLY
  %done = s32[1] fusion(%x, %r), kind=kCustom, calls=%dynamic-slice-fusion.1
  ROOT %late = f32[4,4] add(%r, %m)
}
"""


@pytest.mark.parametrize("early", [False, True])
def test_schedule_reading_sees_calls_wrapped_in_their_own_fusions(early):
    """XLA wraps a call whose operands are slices in a fusion of its own (the call reads the
    slices in place): each wrapper is read as its call where it is scheduled, the done's first
    operand traced to the start's result, and the wrapper's own body is not a second start."""
    text = WRAPPED.replace("EARLY", "%e = f32[4,4] negate(%r)" if early else "")
    (pair,) = hlo_schedule.pairs(text)
    assert (pair.target, pair.start, pair.done, pair.matmuls_between) == (
        "jax_cpgrad_all_gather_start",
        0,
        3 + early,
        1,
    )
    assert pair.early_readers == (["e"] if early else [])


def test_errors_name_the_overlapped_function():
    mesh = cp_mesh(N, "cpu")
    body = lambda k: cpg.all_gather_overlapped(k, jnp.sin, k, axis_name="nope", seq_axis=SEQ)
    with pytest.raises(ValueError, match=r"jax_cpgrad\.all_gather_overlapped: axis name 'nope'"):
        spmd_jit(mesh, body)(place(mesh, _data()[0]))


class _SixtyFourSMs:
    @staticmethod
    def multiprocessor_count(device):
        return 64


@pytest.mark.parametrize(
    "sm_budget,overlap,want", [(None, False, 64), (None, True, 32), (16, True, 16), (100, True, 64)]
)
def test_an_overlapped_workspace_takes_half_the_sms_by_default(monkeypatch, sm_budget, overlap, want):
    """Its calls run beside other kernels; waiting kernels must fit on the GPU together."""
    from jax_cpgrad import workspace

    monkeypatch.setattr(workspace, "ext", _SixtyFourSMs)
    blocks, pushing = workspace._device_blocks(
        [type("D", (), {"local_hardware_id": 0})()], sm_budget, None, overlap
    )
    assert (blocks, pushing) == (want, want // 2)


NESTED = """\
ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %a = (f32[4,4]) custom-call(f32[4,4]{1,0} %x), custom_call_target="jax_cpgrad_all_gather_start"
  %ra = f32[4,4] get-tuple-element((f32[4,4]{1,0}) %a), index=0
  %b = (f32[4,4]) custom-call(%ra), custom_call_target="jax_cpgrad_grad_return_start"
  %rb = f32[4,4] get-tuple-element(%b), index=0
  %db = s32[1] custom-call(%rb, %ra), custom_call_target="jax_cpgrad_done"
  %da = s32[1] custom-call(%ra, %x), custom_call_target="jax_cpgrad_done"
  %other = (f32[4,4]) custom-call(%x), custom_call_target="someone_elses_start"
  ROOT %late = f32[4,4] add(%ra, %rb)
}
"""


def test_schedule_reading_takes_a_start_or_a_done_s_inputs_as_readers():
    """A start that reads another start's results before that one's done is a reader, so is a
    done whose inputs hold them; each done belongs to the start of its first operands; shapes
    printed beside operands are read; only our starts count."""
    a, b = hlo_schedule.pairs(NESTED)
    assert (a.target, a.done, a.early_readers) == ("jax_cpgrad_all_gather_start", 5, ["b", "db"])
    assert (b.target, b.done, b.early_readers) == ("jax_cpgrad_grad_return_start", 4, [])


def test_schedule_reading_refuses_a_line_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read"):
        hlo_schedule.pairs("%c (x: f32[4]) -> f32[4] {\n  %y = f32[4] %x\n}\n")
