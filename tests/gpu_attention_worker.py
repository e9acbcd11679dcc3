"""The CP attention layer on real GPUs, one process per CP rank (several ranks may share a GPU).

    python tests/gpu_attention_worker.py values,schedule            # R = 1 in this process
    python -m jax_cpgrad.launch -n 2 tests/gpu_attention_worker.py values

JAX_CPGRAD_TEST_PROTOCOL (auto, device, memop) picks the workspace's protocol. Each scenario
prints one line ``RESULT {json}`` with named checks (tests/test_gpu_attention.py reads them).
At R = 1 the layer normally needs no transfer; these scenarios turn that shortcut off
(``transfer_when_alone``), so that the transfer's path (two chunks, gather and return on the
workspace) runs on one GPU. Masked calls (documents, windows) have no transfer at R = 1.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attention_check as ac
import gpu_worker
import hlo_schedule
import jax_cpgrad as cpg
from gpu_support import run_scenarios
from jax_cpgrad import _testing, launch
from jax_cpgrad.attention import halo, layer as attention_layer
from spmd import cp_mesh, local_ranks

PROTOCOL = os.environ.get("JAX_CPGRAD_TEST_PROTOCOL", "auto")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
CHUNK = int(os.environ.get("JAX_CPGRAD_TEST_CHUNK", 256))  # tokens per chunk: S = 2 N CHUNK
BF16_TOLERANCE = 5e-2
SLOW_OWNER_NS = 200_000  # each tile of the owner: the transfer outlasts the attention beside it
# Bitwise checks need cuDNN's deterministic backward (test_gpu_attention.py says when it is off).
DETERMINISTIC = "--xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")
CLOSE = 2e-2  # without it: two runs' outputs differ by the order of cuDNN's dQ sums


def _inputs(n: int, seed: int):
    return ac.random_inputs(
        2 * n * CHUNK, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=jnp.bfloat16, seed=seed
    )


def _nbytes() -> int:
    """The layer's workspace size for these tests' keys."""
    key = jax.ShapeDtypeStruct((1, 2 * CHUNK, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return cpg.attention_workspace_nbytes(key)


def _workspace(mesh, *, overlap: bool):
    return cpg.Workspace(mesh, "cp", nbytes=_nbytes(), protocol=PROTOCOL, overlap=overlap)


def _cp_layer(mesh, inputs, **kw):
    """attention_check.cp_layer in bfloat16, the transfer's path taken at R = 1 too."""
    return ac.cp_layer(mesh, inputs, dtype=jnp.bfloat16, transfer_when_alone=True, **kw)


def _result(checks: dict, **info) -> dict:
    checks = {name: bool(v) for name, v in checks.items()}
    return {"ok": all(checks.values()), "checks": checks, **info}


def _same(a: list, b: list) -> bool:
    """The same bits in every array of a and b ({rank: rows} each), or, without cuDNN's
    deterministic backward, within CLOSE of each other relative to the largest value."""
    for x, y in zip(a, b, strict=True):
        for r in x:
            if DETERMINISTIC and not np.array_equal(x[r].view(np.uint32), y[r].view(np.uint32)):
                return False
            if np.max(np.abs(x[r] - y[r])) > CLOSE * max(float(np.max(np.abs(y[r]))), 1e-30):
                return False
    return True


SAME = "same_bits" if DETERMINISTIC else "close"  # in the checks' names


def _same_results(a: dict, b: dict) -> bool:
    return _same([a[k] for k in ac.NAMES], [b[k] for k in ac.NAMES])


def values(mesh, n):
    """bf16 through cuDNN, causal and full, GQA, on a plain and an overlapped workspace: output and
    q/k/v gradients within 5e-2 of the float32 unsharded attention, the same bits on a second run,
    and the same bits on both workspaces (the schedule does not change the arithmetic)."""
    checks, errors = {}, {}
    for causal in (True, False):
        inputs = _inputs(n, seed=1 + causal)
        ref = ac.reference(*inputs, causal=causal)
        runs = {}
        for overlap in (False, True):
            with _workspace(mesh, overlap=overlap) as ws:
                first = _cp_layer(mesh, inputs, causal=causal, workspace=ws)
                second = _cp_layer(mesh, inputs, causal=causal, workspace=ws)
                protocol = ws.protocol
            tag = f"{'causal' if causal else 'full'}_{'overlap' if overlap else 'plain'}"
            errors[tag] = ac.relative_errors(first, ref)
            checks[f"{tag}_within_tolerance"] = max(errors[tag].values()) <= BF16_TOLERANCE
            checks[f"{tag}_{SAME}_twice"] = _same_results(first, second)
            runs[overlap] = first
        checks[f"{'causal' if causal else 'full'}_overlap_{SAME}_as_plain"] = _same_results(
            runs[False], runs[True]
        )
        if jax.process_count() == 1:  # XLA's collectives refuse ranks that share a GPU
            xla = _cp_layer(mesh, inputs, causal=causal)
            checks[f"{'causal' if causal else 'full'}_xla_transport_within_tolerance"] = (
                max(ac.relative_errors(xla, ref).values()) <= BF16_TOLERANCE
            )
    return _result(checks, errors=errors, protocol=protocol)


def _layer_step(ws, head_groups: int = 1, local_window_size=None):
    layer_fn = lambda q, k, v: attention_layer.attention(
        q,
        k,
        v,
        axis_name="cp",
        workspace=ws,
        head_groups=head_groups,
        local_window_size=local_window_size,
        transfer_when_alone=True,
    )

    def body(q, k, v, ct):
        out, vjp = jax.vjp(layer_fn, q, k, v)
        dq, dk, dv = vjp(ct)
        return out * 2, dq * 2, dk * 2, dv * 2  # read on the GPU right after each done

    spec = jax.sharding.PartitionSpec(None, "cp")
    return jax.jit(jax.shard_map(body, mesh=ws.mesh, in_specs=spec, out_specs=spec))


def _placed(mesh, inputs):
    return ac.place(mesh, inputs, jnp.bfloat16)


def _steps(mesh, ws, steps: int, local_window_size=None):
    """Outputs (numpy, on this process) of `steps` layer steps whose inputs change every step."""
    n = mesh.shape["cp"]
    step = _layer_step(ws, local_window_size=local_window_size)
    outs = []
    for s in range(steps):
        placed = _placed(mesh, _inputs(n, seed=100 + s))
        outs.append([ac.local_rows(o) for o in step(*placed)])
    return outs


def schedule(mesh, n):
    """The compiled forward and backward on an overlapped workspace: each start (the K/V gather,
    the dK/dV return) has its done, cuDNN attention scheduled between them, and nothing reads the
    start's results before the done; with the owner slowed, 10 steps whose inputs change equal
    (bitwise) the same steps on a workspace without overlap."""
    with _workspace(mesh, overlap=True) as ws:
        _testing.delay_finishing(ws, 0, SLOW_OWNER_NS)
        text = _layer_step(ws).lower(*_placed(mesh, _inputs(n, seed=0))).compile().as_text()
        got = _steps(mesh, ws, 10)
    with _workspace(mesh, overlap=False) as plain:
        want = _steps(mesh, plain, 10)
    checks, pairs = _pair_checks(text, "two", 2)
    same = [_same(g, w) for g, w in zip(got, want, strict=True)]
    checks["overlapped_steps_equal_the_plain_ones"] = all(same)
    return _result(checks, pairs=pairs, steps_equal=same)


def _pair_checks(text: str, words: str, count: int) -> tuple[dict, list]:
    """The compiled program's start/done pairs: ``count`` of them, each with attention between its
    start and done, its done present and no early reader; (checks, the pairs as dicts)."""
    pairs = hlo_schedule.pairs(text)
    checks = {
        f"{words}_pairs_with_attention_between": len(pairs) == count
        and all(p.matmuls_between > 0 for p in pairs),
        "every_start_has_its_done_and_no_early_reader": all(
            p.done is not None and not p.early_readers for p in pairs
        ),
    }
    return checks, [dataclasses.asdict(p) for p in pairs]


def head_groups(mesh, n):
    """head_groups=2 (the transfer pipelined over the 2 key/value heads) on an overlapped
    workspace, causal and full: within 5e-2 of the float32 unsharded attention and the same as
    head_groups=1 (bits, with cuDNN's deterministic backward); the compiled step has four pairs
    (two gathers, two returns), each with attention between its start and done and no early
    reader."""
    checks, errors = {}, {}
    with _workspace(mesh, overlap=True) as ws:
        for causal in (True, False):
            inputs = _inputs(n, seed=40 + causal)
            tag = "causal" if causal else "full"
            grouped, whole = (
                _cp_layer(mesh, inputs, causal=causal, workspace=ws, head_groups=g) for g in (2, 1)
            )
            errors[tag] = ac.relative_errors(grouped, ac.reference(*inputs, causal=causal))
            checks[f"{tag}_within_tolerance"] = max(errors[tag].values()) <= BF16_TOLERANCE
            checks[f"{tag}_{SAME}_as_one_group"] = _same_results(grouped, whole)
        text = _layer_step(ws, head_groups=2).lower(*_placed(mesh, _inputs(n, seed=0))).compile().as_text()
    pair_checks, pairs = _pair_checks(text, "four", 4)
    return _result(checks | pair_checks, errors=errors, pairs=pairs)


def schedule_unjoined(mesh, n):
    """The negative control of `schedule`: with the dones' waits removed (a test build's hook) and
    the owner slowed, the attention reads K/V (and the backward dK/dV) before they have arrived,
    and the results differ from the plain workspace's."""
    with _workspace(mesh, overlap=True) as ws:
        _testing.delay_finishing(ws, 0, SLOW_OWNER_NS)
        _testing.skip_done_waits(ws)
        got = _steps(mesh, ws, 5)
    with _workspace(mesh, overlap=False) as plain:
        want = _steps(mesh, plain, 5)
    differ = [not _same(g, w) for g, w in zip(got, want, strict=True)]
    return _result({"results_go_wrong_without_the_wait": any(differ)}, steps_differ=differ)


def vmapped(mesh, n):
    """jax.vmap over a leading axis (2 micro-batches) inside shard_map with a peer workspace sized
    for both (attention_workspace_nbytes of a key with both slices' rows): each slice within 5e-2
    of the float32 unsharded attention, causal and full; a workspace sized for one slice is
    refused with the size it needs (the handler's check), not overrun."""
    slices = 2
    key = jax.ShapeDtypeStruct((slices, 2 * CHUNK, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    checks, errors = {}, {}
    for causal in (True, False):
        per_slice = [_inputs(n, seed=30 + i + 10 * causal) for i in range(slices)]
        nbytes = cpg.attention_workspace_nbytes(key)
        with cpg.Workspace(mesh, "cp", nbytes=nbytes, protocol=PROTOCOL) as ws:
            got = vmapped_layer(mesh, per_slice, causal=causal, workspace=ws)
        for i, inputs in enumerate(per_slice):
            tag = f"{'causal' if causal else 'full'}_slice{i}"
            errors[tag] = ac.relative_errors(got[i], ac.reference(*inputs, causal=causal))
            checks[f"{tag}_within_tolerance"] = max(errors[tag].values()) <= BF16_TOLERANCE
    with _workspace(mesh, overlap=False) as one_slice:
        try:
            vmapped_layer(mesh, per_slice, causal=True, workspace=one_slice)
            refusal = ""
        except Exception as e:  # noqa: BLE001 (XLA raises the handler's INVALID_ARGUMENT as it likes)
            refusal = str(e)
    checks["one_slice_workspace_refused_with_the_size"] = "larger nbytes" in refusal
    return _result(checks, errors=errors, refusal=refusal[-400:])


def vmapped_layer(mesh, per_slice, *, causal: bool, workspace):
    """The layer under jax.vmap over the slices' inputs (each (q, k, v, ct) [B, S, ...]): for each
    slice, {name: {rank: local rows}} of the output and gradients held by this process."""
    n = mesh.shape["cp"]
    layer_fn = functools.partial(
        attention_layer.attention,
        axis_name="cp",
        workspace=workspace,
        is_causal=causal,
        transfer_when_alone=True,
    )

    def one(q, k, v, ct):
        out, vjp = jax.vjp(layer_fn, q, k, v)
        return (out, *vjp(ct))

    spec = jax.sharding.PartitionSpec(None, None, "cp")
    step = jax.jit(jax.shard_map(jax.vmap(one), mesh=mesh, in_specs=spec, out_specs=spec))
    stacked = [np.stack(xs) for xs in zip(*per_slice, strict=True)]
    outs = step(*ac.place(mesh, stacked, jnp.bfloat16, seq_axis=2))
    length = outs[0].shape[2] // n
    rows = lambda o, i: {
        (s.index[2].start or 0) // length: np.asarray(s.data[i], np.float32) for s in o.addressable_shards
    }
    return [{name: rows(o, i) for name, o in zip(ac.NAMES, outs, strict=True)} for i in range(len(per_slice))]


def masks(mesh, n):
    """Documents across chunk and rank boundaries with a window (causal: 1.5 chunks to the left;
    full: half a chunk left, a quarter right), and short documents given their bound
    (``max_document_length``: the window it implies, under a chunk, so the halo travels), bfloat16
    through the masked kernels that implementation=None picks, GQA, on a plain and an overlapped
    workspace (the segment ids travel over it before K/V): output and q/k/v gradients within 5e-2
    of the float32 unsharded attention (the bound's against the documents' mask alone), and the
    same on both workspaces (the schedule does not change the arithmetic)."""
    checks, errors = {}, {}
    crossing, short = (ac.documents(kind, 2 * n * CHUNK, 1, chunk=CHUNK) for kind in ("crossing", "short"))
    cases = (  # (name, causal, ids, window, max_document_length)
        ("causal", True, crossing, (3 * CHUNK // 2, 0), None),
        ("full", False, crossing, (CHUNK // 2, CHUNK // 4), None),
        ("bounded", True, short, None, cpg.longest_document(short)),
    )
    for name, causal, ids, window, bound in cases:
        inputs = _inputs(n, seed=60 + causal)
        mask = dict(causal=causal, segment_ids=ids, local_window_size=window)
        ref = ac.reference(*inputs, **mask)
        runs = {}
        for overlap in (False, True):
            with _workspace(mesh, overlap=overlap) as ws:
                runs[overlap] = _cp_layer(mesh, inputs, workspace=ws, max_document_length=bound, **mask)
            tag = f"{name}_{'overlap' if overlap else 'plain'}"
            errors[tag] = ac.relative_errors(runs[overlap], ref)
            checks[f"{tag}_within_tolerance"] = max(errors[tag].values()) <= BF16_TOLERANCE
        checks[f"{name}_overlap_{SAME}_as_plain"] = _same_results(runs[False], runs[True])
    return _result(checks, errors=errors)


HALO_WINDOWS = ((True, (CHUNK // 2, 0)), (False, (CHUNK // 4, CHUNK // 8)))  # (causal, (left, right))
# causal windows' left sides: shorter than a chunk (the halo), a chunk and more (the band)
CUDNN_WINDOWS = (CHUNK // 2, CHUNK - 1, CHUNK, 2 * CHUNK + CHUNK // 2 + 3)


def cudnn_windows(mesh, n):
    """implementation='cudnn' with causal windows shorter than a chunk (the diagonal blocks with
    cuDNN's sliding window, the halo's edge rows as reversed causal calls) and of a chunk or
    more (the diagonal blocks causal, the keys before each chunk whole and as a reversed band):
    output and q/k/v gradients within 5e-2 of the float32 unsharded attention, on a plain and an overlapped
    workspace, the same (bits, with cuDNN's deterministic backward) twice and on both; at R = 1
    (one call with the window) also on XLA's collectives."""
    checks, errors = {}, {}
    for left in CUDNN_WINDOWS:
        window = (left, 0)
        inputs = _inputs(n, seed=80 + left)
        ref = ac.reference(*inputs, local_window_size=window)
        runs = {}
        for overlap in (False, True):
            with _workspace(mesh, overlap=overlap) as ws:
                kw = dict(workspace=ws, local_window_size=window, implementation="cudnn")
                first, second = (_cp_layer(mesh, inputs, **kw) for _ in range(2))
            tag = f"left{left}_{'overlap' if overlap else 'plain'}"
            errors[tag] = ac.relative_errors(first, ref)
            checks[f"{tag}_within_tolerance"] = max(errors[tag].values()) <= BF16_TOLERANCE
            checks[f"{tag}_{SAME}_twice"] = _same_results(first, second)
            runs[overlap] = first
        checks[f"left{left}_overlap_{SAME}_as_plain"] = _same_results(runs[False], runs[True])
        if jax.process_count() == 1:  # XLA's collectives refuse ranks that share a GPU
            xla = _cp_layer(mesh, inputs, local_window_size=window, implementation="cudnn")
            errors[f"left{left}_xla"] = ac.relative_errors(xla, ref)
            checks[f"left{left}_xla_transport_within_tolerance"] = (
                max(errors[f"left{left}_xla"].values()) <= BF16_TOLERANCE
            )
    return _result(checks, errors=errors)


def _halo_oracle(k_nat: np.ndarray, ct_by_rank: dict, n: int, left: int, right: int):
    """numpy: each rank's halo rows (the natural-order rows at its halo positions, zeros for
    padding) and the owners' returned gradient in CP layout ({rank: [B, 2c, ...]} float32: every
    receiver's cotangent of a row added, in float32, into the owner's rows)."""
    c = CHUNK
    rows, grad_nat = {}, np.zeros(k_nat.shape, np.float32)
    for r in range(n):
        pos, valid = halo.halo_positions(r, n, c, left, right)
        rows[r] = np.where(valid[None, :, None, None], k_nat[:, np.where(valid, pos, 0)], 0.0)
        for i in np.flatnonzero(valid):  # rank order, row order: float32 adds of the cotangents
            grad_nat[:, pos[i]] += ct_by_rank[r][:, i]
    laid = np.asarray(cpg.to_cp_layout(grad_nat, n, seq_axis=1))
    return rows, {r: laid[:, r * 2 * c : (r + 1) * 2 * c] for r in range(n)}


def halo_rows(mesh, n):
    """The halo exchange on the peer transport (plain and overlapped workspaces), causal and
    two-sided windows smaller than a chunk: each rank's halo rows bitwise equal to the
    natural-order rows at their positions (zeros for padding), and the VJP's returned dK bitwise
    equal to a numpy float32 sum of the receivers' cotangents at the owners; 20 steps whose data
    change every step (XLA replays its command buffers), every one checked."""
    checks = {}
    for causal, (left, right) in HALO_WINDOWS:
        tag = f"{'causal' if causal else 'two_sided'}_{left}_{right}"
        hl = halo.halo_length(left, right)
        for overlap in (False, True):
            with _workspace(mesh, overlap=overlap) as ws:

                def body(k, ct, ws=ws, left=left, right=right):
                    h, vjp = jax.vjp(
                        lambda k: (
                            halo.halo_exchange(k, axis_name="cp", left=left, right=right, workspace=ws).rows
                        ),
                        k,
                    )
                    return h, vjp(ct)[0]

                spec = jax.sharding.PartitionSpec(None, "cp")
                step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
                ok_rows = ok_grads = True
                for s in range(20):
                    rng = np.random.default_rng(1000 * s + left)
                    k_nat = rng.standard_normal((1, 2 * n * CHUNK, KV_HEADS, HEAD_DIM)).astype(np.float32)
                    k_nat = np.asarray(jnp.asarray(k_nat, jnp.bfloat16), np.float32)  # exact in bf16
                    ct_all = rng.standard_normal((1, n * hl, KV_HEADS, HEAD_DIM)).astype(np.float32)
                    ct_all = np.asarray(jnp.asarray(ct_all, jnp.bfloat16), np.float32)
                    ct_by_rank = {r: ct_all[:, r * hl : (r + 1) * hl] for r in range(n)}
                    (k_placed,) = ac.place(mesh, [k_nat], jnp.bfloat16)
                    ct_placed = _sharded(mesh, ct_all)
                    got_rows, got_grad = step(k_placed, ct_placed)
                    want_rows, want_grad = _halo_oracle(k_nat, ct_by_rank, n, left, right)
                    want_grad = {
                        r: np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32) for r, g in want_grad.items()
                    }
                    for r, x in ac.local_rows(got_rows).items():
                        ok_rows &= np.array_equal(x.view(np.uint32), want_rows[r].view(np.uint32))
                    for r, x in ac.local_rows(got_grad).items():
                        ok_grads &= np.array_equal(x.view(np.uint32), want_grad[r].view(np.uint32))
            kind = "overlap" if overlap else "plain"
            checks[f"{tag}_{kind}_rows_bitwise_for_20_steps"] = ok_rows
            checks[f"{tag}_{kind}_returned_grads_bitwise_for_20_steps"] = ok_grads
    return _result(checks)


def _halo_call(mesh, n, timeout_s):
    """gpu_worker._peer_trouble's checked call as the window's halo exchange: (workspace, run,
    want, stuck); ``stuck(out)``: every row this rank gets from the others is NaN."""
    left, right = HALO_WINDOWS[0][1]
    ws = cpg.Workspace(mesh, "cp", nbytes=_nbytes(), protocol=PROTOCOL, timeout_s=timeout_s)
    me = local_ranks(mesh)[0]
    rng = np.random.default_rng(5)
    k_nat = rng.standard_normal((1, 2 * n * CHUNK, KV_HEADS, HEAD_DIM)).astype(np.float32)
    k_nat = np.asarray(jnp.asarray(k_nat, jnp.bfloat16), np.float32)  # exact in bf16
    (k_placed,) = ac.place(mesh, [k_nat], jnp.bfloat16)
    rows = lambda k: halo.halo_exchange(k, axis_name="cp", left=left, right=right, workspace=ws).rows
    spec = jax.sharding.PartitionSpec(None, "cp")
    step = jax.jit(jax.shard_map(rows, mesh=mesh, in_specs=spec, out_specs=spec))
    no_cts = {r: np.zeros((1, halo.halo_length(left, right), KV_HEADS, HEAD_DIM)) for r in range(n)}
    want, _ = _halo_oracle(k_nat, no_cts, n, left, right)
    _, valid = halo.halo_positions(me, n, CHUNK, left, right)
    run = lambda: ac.local_rows(step(k_placed))[me].astype(np.float32)
    return ws, run, want[me], lambda out: bool(np.all(np.isnan(out[:, valid])))


def halo_missing_peer(mesh, n):
    """The last rank stalls far past the workspace's timeout before the second halo exchange:
    the others' rows from it come back NaN within the timeout, check() names it, and the next
    call fails saying it timed out, as for the transport's own calls (gpu_worker.missing_peer)."""
    return gpu_worker.missing_peer(mesh, n, call=_halo_call)


def _sharded(mesh, x: np.ndarray):
    """x (float32, [B, R * rows, ...]) as bfloat16 sharded on axis 1 over "cp": rank r's rows."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
    as_bf16 = lambda i: np.asarray(jnp.asarray(x[i], jnp.bfloat16))
    return jax.make_array_from_callback(x.shape, sharding, as_bf16)


def halo_layer(mesh, n):
    """The layer with windows smaller than a chunk and no documents (the halo-only transfer):
    values and q/k/v gradients within 5e-2 of the float32 unsharded attention, causal and
    two-sided, on a plain and an overlapped workspace, the same bits on both and on a second run
    (the masked kernels are deterministic); the compiled overlapped step has two start/done
    pairs (the halo's gather and its return) with attention between and no early reader, and no
    all-gather of the whole K/V (the gathered rows are the halo's, not 2c per rank)."""
    checks, errors = {}, {}
    for causal, window in HALO_WINDOWS:
        tag = "causal" if causal else "two_sided"
        inputs = _inputs(n, seed=70 + causal)
        ref = ac.reference(*inputs, causal=causal, local_window_size=window)
        runs = {}
        for overlap in (False, True):
            with _workspace(mesh, overlap=overlap) as ws:
                first = _cp_layer(mesh, inputs, causal=causal, workspace=ws, local_window_size=window)
                second = _cp_layer(mesh, inputs, causal=causal, workspace=ws, local_window_size=window)
            kind = "overlap" if overlap else "plain"
            errors[f"{tag}_{kind}"] = ac.relative_errors(first, ref)
            checks[f"{tag}_{kind}_within_tolerance"] = max(errors[f"{tag}_{kind}"].values()) <= BF16_TOLERANCE
            checks[f"{tag}_{kind}_same_bits_twice"] = _bitwise(first, second)
            runs[overlap] = first
        checks[f"{tag}_overlap_same_bits_as_plain"] = _bitwise(runs[False], runs[True])
    with _workspace(mesh, overlap=True) as ws:
        step = _layer_step(ws, local_window_size=HALO_WINDOWS[0][1])
        text = step.lower(*_placed(mesh, _inputs(n, seed=0))).compile().as_text()
    pair_checks, pairs = _pair_checks(text, "two", 2)
    return _result(checks | pair_checks, errors=errors, pairs=pairs)


def _bitwise(a: dict, b: dict) -> bool:
    return all(
        np.array_equal(a[name][r].view(np.uint32), b[name][r].view(np.uint32))
        for name in ac.NAMES
        for r in a[name]
    )


def halo_unjoined(mesh, n):
    """The negative control of `halo_layer`'s schedule: with the dones' waits removed and the
    owner slowed, the windowed layer's steps differ from the plain workspace's."""
    window = HALO_WINDOWS[0][1]
    with _workspace(mesh, overlap=True) as ws:
        _testing.delay_finishing(ws, 0, SLOW_OWNER_NS)
        _testing.skip_done_waits(ws)
        got = _steps(mesh, ws, 5, local_window_size=window)
    with _workspace(mesh, overlap=False) as plain:
        want = _steps(mesh, plain, 5, local_window_size=window)
    differ = [not _same(g, w) for g, w in zip(got, want, strict=True)]
    return _result({"results_go_wrong_without_the_wait": any(differ)}, steps_differ=differ)


SCENARIOS = {
    "values": values,
    "schedule": schedule,
    "schedule_unjoined": schedule_unjoined,
    "head_groups": head_groups,
    "vmapped": vmapped,
    "masks": masks,
    "cudnn_windows": cudnn_windows,
    "halo_rows": halo_rows,
    "halo_layer": halo_layer,
    "halo_unjoined": halo_unjoined,
    "halo_missing_peer": halo_missing_peer,
}


def main(names: list[str]) -> int:
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        launch.initialize()
    code = run_scenarios(SCENARIOS, names, cp_mesh(platform="gpu"))
    if "halo_missing_peer" in names:
        os._exit(code)  # a rank that saw a peer fail must not wait for it
    launch.finish(code, timeout_s=120)  # together: rank 0 hosts the coordination service


if __name__ == "__main__":
    main(sys.argv[1].split(","))
