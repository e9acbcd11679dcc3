"""One CP rank of the GPU tests. Run under the launcher (one process per rank), or alone.

    python -m jax_cpgrad.launch -n 4 tests/gpu_worker.py correctness,race,wrap,errors
    python tests/gpu_worker.py correctness          # one process, every visible GPU

JAX_CPGRAD_TEST_PROTOCOL (auto, device, memop) picks the workspaces' protocol;
JAX_CPGRAD_TEST_OVERLAP=1 creates them with overlap=True (every call a start/done pair on the workspace's
own stream). Prints one line
per scenario: RESULT {"scenario": ..., "ok": bool, "checks": {condition: bool}, ...}; ok is
whether every named check held. Every check compares against a numpy oracle computed in this
process from seeded per-rank data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hlo_schedule  # noqa: E402
import jax_cpgrad as cpg  # noqa: E402
from gpu_support import run_scenarios  # noqa: E402
from jax_cpgrad import _testing, launch  # noqa: E402
from oracle import DTYPES, all_gather_oracle, bits, grad_return_oracle, random_array  # noqa: E402
from spmd import cp_mesh, local_ranks, per_rank_results, place, spmd, spmd_jit  # noqa: E402

PROTOCOL = os.environ.get("JAX_CPGRAD_TEST_PROTOCOL", "auto")
OVERLAP = os.environ.get("JAX_CPGRAD_TEST_OVERLAP") == "1"
# (shape, seq_axis) per layout, for CP size n. "odd": runs of 105 elements, not a multiple of 16
# bytes (the narrow kernels); "tiles": a call cut into ~75 tiles whose edges fall inside rows.
LAYOUTS = {
    "BSHD": lambda n: ((2, 16 * n, 4, 64), 1),
    "SBHD": lambda n: ((16 * n, 2, 4, 64), 0),
    "odd": lambda n: ((3, 14 * n, 5, 3), 1),
    "tiles": lambda n: ((2, 200 * n, 6, 64), 1),
}


def workspace(mesh, nbytes, **kwargs):
    return cpg.Workspace(mesh, "cp", nbytes=nbytes, protocol=PROTOCOL, **{"overlap": OVERLAP, **kwargs})


def result(checks: dict, **info) -> dict:
    """A scenario's result: ok only when every named check holds, each reported by name."""
    checks = {name: bool(v) for name, v in checks.items()}
    return {"ok": all(checks.values()), "checks": checks, **info}


def _equal_bits(got: dict, want: list, what: str, failures: list) -> None:
    for r, arr in got.items():
        if not np.array_equal(bits(arr), bits(want[r])):
            bad = int(np.sum(bits(arr) != bits(want[r])))
            failures.append(f"{what}: rank {r}: {bad} of {arr.size} elements differ")


def _collective(op, seq: int, ws):
    """The per-rank body calling `op` (grad_return or all_gather) on its arguments as one tuple."""
    return lambda *xs: op(xs, axis_name="cp", seq_axis=seq, workspace=ws)


def _grad_of_all_gather(seq: int, ws):
    """(k, w) -> d/dk sum(w * all_gather(k)): the peer grad_return of w, through the VJP."""

    def body(k, w):
        loss = lambda x: jnp.sum(
            (w * cpg.all_gather(x, axis_name="cp", seq_axis=seq, workspace=ws)).astype(jnp.float32)
        )
        return jax.grad(loss)(k)

    return body


def correctness(mesh, n):
    """grad_return / all_gather / grad / vmap with the workspace, bitwise against the oracle."""
    failures = []
    with workspace(mesh, 4 << 20, name="correctness") as ws:
        for dtype in DTYPES:
            for layout, make in LAYOUTS.items():
                shape, seq = make(n)
                rng = np.random.default_rng(7)
                dk = random_array(rng, (n,) + shape, dtype)
                dv = random_array(rng, (n,) + shape, dtype)
                got_k, got_v = spmd(mesh, _collective(cpg.grad_return, seq, ws))(dk, dv)
                tag = f"{dtype}/{layout}"
                _equal_bits(got_k, grad_return_oracle(list(dk), n, seq), f"grad_return dK {tag}", failures)
                _equal_bits(got_v, grad_return_oracle(list(dv), n, seq), f"grad_return dV {tag}", failures)

                local_shape = shape[:seq] + (shape[seq] // n,) + shape[seq + 1 :]
                k = random_array(rng, (n,) + local_shape, dtype)
                v = random_array(rng, (n,) + local_shape, dtype)
                gk, gv = spmd(mesh, _collective(cpg.all_gather, seq, ws))(k, v)
                _equal_bits(gk, [all_gather_oracle(list(k), n, seq)] * n, f"all_gather K {tag}", failures)
                _equal_bits(gv, [all_gather_oracle(list(v), n, seq)] * n, f"all_gather V {tag}", failures)

                # The VJP of all_gather is the peer grad_return: d/dk sum(w * all_gather(k)) = grad_return(w).
                w = random_array(rng, (n,) + shape, dtype)
                # The cotangent of the product arrives in `dtype`: w itself, so the result is exact.
                g = spmd(mesh, _grad_of_all_gather(seq, ws))(k, w)
                _equal_bits(g, grad_return_oracle(list(w), n, seq), f"grad(all_gather) {tag}", failures)

        # vmap over B: per-example [S, H, D] with seq_axis 0.
        shape, seq = LAYOUTS["BSHD"](n)
        rng = np.random.default_rng(8)
        dk = random_array(rng, (n,) + shape, "float32")
        out = spmd(
            mesh,
            lambda a: jax.vmap(lambda x: cpg.grad_return(x, axis_name="cp", seq_axis=0, workspace=ws))(a),
        )(dk)
        _equal_bits(out, grad_return_oracle(list(dk), n, seq), "vmap grad_return", failures)
        status = ws.status()
    return result(
        {"bitwise_equal_to_oracle": not failures},
        failures=failures[:20],
        epochs=status["epochs"],
        protocol=ws.protocol,
    )


def _calls_in_turn(seq: int, specs):
    """The per-rank body: a grad_return, then an all-gather, on each spec in turn (one program)."""

    def body(*xs):
        grads, locals_ = xs[: len(specs)], xs[len(specs) :]
        back = [
            cpg.grad_return(g, axis_name="cp", seq_axis=seq, workspace=w)
            for g, w in zip(grads, specs, strict=True)
        ]
        gathered = [
            cpg.all_gather(x, axis_name="cp", seq_axis=seq, workspace=w)
            for x, w in zip(locals_, specs, strict=True)
        ]
        return (*back, *gathered)

    return body


def reach(mesh, n):
    """Calls that move the neighbours' data alone (a reach of 1, the window's halo), between whole
    calls on the same workspace, in one program: each bitwise against the oracle (zeros for the
    chunks of ranks out of reach; sums over the writers within it)."""
    failures = []
    with workspace(mesh, 4 << 20, name="reach") as ws:
        reaches = [1, 0, 1, 0]
        specs = [ws.spec.within(r) for r in reaches]
        for dtype in DTYPES:
            for layout in ("BSHD", "odd", "tiles"):
                shape, seq = LAYOUTS[layout](n)
                local_shape = shape[:seq] + (shape[seq] // n,) + shape[seq + 1 :]
                rng = np.random.default_rng(11)
                grads = [random_array(rng, (n,) + shape, dtype) for _ in specs]
                locals_ = [random_array(rng, (n,) + local_shape, dtype) for _ in specs]
                got = spmd(mesh, _calls_in_turn(seq, specs))(*grads, *locals_)
                for i, r in enumerate(reaches):
                    tag = f"call {i} (reach {r}) {dtype}/{layout}"
                    want = grad_return_oracle(list(grads[i]), n, seq, r)
                    _equal_bits(got[i], want, f"grad_return {tag}", failures)
                    want = [all_gather_oracle(list(locals_[i]), n, seq, r, rank) for rank in range(n)]
                    _equal_bits(got[len(specs) + i], want, f"all_gather {tag}", failures)
    return result({"bitwise_equal_to_oracle": not failures}, failures=failures[:20], protocol=ws.protocol)


def _integer_data(n, shape, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(-64, 64, size=(n,) + shape).astype(np.float32)


def _run_calls(mesh, n, ws, base, calls_per_step, steps, seq):
    """`steps` jitted steps of `calls_per_step` back-to-back calls (a scan); call c gets base + c.

    Values are small integers, so every sum is exact and any stale or torn slot shows.
    """

    def body(x, offset):
        def one(_, c):
            return None, cpg.grad_return(x + (offset + c), axis_name="cp", seq_axis=seq, workspace=ws)

        _, outs = jax.lax.scan(one, None, jnp.arange(calls_per_step, dtype=jnp.float32))
        return outs

    run = spmd(mesh, body)
    base_sums = grad_return_oracle(list(base), n, seq)
    bad_calls, checked = [], 0
    for step in range(steps):
        offsets = np.full((n,), step * calls_per_step, np.float32)
        outs = run(base, offsets)
        for r, stacked in outs.items():
            for c in range(calls_per_step):
                checked += 1
                want = base_sums[r] + n * (step * calls_per_step + c)
                if not np.array_equal(stacked[c], want):
                    bad_calls.append((step, c, r))
    return checked, bad_calls


# The delayed races: CP rank 0 waits this long before it reads each tile or call, so that the other
# ranks run ahead into the next call while it still reads this one.
SLOW_OWNER_NS = 20_000


# The race tests' data: 2 MiB of float32 per rank's local shard (the device protocol moves it in
# tiles with flags), or 128 KiB (small enough for its LL words).
RACE_SHAPES = {"tiles": lambda n: (1, 2048 * n, 2, 128), "ll": lambda n: (1, 128 * n, 2, 128)}


def _race(mesh, n, protected: bool, slow_owner: bool = False, wire: str = "tiles", timeout_s=None):
    """(checked calls, bad calls, info); a call that raises (a timed-out workspace) ends the run
    and is reported in info["error"]."""
    shape, seq = RACE_SHAPES[wire](n), 1
    base = _integer_data(n, shape, 11)
    local = base[0].nbytes // n
    options = {} if timeout_s is None else {"timeout_s": timeout_s}
    with workspace(mesh, local, name="race", **options) as ws:
        if not protected:
            _testing.remove_war_protection(ws)
        if slow_owner:
            _testing.delay_finishing(ws, 0, SLOW_OWNER_NS)
        t0 = time.time()
        error = None
        try:
            checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=50, steps=21, seq=seq)
        except Exception as err:  # JaxRuntimeError: the workspace failed
            checked, bad, error = 0, [], str(err)[:300]
        elapsed = time.time() - t0
        epochs = ws.status()["epochs"]
    return (
        checked,
        bad,
        dict(
            checked_calls=checked,
            bad_calls=len(bad),
            first_bad=bad[:5],
            seconds=round(elapsed, 2),
            epochs=epochs,
            protocol=ws.protocol,
            error=error,
        ),
    )


def race(mesh, n):
    """>= 1,000 back-to-back calls on one workspace, data changing every call, all checked."""
    checked, bad, info = _race(mesh, n, protected=True)
    return result({"at_least_1000_calls": checked >= 1000, "every_call_right": not bad}, **info)


def race_slow_owner(mesh, n):
    """The race test with a slow owner (rank 0 waits before reading): still every call right."""
    checked, bad, info = _race(mesh, n, protected=True, slow_owner=True)
    return result({"at_least_1000_calls": checked >= 1000, "every_call_right": not bad}, **info)


def race_small(mesh, n):
    """The slow-owner race test with calls small enough for the device protocol's LL words."""
    checked, bad, info = _race(mesh, n, protected=True, slow_owner=True, wire="ll")
    return result({"at_least_1000_calls": checked >= 1000, "every_call_right": not bad}, **info)


def race_small_unprotected(mesh, n):
    """race_small's negative control: without the parity sets the next call's LL words overwrite
    the ones the slow owner still waits for, with another epoch, so its call times out (NaN, then
    a failed workspace) instead of reading wrong data. Either way the slow owner must not see
    every call right."""
    checked, bad, info = _race(mesh, n, protected=False, slow_owner=True, wire="ll", timeout_s=2.0)
    checks = {}
    if 0 in local_ranks(mesh):
        checks["slow_owner_failed_without_protection"] = info["error"] is not None or any(
            r == 0 for _, _, r in bad
        )
    return result(checks, **info)


def race_unprotected(mesh, n):
    """The negative control: the slow-owner race test with the write-after-read protection removed
    (test builds' hooks) must go wrong, or the race tests prove nothing."""
    checked, bad, info = _race(mesh, n, protected=False, slow_owner=True)
    checks = {"at_least_1000_calls": checked >= 1000}
    if 0 in local_ranks(mesh):  # the slow owner is the rank whose slots get overwritten
        checks["slow_owner_got_wrong_calls_without_protection"] = any(r == 0 for _, _, r in bad)
    return result(checks, **info)


def graphs(mesh, n):
    """Calls recorded into XLA's command buffers (CUDA graphs) and replayed: 8 calls straight-line
    in one jit (XLA captures runs of >= 5 commands), 150 steps with data changing every step, all
    checked; then the compiled function called again after close(): an error or NaN, never a
    wrong number or a hang. With XLA_FLAGS=--xla_dump_to=DIR, whether XLA captured the calls."""
    shape, seq = (1, 256 * n, 2, 128), 1
    base = _integer_data(n, shape, 19)
    want = grad_return_oracle(list(base), n, seq)
    calls, steps = 8, 150

    def cpgrad_graph_probe(x, offset):
        outs, y = [], x
        for c in range(calls):
            out = cpg.grad_return(y + (offset + c), axis_name="cp", seq_axis=seq, workspace=ws)
            outs.append(out)
            _, y = jax.lax.optimization_barrier((out, x))  # call c+1 after call c, same input
        return jnp.stack(outs)

    ws = workspace(mesh, base[0].nbytes // n, name="graphs")
    f = spmd_jit(mesh, cpgrad_graph_probe)  # XLA's module: jit_cpgrad_graph_probe
    x = place(mesh, base)
    bad = 0
    for step in range(steps):
        offsets = place(mesh, np.full((n,), step * calls, np.float32))
        for r, stacked in per_rank_results(mesh, f(x, offsets)).items():
            for c in range(calls):
                bad += not np.array_equal(stacked[c], want[r] + n * (step * calls + c))
    ws.close()
    try:
        after = per_rank_results(mesh, f(x, place(mesh, np.zeros((n,), np.float32))))
        after_close = "nan" if all(np.isnan(v).all() for v in after.values()) else "numbers"
    except Exception as err:
        after_close = "error" if "is closed" in str(err) else f"unexpected error: {str(err)[:300]}"
    dump = _command_buffer_dump("cpgrad_graph_probe")
    checks = {"every_call_right": bad == 0, "after_close_error_or_nan": after_close in ("error", "nan")}
    if dump is not None:
        checks["xla_captured_the_calls"] = dump["captured"]
    return result(
        checks,
        checked_calls=steps * calls * len(local_ranks(mesh)),
        bad_calls=bad,
        after_close=after_close,
        dump=dump,
        protocol=ws.protocol,
    )


def _command_buffer_dump(module_part: str):
    """From XLA's dump (--xla_dump_to): does the module's thunk sequence after XLA's thunk passes
    hold a command buffer (kCommandBuffer) with our custom calls inside? None without a dump."""
    import glob

    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(r"--xla_dump_to=(\S+)", flags)
    if not match:
        return None
    files = sorted(glob.glob(os.path.join(match.group(1), f"*{module_part}*thunk*")))
    after = [f for f in files if "after" in os.path.basename(f)]
    text = "".join(open(f).read() for f in after)
    return {
        "files": [os.path.basename(f) for f in files][:6],
        "captured": "kCommandBuffer" in text,
        "head": text[:600],
    }


def wrap(mesh, n):
    """The 32-bit epoch passes 2^32: start 25 calls before it and run 60, with calls small enough
    for LL words and with calls in tiles (flags compared across the wrap)."""
    checked, bad, epochs = 0, [], {}
    for wire, shape in (("ll", (1, 8 * n, 2, 32)), ("tiles", (1, 512 * n, 2, 128))):
        base = _integer_data(n, shape, 12)
        with workspace(mesh, base[0].nbytes // n, name=f"wrap_{wire}") as ws:
            _testing.set_epoch(ws, 2**32 - 25)
            c, b = _run_calls(mesh, n, ws, base, calls_per_step=20, steps=3, seq=1)
            checked, bad, epochs[wire] = checked + c, bad + [(wire, *x) for x in b], ws.status()["epochs"]
    return result(
        {
            "every_call_right": not bad,
            "all_calls_ran": checked == 2 * 60 * len(local_ranks(mesh)),
            "epochs_wrapped_past_2**32": all(e < 1000 for es in epochs.values() for _, _, e in es),
        },
        checked_calls=checked,
        bad_calls=len(bad),
        epochs_after=epochs,
    )


def errors(mesh, n):
    """Handler-side rejections leave the epochs alone, and a closed workspace fails cleanly."""
    from jax_cpgrad.peer_transport import grad_return_peer

    failures = []
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 13)
    small = base[0].nbytes // n
    ws = workspace(mesh, small, name="errors")
    # Too large for the workspace, sent straight to the handler (Python's check bypassed).
    big = np.concatenate([base, base], axis=2)
    try:
        spmd(mesh, lambda a: grad_return_peer((a,), seq, n, ws.spec)[0])(big)
        failures.append("oversized call was not rejected")
    except Exception as err:  # JaxRuntimeError
        if "INVALID_ARGUMENT" not in str(err) or "holds" not in str(err):
            failures.append(f"oversized call: unexpected error {str(err)[:300]}")
    before = ws.status()["epochs"]
    # The rejection advanced no epoch: a valid call afterwards is still correct on every rank.
    checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=3, steps=1, seq=seq)
    if bad:
        failures.append(f"valid calls after a rejected one went wrong: {bad[:3]}")
    if [e for _, _, e in before] != [0] * len(before):
        failures.append(f"a rejected call advanced the epoch: {before}")
    # A jitted function that captured the workspace, called after close().
    f = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))
    f(base)
    ws.close()
    try:
        f(base)
        failures.append("call after close() did not fail")
    except Exception as err:
        if "is closed" not in str(err):
            failures.append(f"call after close(): unexpected error {str(err)[:300]}")
    try:
        spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))(base)
        failures.append("tracing with a closed workspace did not fail")
    except ValueError as err:
        if "is closed" not in str(err):
            failures.append(f"closed workspace at trace time: {err}")
    return result({"handler_errors_as_expected": not failures}, failures=failures)


def soak(mesh, n):
    """100,000 calls on one workspace, data changing every call, every result checked; device
    memory before and after."""
    from jax_cpgrad._native import ext

    shape, seq = (1, 4 * n, 2, 64), 1
    base = _integer_data(n, shape, 15)
    device = jax.local_devices()[0].local_hardware_id
    with workspace(mesh, base[0].nbytes // n, name="soak") as ws:
        _run_calls(mesh, n, ws, base, calls_per_step=1000, steps=1, seq=seq)  # compile, warm up
        free_before = ext.device_memory(device)[0]
        t0 = time.time()
        checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=1000, steps=100, seq=seq)
        elapsed = time.time() - t0
        free_after = ext.device_memory(device)[0]
    per_process_calls = 100_000 * len(local_ranks(mesh))
    return result(
        {
            "every_call_right": not bad,
            "all_calls_ran": checked == per_process_calls,
            "no_device_memory_drift": abs(free_before - free_after) < (64 << 20),
        },
        checked_calls=checked,
        bad_calls=len(bad),
        seconds=round(elapsed, 1),
        us_per_call=round(elapsed / 100_000 * 1e6, 1),
        free_mib_before=free_before >> 20,
        free_mib_after=free_after >> 20,
    )


def lifecycle(mesh, n):
    """1,000 create/close cycles leak no device memory and no peer mappings; each workspace works."""
    from jax_cpgrad._native import ext

    shape, seq = (1, 4 * n, 2, 64), 1
    base = _integer_data(n, shape, 16)
    device = jax.local_devices()[0].local_hardware_id
    want = grad_return_oracle(list(base), n, seq)

    def one_cycle(check: bool):
        with workspace(mesh, 4 << 20, name="cycle") as ws:
            if check:
                out = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))(
                    base
                )
                return all(np.array_equal(v, want[r]) for r, v in out.items())
        return True

    ok_calls = one_cycle(True)
    free_before = ext.device_memory(device)[0]
    mappings_before = ext.open_peer_mappings()
    t0 = time.time()
    for i in range(1000):
        ok_calls &= one_cycle(check=i % 100 == 0)
    elapsed = time.time() - t0
    free_after = ext.device_memory(device)[0]
    mappings_after = ext.open_peer_mappings()
    return result(
        {
            "calls_right": ok_calls,
            "no_peer_mapping_left": mappings_after == mappings_before == 0,
            "no_device_memory_drift": free_before - free_after < (64 << 20),
        },
        cycles=1000,
        seconds=round(elapsed, 1),
        free_mib_before=free_before >> 20,
        free_mib_after=free_after >> 20,
        open_peer_mappings_after=mappings_after,
    )


def independent(mesh, n):
    """Two workspaces on different axes of a 2-D mesh, used alternately, stay independent."""
    if n != 4:
        return result({"needs_4_ranks": False}, error="needs exactly 4 ranks (a 2 x 2 mesh)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh2 = Mesh(np.asarray(mesh.devices).reshape(2, 2), ("dp", "cp"))
    shape = (1, 8, 2, 32)
    base = _integer_data(4, shape, 17)  # rank r = 2 * dp + cp
    ws_cp = cpg.Workspace(mesh2, "cp", nbytes=1 << 16, name="along-cp", protocol=PROTOCOL)
    ws_dp = cpg.Workspace(mesh2, "dp", nbytes=1 << 16, name="along-dp", protocol=PROTOCOL)

    def body(x):
        x = x[0]
        outs = []
        for i in range(6):  # alternate the two workspaces, with data that changes per call
            ws, axis = (ws_cp, "cp") if i % 2 == 0 else (ws_dp, "dp")
            outs.append(cpg.grad_return(x + i, axis_name=axis, seq_axis=1, workspace=ws))
        return jnp.stack(outs)[None]

    spec = P(("dp", "cp"))
    f = jax.jit(jax.shard_map(body, mesh=mesh2, in_specs=spec, out_specs=spec))
    sharding = NamedSharding(mesh2, spec)
    me = local_ranks(mesh)[0]
    arr = (
        jax.make_array_from_process_local_data(sharding, base[me : me + 1], base.shape)
        if jax.process_count() > 1
        else jax.device_put(base, sharding)
    )
    out = {
        int(np.where(np.asarray(mesh2.devices).flat == s.device)[0][0]): np.asarray(s.data)[0]
        for s in f(arr).addressable_shards
    }
    failures = []
    for r, got in out.items():
        dp, cp = divmod(r, 2)
        for i in range(6):
            group = [2 * dp + c for c in range(2)] if i % 2 == 0 else [2 * d + cp for d in range(2)]
            pos = cp if i % 2 == 0 else dp
            want = grad_return_oracle([base[g] + i for g in group], 2, 1)[pos]
            if not np.array_equal(got[i], want):
                failures.append(f"rank {r} call {i}")
    ws_cp.close()
    ws_dp.close()
    return result({"both_axes_right": not failures}, failures=failures)


_KEPT = []  # jitted functions kept alive until the interpreter exits


def exit_open(mesh, n):
    """Leave two workspaces open (one mid-use) and let the interpreter exit normally."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 18)
    ws = workspace(mesh, base[0].nbytes // n, name="left-open")
    workspace(mesh, 4096, name="left-open-too")
    checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=5, steps=1, seq=seq)
    return result({"every_call_right": not bad}, checked_calls=checked)


def exit_closed(mesh, n):
    """`with Workspace(...) as ws:` around jitted calls, the jitted function kept alive after the
    block: the interpreter then exits normally (the test checks for leak reports)."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 20)
    with workspace(mesh, base[0].nbytes // n, name="closed-before-exit") as ws:
        f = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))
        out = f(base)
    _KEPT.append(f)
    want = grad_return_oracle(list(base), n, seq)
    return result(
        {
            "calls_right": all(np.array_equal(v, want[r]) for r, v in out.items()),
            "closed_holds_no_native_object": ws._native is None,
        }
    )


def mismatch(mesh, n):
    """Ranks that create a workspace with different arguments all get a ValueError, no hang."""
    me = local_ranks(mesh)[0]
    try:
        workspace(mesh, 4096 * (1 + me), name="mismatch")
        return result({"raised": False}, error="no error raised")
    except ValueError as err:
        from jax_cpgrad import _distributed

        _distributed.barrier("mismatch_reported", 60)  # rank 0 hosts the coordinator: wait for all
        return result(
            {"raised": True, "names_the_mismatch": "different arguments on different processes" in str(err)},
            error=str(err)[:500],
        )


def allocation_failure(mesh, n):
    """The last process fails to allocate its workspace: every process raises at once, not at the
    300 s setup timeout, and the others name the failing process and its error."""
    import time

    import jax

    from jax_cpgrad import _distributed, workspace as workspace_module

    failing = jax.process_count() - 1
    real_ext = workspace_module.ext

    class ExtWithoutMemory:  # the native module, except that allocating a workspace fails
        def __getattr__(self, name):
            return getattr(real_ext, name)

        @staticmethod
        def NativeWorkspace(*args):
            raise RuntimeError(
                "jax_cpgrad: out of GPU memory allocating the workspace (injected by the test)"
            )

    if jax.process_index() == failing:
        workspace_module.ext = ExtWithoutMemory()
    start = time.monotonic()
    try:
        workspace(mesh, 4096, name="alloc-failure")
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        workspace_module.ext = real_ext
    seconds = time.monotonic() - start
    _distributed.barrier("allocation_failure_reported", 60)  # rank 0 hosts the coordinator: wait for all
    expected = (
        "injected by the test" if jax.process_index() == failing else f"process {failing} could not create"
    )
    return result(
        {
            "raised": error is not None,
            "names_the_failing_process": expected in (error or ""),
            "carries_its_error": "injected by the test" in (error or ""),
            "at_once": seconds < 60,
        },
        error=(error or "no error raised")[:500],
        seconds=round(seconds, 2),
    )


def _grad_return_call(mesh, n, timeout_s):
    """(workspace, run, want, stuck) of _peer_trouble's checked call: a grad_return of small
    integers; ``run()`` is this rank's result, ``stuck(out)`` whether it is all NaN."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 14)
    me = local_ranks(mesh)[0]
    ws = workspace(mesh, base[0].nbytes // n, timeout_s=timeout_s, name="trouble")
    f = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))
    want = grad_return_oracle(list(base), n, seq)[me]
    return ws, lambda: f(base)[me], want, lambda out: bool(np.all(np.isnan(out)))


def _peer_trouble(mesh, n, *, timeout_s, straggler_action, call=_grad_return_call):
    """Call 1 with everyone; before call 2 the last rank runs `straggler_action`; the others call.
    ``call(mesh, n, timeout_s)``: the checked call (default a grad_return), as _grad_return_call."""
    ws, run, want, stuck = call(mesh, n, timeout_s)
    me = local_ranks(mesh)[0]
    first_ok = np.array_equal(run(), want)
    print(f"STEP first call done, correct={first_ok}", flush=True)
    if me == n - 1:
        straggler_action()
    t0 = time.time()
    out = run()
    second = {
        "seconds": round(time.time() - t0, 2),
        "correct": bool(np.array_equal(out, want)),
        "all_nan": stuck(out),
    }
    print(f"STEP second call done: {second}", flush=True)
    try:
        ws.check()
        check_error = None
    except RuntimeError as err:
        check_error = str(err)
    print(f"STEP check done: {check_error}", flush=True)
    try:
        run()
        third_error = None
    except Exception as err:
        third_error = str(err)[:2000]
    return ws, me, first_ok, second, check_error, third_error


def missing_peer(mesh, n, call=_grad_return_call):
    """The last rank stalls far past the timeout: the others fail, naming it, and do not hang.
    ``call``: the call that meets the stall (_peer_trouble's)."""
    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=3.0, straggler_action=lambda: time.sleep(15), call=call
    )
    if me == n - 1:
        return result({"first_call_right": first_ok}, role="straggler")
    named = f"CP ranks [{n - 1}] never arrived"
    return result(
        {
            "first_call_right": first_ok,
            "stuck_call_is_nan": second["all_nan"],
            "stuck_call_returned_within_12s": second["seconds"] < 12,
            "check_names_the_missing_rank": named in (check_error or ""),
            "next_call_fails_saying_timed_out": "timed out" in (third_error or ""),
        },
        role="waiter",
        second_call=second,
        check_error=check_error,
        third_call_error=third_error,
    )


def slow_peer(mesh, n):
    """The last rank stalls 3 s, well inside a 20 s timeout: everyone's results stay correct."""
    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=20.0, straggler_action=lambda: time.sleep(3)
    )
    ws.close()
    return result(
        {
            "first_call_right": first_ok,
            "delayed_call_right": second["correct"],
            "no_failure_reported": check_error is None,
            "next_call_fine": third_error is None,
        },
        second_call=second,
        check_error=check_error,
        third_call_error=third_error,
    )


def dead_peer(mesh, n):
    """The last rank's process exits before call 2: the others fail within the timeout, naming it."""

    def die():
        print(
            "RESULT "
            + json.dumps({"scenario": "dead_peer", "ok": True, "checks": {}, "role": "dead", "n": n}),
            flush=True,
        )
        os._exit(0)

    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=4.0, straggler_action=die
    )
    named = f"CP ranks [{n - 1}] never arrived"
    return result(
        {
            "first_call_right": first_ok,
            "stuck_call_is_nan": second["all_nan"],
            "check_names_the_dead_rank": named in (check_error or ""),
        },
        role="survivor",
        second_call=second,
        check_error=check_error,
        third_call_error=third_error,
    )


def _grad_return_right(mesh, n, ws, seed) -> bool:
    """One checked grad_return call on `ws` (exact small integers): is every local result right?"""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, seed)
    out = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))(base)
    want = grad_return_oracle(list(base), n, seq)
    return all(np.array_equal(v, want[r]) for r, v in out.items())


def intruder(mesh, n):
    """A process of another user (JAX_CPGRAD_TEST_INTRUDER, made by test_gpu.py as root) that knows
    everything in the key-value store tries, while the ranks pass each other their memory, to get
    it: through the sockets (their directories are private), /proc/PID/fd and pidfd_getfd; then,
    with rank 0's socket directory opened to everyone (as if its protection had failed), through
    rank 0's socket, whose credentials check must refuse it. The job goes on unharmed and rank 0
    warns, naming the intruder."""
    import warnings

    import intruder as intruder_script
    from jax_cpgrad import _memory_exchange

    me = local_ranks(mesh)[0]
    user = os.environ["JAX_CPGRAD_TEST_INTRUDER"]
    reports: dict = {}

    def hook(facts):
        reports["closed"] = intruder_script.run_as(user, facts)
        directory = os.path.dirname(facts[me]["socket"])
        os.chmod(directory, 0o755)  # the protection the credentials check stands behind, removed
        os.chmod(facts[me]["socket"], 0o777)
        try:
            reports["opened"] = intruder_script.run_as(user, facts)
        finally:
            os.chmod(directory, 0o700)

    if me == 0:
        _memory_exchange.serving_hook = hook
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ws = workspace(mesh, 1 << 16, name="intruded")
    finally:
        _memory_exchange.serving_hook = None
    with ws:
        right = all(_grad_return_right(mesh, n, ws, 20 + i) for i in range(3))
    if me != 0:
        return result({"calls_right_after": right})
    closed, opened = reports.get("closed", {}), reports.get("opened", {})
    if "could_not_run" in closed:
        return result({"intruder_ran": False}, skip=f"the intruder could not run: {closed['could_not_run']}")
    warned = [str(w.message) for w in caught if "refused its memory" in str(w.message)]
    intruder_id = f"pid {opened.get('pid')} (uid {opened.get('uid')})"
    sockets = [a["socket"] for a in closed["attempts"].values()]
    own = opened["attempts"]["0"]["socket"]
    return result(
        {
            "intruder_is_another_user": closed["uid"] != os.getuid(),
            "sockets_closed_to_it": all(not a["connected"] and a["error"] == "EACCES" for a in sockets),
            "proc_fd_denied": all(not a["proc_fd"]["listed"] for a in closed["attempts"].values()),
            "pidfd_getfd_denied": all(not a["pidfd_getfd"].get("fds") for a in closed["attempts"].values()),
            "open_socket_reached_the_server": own["connected"],
            "open_socket_sent_nothing": own.get("bytes") == 0 and not own.get("fds"),
            "no_descriptor_obtained": closed["obtained_fds"] == opened["obtained_fds"] == 0,
            "warning_names_the_intruder": any(intruder_id in w for w in warned),
            "calls_right_after": right,
        },
        closed=closed,
        opened=opened,
        warnings=warned,
    )


def bad_store_entries(mesh, n):
    """The last process publishes a truncated, then a bogus (wrong pid) entry for its workspace's
    facts: every process raises a clear error naming that process's entry, at once; a workspace
    created afterwards works."""
    from jax_cpgrad import _distributed

    me = jax.process_index()
    bad_rank = jax.process_count() - 1
    real_publish = _distributed.publish
    outcomes = {}
    for corruption in ("truncated", "bogus"):

        def publish(key, value, corruption=corruption):
            if not key.endswith("/peers") or me != bad_rank:
                return real_publish(key, value)
            raw = json.dumps(value).encode()
            bad = (
                raw[: len(raw) // 2]
                if corruption == "truncated"
                else json.dumps({**value, "pid": "x"}).encode()
            )
            _distributed._client().key_value_set_bytes(f"{key}/{me}", bad)

        _distributed.publish = publish
        t0 = time.monotonic()
        try:
            workspace(mesh, 1 << 16, name=f"bad-{corruption}").close()
            outcomes[corruption] = ("no error", time.monotonic() - t0)
        except RuntimeError as err:
            outcomes[corruption] = (str(err), time.monotonic() - t0)
        finally:
            _distributed.publish = real_publish
    with workspace(mesh, 1 << 16, name="after-bad-entries") as ws:
        right = _grad_return_right(mesh, n, ws, 30)
    entry = f"process {bad_rank}'s entry"
    return result(
        {
            "truncated_named": entry in outcomes["truncated"][0] and "not JSON" in outcomes["truncated"][0],
            "bogus_named": entry in outcomes["bogus"][0] and "pid 'x'" in outcomes["bogus"][0],
            "at_once": all(seconds < 60 for _, seconds in outcomes.values()),
            "next_workspace_works": right,
        },
        errors={k: v[0][:500] for k, v in outcomes.items()},
    )


def fabric(mesh, n):
    """Workspace.fabric_supported says what the driver says (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_
    SUPPORTED); handle_type="fabric" fails clearly either way (unsupported, or not exchanged yet),
    before anything is allocated; a default workspace afterwards works."""
    from jax_cpgrad._native import ext

    support = [ext.memory_support(d.local_hardware_id) for d in jax.local_devices()]
    supported = all(s["fabric"] for s in support)
    try:
        workspace(mesh, 1 << 16, name="fabric", handle_type="fabric").close()
        error = "no error"
    except (RuntimeError, NotImplementedError) as err:
        error = f"{type(err).__name__}: {err}"
    with workspace(mesh, 1 << 16, name="after-fabric") as ws:
        reported = ws.fabric_supported
        right = _grad_return_right(mesh, n, ws, 40)
    expected = "does not exchange them" if supported else "this process's GPUs do not"
    return result(
        {
            "property_matches_the_driver": reported == supported,
            "fabric_request_fails_clearly": expected in error,
            "default_workspace_works": right,
        },
        memory_support=support,
        error=error[:500],
    )


# The overlap scenarios slow the owner far more than the race tests do: each call must outlast the
# work beside it and the reads after its done.
OVERLAP_SLOW_OWNER_NS = 200_000


def _overlap_steps(mesh, n, join: bool, steps: int):
    """Steps of all_gather_overlapped with a projection beside it (and its VJP beside the dK/dV
    return) on an overlapped workspace whose owner is slowed down, so that its calls outlast the
    work beside them; every input changes every step. (failures, projection checks, compiled
    program text)."""
    local, seq = (1, 256 * n, 2, 128), 1
    glob = (1, 256 * n * n, 2, 128)
    k0, v0 = _integer_data(n, local, 21), _integer_data(n, local, 22)
    ck0, cv0 = _integer_data(n, glob, 23), _integer_data(n, glob, 24)
    rng = np.random.default_rng(25)
    h = rng.standard_normal((n, 256, 256)).astype(np.float32)
    w = (rng.standard_normal((n, 256, 256)) / 16).astype(np.float32)
    # float32 at full precision: XLA's default for float32 matmuls on GPUs is TF32, whose
    # results depend on the cuBLAS algorithm each compiled program picks.
    dot = lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    project = lambda h, w: dot(jnp.tanh(dot(h, w)), w)

    def make_body(ws):
        def body(k, v, h, w, ck, cv):
            f = lambda k, v, h, w: cpg.all_gather_overlapped(
                (k, v), project, h, w, axis_name="cp", seq_axis=seq, workspace=ws
            )
            ((ka, va), q), pull = jax.vjp(f, k, v, h, w)
            dk, dv, dh, dw = pull(((ck, cv), jnp.ones_like(q)))
            # Read on the GPU right after each done (doubling is exact), not only by the host
            # later: a read before the call is complete must show.
            return ka * 2, va * 2, q, dk * 2, dv * 2, dh, dw

        return body

    failures, close = [], []
    with workspace(mesh, k0[0].nbytes * 2, name="overlap", overlap=True) as ws:
        with workspace(mesh, k0[0].nbytes * 2, name="plain", overlap=False) as plain_ws:
            _testing.delay_finishing(ws, 0, OVERLAP_SLOW_OWNER_NS)
            if not join:
                _testing.skip_done_waits(ws)
            args = [place(mesh, a) for a in (k0, v0, h, w, ck0, cv0)]
            compiled_text = spmd_jit(mesh, make_body(ws)).lower(*args).compile().as_text()
            run, run_plain = spmd(mesh, make_body(ws)), spmd(mesh, make_body(plain_ws))
            for step in range(steps):
                k, v, ck, cv = k0 + step, v0 - step, ck0 + step, cv0 - 2 * step
                ka, va, q, dk, dv, dh, dw = run(k, v, h + step, w, ck, cv)
                twice = lambda arrays: [2 * a for a in arrays]
                _equal_bits(ka, twice([all_gather_oracle(list(k), n, seq)] * n), f"K step {step}", failures)
                _equal_bits(va, twice([all_gather_oracle(list(v), n, seq)] * n), f"V step {step}", failures)
                _equal_bits(dk, twice(grad_return_oracle(list(ck), n, seq)), f"dK step {step}", failures)
                _equal_bits(dv, twice(grad_return_oracle(list(cv), n, seq)), f"dV step {step}", failures)
                if join and step % 10 == 0:
                    ref = run_plain(k, v, h + step, w, ck, cv)
                    for name, got, want in zip(
                        ("q", "dh", "dw"), (q, dh, dw), ref[2:3] + ref[5:], strict=True
                    ):
                        for r in got:
                            # Relative to the largest value: the cuBLAS algorithms of the two
                            # programs differ (float32 sums in other orders), a wrong input would not.
                            worst = float(
                                np.max(np.abs(got[r] - want[r])) / max(np.max(np.abs(want[r])), 1e-30)
                            )
                            close.append(worst <= 1e-4)
                            if not close[-1]:
                                failures.append(
                                    f"{name} step {step}: {worst:.3g} (relative) off the plain workspace's"
                                )
    return failures, close, compiled_text, ws.protocol


def overlap(mesh, n):
    """Workspace(overlap=True): all_gather_overlapped places a projection (matmuls) between the
    gather's start and done, and its VJP between the dK/dV return's start and done; in the compiled
    schedule each start has its done, matmuls between them and no reader of its results before
    the done. 40 steps, every input changing, the owner slowed so that each call outlasts the work:
    the gathered K/V and returned dK/dV bitwise right, the projection's values and gradients equal
    to the same step on a workspace without overlap."""
    failures, close, text, protocol = _overlap_steps(mesh, n, join=True, steps=40)
    pairs = hlo_schedule.pairs(text)
    return result(
        {
            "every_step_bitwise_right": not [f for f in failures if "plain workspace" not in f],
            "projection_equals_the_plain_workspaces": bool(close) and all(close),
            "two_pairs_each_with_matmuls_between": len(pairs) == 2
            and all(p.matmuls_between > 0 for p in pairs),
            "every_start_has_its_done_and_no_early_reader": all(
                p.done is not None and not p.early_readers for p in pairs
            ),
        },
        failures=failures[:10],
        pairs=[dataclasses.asdict(p) for p in pairs],
        protocol=protocol,
    )


def overlap_unjoined(mesh, n):
    """The negative control of `overlap`: with the dones' waits removed (a test build's hook) the
    results are read before the slowed calls finish, and come out wrong."""
    failures, _, _, protocol = _overlap_steps(mesh, n, join=False, steps=10)
    return result(
        {"results_go_wrong_without_the_wait": bool(failures)}, failures=failures[:5], protocol=protocol
    )


SCENARIOS = {
    "correctness": correctness,
    "reach": reach,
    "overlap": overlap,
    "overlap_unjoined": overlap_unjoined,
    "race": race,
    "race_slow_owner": race_slow_owner,
    "race_unprotected": race_unprotected,
    "race_small": race_small,
    "race_small_unprotected": race_small_unprotected,
    "graphs": graphs,
    "wrap": wrap,
    "errors": errors,
    "exit_closed": exit_closed,
    "missing_peer": missing_peer,
    "slow_peer": slow_peer,
    "dead_peer": dead_peer,
    "soak": soak,
    "lifecycle": lifecycle,
    "independent": independent,
    "mismatch": mismatch,
    "exit_open": exit_open,
    "allocation_failure": allocation_failure,
    "intruder": intruder,
    "bad_store_entries": bad_store_entries,
    "fabric": fabric,
}


def main(names: list[str]) -> int:
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        launch.initialize()
    code = run_scenarios(SCENARIOS, names, cp_mesh(platform="gpu"))
    if any(name.startswith("exit_") for name in names):
        sys.exit(code)  # a normal interpreter exit (open workspaces, or closed ones still referenced)
    if any(name in ("missing_peer", "dead_peer", "slow_peer") for name in names):
        os._exit(code)  # a rank that saw a peer fail must not wait for it
    launch.finish(code, timeout_s=120)  # together: rank 0 hosts the coordination service


if __name__ == "__main__":
    main(sys.argv[1].split(","))
