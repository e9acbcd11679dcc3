"""One CP rank of the GPU tests. Run under the launcher (one process per rank), or alone.

    python -m jax_cpgrad.launch -n 4 tests/gpu_worker.py correctness,race,wrap,errors
    python tests/gpu_worker.py correctness          # one process, every visible GPU

Prints one line per scenario: RESULT {"scenario": ..., "ok": bool, ...}. Every check compares
against a numpy oracle computed in this process from seeded per-rank data.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_cpgrad as cpg  # noqa: E402
from jax_cpgrad import launch  # noqa: E402
from oracle import DTYPES, all_gather_oracle, bits, grad_return_oracle, random_array  # noqa: E402
from spmd import cp_mesh, local_ranks, spmd  # noqa: E402

LAYOUTS = {"BSHD": lambda n: ((2, 16 * n, 4, 64), 1), "SBHD": lambda n: ((16 * n, 2, 4, 64), 0)}


def _equal_bits(got: dict, want: list, what: str, failures: list) -> None:
    for r, arr in got.items():
        if not np.array_equal(bits(arr), bits(want[r])):
            bad = int(np.sum(bits(arr) != bits(want[r])))
            failures.append(f"{what}: rank {r}: {bad} of {arr.size} elements differ")


def correctness(mesh, n):
    """grad_return / all_gather / grad / vmap with the workspace, bitwise against the oracle."""
    failures = []
    with cpg.Workspace(mesh, "cp", nbytes=1 << 20, name="correctness") as ws:
        for dtype in DTYPES:
            for layout, make in LAYOUTS.items():
                shape, seq = make(n)
                rng = np.random.default_rng(7)
                dk = random_array(rng, (n,) + shape, dtype)
                dv = random_array(rng, (n,) + shape, dtype)
                got_k, got_v = spmd(mesh, lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=seq, workspace=ws))(dk, dv)
                tag = f"{dtype}/{layout}"
                _equal_bits(got_k, grad_return_oracle(list(dk), n, seq), f"grad_return dK {tag}", failures)
                _equal_bits(got_v, grad_return_oracle(list(dv), n, seq), f"grad_return dV {tag}", failures)

                local_shape = shape[:seq] + (shape[seq] // n,) + shape[seq + 1:]
                k = random_array(rng, (n,) + local_shape, dtype)
                v = random_array(rng, (n,) + local_shape, dtype)
                gk, gv = spmd(mesh, lambda a, b: cpg.all_gather((a, b), axis_name="cp", seq_axis=seq, workspace=ws))(k, v)
                _equal_bits(gk, [all_gather_oracle(list(k), n, seq)] * n, f"all_gather K {tag}", failures)
                _equal_bits(gv, [all_gather_oracle(list(v), n, seq)] * n, f"all_gather V {tag}", failures)

                # The VJP of all_gather is the peer grad_return: d/dk sum(w * all_gather(k)) = grad_return(w).
                w = random_array(rng, (n,) + shape, dtype)

                def grad_body(kk, ww):
                    loss = lambda x: jnp.sum((ww * cpg.all_gather(x, axis_name="cp", seq_axis=seq, workspace=ws)).astype(jnp.float32))
                    return jax.grad(loss)(kk)
                # The cotangent of the product arrives in `dtype`: w itself, so the result is exact.
                g = spmd(mesh, grad_body)(k, w)
                _equal_bits(g, grad_return_oracle(list(w), n, seq), f"grad(all_gather) {tag}", failures)

        # vmap over B: per-example [S, H, D] with seq_axis 0.
        shape, seq = LAYOUTS["BSHD"](n)
        rng = np.random.default_rng(8)
        dk = random_array(rng, (n,) + shape, "float32")
        out = spmd(mesh, lambda a: jax.vmap(lambda x: cpg.grad_return(x, axis_name="cp", seq_axis=0, workspace=ws))(a))(dk)
        _equal_bits(out, grad_return_oracle(list(dk), n, seq), "vmap grad_return", failures)
        status = ws.status()
    return {"ok": not failures, "failures": failures[:20], "epochs": status["epochs"]}


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


def race(mesh, n):
    """>= 1,000 back-to-back calls on one workspace, data changing every call, all checked."""
    shape, seq = (1, 2048 * n, 2, 128), 1  # 1 MiB of float32 per rank's local shard
    base = _integer_data(n, shape, 11)
    local = base[0].nbytes // n
    with cpg.Workspace(mesh, "cp", nbytes=local, name="race") as ws:
        t0 = time.time()
        checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=50, steps=21, seq=seq)
        elapsed = time.time() - t0
        epochs = ws.status()["epochs"]
    return {"ok": not bad and checked >= 1000, "checked_calls": checked, "bad_calls": len(bad),
            "first_bad": bad[:5], "seconds": round(elapsed, 2), "epochs": epochs,
            "unsafe_single_buffer": os.environ.get("JAX_CPGRAD_UNSAFE_SINGLE_BUFFER") == "1"}


def wrap(mesh, n):
    """The 32-bit epoch passes 2^32: start 25 calls before it and run 60."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 12)
    with cpg.Workspace(mesh, "cp", nbytes=base[0].nbytes // n, name="wrap",
                       _initial_epoch=2**32 - 25) as ws:
        checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=20, steps=3, seq=seq)
        epochs = ws.status()["epochs"]
    wrapped = all(e < 1000 for _, _, e in epochs)
    return {"ok": not bad and wrapped and checked == 60 * len(local_ranks(mesh)),
            "checked_calls": checked, "bad_calls": len(bad), "epochs_after": epochs}


def errors(mesh, n):
    """Handler-side rejections leave the epochs alone, and a closed workspace fails cleanly."""
    from jax_cpgrad.peer_transport import grad_return_peer

    failures = []
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 13)
    small = base[0].nbytes // n
    ws = cpg.Workspace(mesh, "cp", nbytes=small, name="errors")
    # Too large for the workspace, sent straight to the handler (Python's check bypassed).
    big = np.concatenate([base, base], axis=2)
    try:
        spmd(mesh, lambda a: grad_return_peer((a,), "cp", seq, n, ws)[0])(big)
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
    return {"ok": not failures, "failures": failures}


def soak(mesh, n):
    """100,000 calls on one workspace, data changing every call, every result checked; device
    memory before and after."""
    from jax_cpgrad._native import ext

    shape, seq = (1, 4 * n, 2, 64), 1
    base = _integer_data(n, shape, 15)
    device = jax.local_devices()[0].local_hardware_id
    with cpg.Workspace(mesh, "cp", nbytes=base[0].nbytes // n, name="soak") as ws:
        _run_calls(mesh, n, ws, base, calls_per_step=1000, steps=1, seq=seq)  # compile, warm up
        free_before = ext.device_memory(device)[0]
        t0 = time.time()
        checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=1000, steps=100, seq=seq)
        elapsed = time.time() - t0
        free_after = ext.device_memory(device)[0]
    per_process_calls = 100_000 * len(local_ranks(mesh))
    return {"ok": not bad and checked == per_process_calls and abs(free_before - free_after) < (64 << 20),
            "checked_calls": checked, "bad_calls": len(bad), "seconds": round(elapsed, 1),
            "us_per_call": round(elapsed / 100_000 * 1e6, 1),
            "free_mib_before": free_before >> 20, "free_mib_after": free_after >> 20}


def lifecycle(mesh, n):
    """1,000 create/close cycles leak no device memory and no IPC mappings; each workspace works."""
    from jax_cpgrad._native import ext

    shape, seq = (1, 4 * n, 2, 64), 1
    base = _integer_data(n, shape, 16)
    device = jax.local_devices()[0].local_hardware_id
    want = grad_return_oracle(list(base), n, seq)

    def one_cycle(check: bool):
        with cpg.Workspace(mesh, "cp", nbytes=4 << 20, name="cycle") as ws:
            if check:
                out = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))(base)
                return all(np.array_equal(v, want[r]) for r, v in out.items())
        return True

    ok_calls = one_cycle(True)
    free_before = ext.device_memory(device)[0]
    mappings_before = ext.open_ipc_mappings()
    t0 = time.time()
    for i in range(1000):
        ok_calls &= one_cycle(check=i % 100 == 0)
    elapsed = time.time() - t0
    free_after = ext.device_memory(device)[0]
    mappings_after = ext.open_ipc_mappings()
    return {"ok": ok_calls and mappings_after == mappings_before == 0 and free_before - free_after < (64 << 20),
            "cycles": 1000, "seconds": round(elapsed, 1), "free_mib_before": free_before >> 20,
            "free_mib_after": free_after >> 20, "open_ipc_mappings_after": mappings_after}


def independent(mesh, n):
    """Two workspaces on different axes of a 2-D mesh, used alternately, stay independent."""
    if n != 4:
        return {"ok": True, "skipped": "needs exactly 4 ranks (a 2 x 2 mesh)"}
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh2 = Mesh(np.asarray(mesh.devices).reshape(2, 2), ("dp", "cp"))
    shape = (1, 8, 2, 32)
    base = _integer_data(4, shape, 17)  # rank r = 2 * dp + cp
    ws_cp = cpg.Workspace(mesh2, "cp", nbytes=1 << 16, name="along-cp")
    ws_dp = cpg.Workspace(mesh2, "dp", nbytes=1 << 16, name="along-dp")

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
    arr = jax.make_array_from_process_local_data(sharding, base[me:me + 1], base.shape) \
        if jax.process_count() > 1 else jax.device_put(base, sharding)
    out = {int(np.where(np.asarray(mesh2.devices).flat == s.device)[0][0]): np.asarray(s.data)[0]
           for s in f(arr).addressable_shards}
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
    return {"ok": not failures, "failures": failures}


def exit_open(mesh, n):
    """Leave two workspaces open (one mid-use) and let the interpreter exit normally."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 18)
    ws = cpg.Workspace(mesh, "cp", nbytes=base[0].nbytes // n, name="left-open")
    cpg.Workspace(mesh, "cp", nbytes=4096, name="left-open-too")
    checked, bad = _run_calls(mesh, n, ws, base, calls_per_step=5, steps=1, seq=seq)
    return {"ok": not bad, "checked_calls": checked}


def mismatch(mesh, n):
    """Ranks that create a workspace with different arguments all get a ValueError, no hang."""
    me = local_ranks(mesh)[0]
    try:
        cpg.Workspace(mesh, "cp", nbytes=4096 * (1 + me), name="mismatch")
        return {"ok": False, "error": "no error raised"}
    except ValueError as err:
        from jax_cpgrad import _distributed

        _distributed.barrier("mismatch_reported", 60)  # rank 0 hosts the coordinator: wait for all
        return {"ok": "different arguments on different processes" in str(err), "error": str(err)[:500]}


def allocation_failure(mesh, n):
    """The last process fails to allocate its workspace: every process raises at once, not at the
    300 s setup timeout, and the others name the failing process and its error."""
    import time

    import jax
    from jax_cpgrad import _distributed, workspace

    failing = jax.process_count() - 1
    real_ext = workspace.ext
    class ExtWithoutMemory:  # the native module, except that allocating a workspace fails
        def __getattr__(self, name):
            return getattr(real_ext, name)

        @staticmethod
        def NativeWorkspace(*args):
            raise RuntimeError("jax_cpgrad: out of GPU memory allocating the workspace (injected by the test)")

    if jax.process_index() == failing:
        workspace.ext = ExtWithoutMemory()
    start = time.monotonic()
    try:
        cpg.Workspace(mesh, "cp", nbytes=4096, name="alloc-failure")
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        workspace.ext = real_ext
    seconds = time.monotonic() - start
    _distributed.barrier("allocation_failure_reported", 60)  # rank 0 hosts the coordinator: wait for all
    expected = "injected by the test" if jax.process_index() == failing else f"process {failing} could not create"
    ok = error is not None and expected in error and "injected by the test" in error and seconds < 60
    return {"ok": ok, "error": (error or "no error raised")[:500], "seconds": round(seconds, 2)}


def _peer_trouble(mesh, n, *, timeout_s, straggler_action):
    """Call 1 with everyone; before call 2 the last rank runs `straggler_action`; the others call."""
    shape, seq = (1, 8 * n, 2, 32), 1
    base = _integer_data(n, shape, 14)
    me = local_ranks(mesh)[0]
    ws = cpg.Workspace(mesh, "cp", nbytes=base[0].nbytes // n, timeout_s=timeout_s, name="trouble")
    f = spmd(mesh, lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=seq, workspace=ws))
    want = grad_return_oracle(list(base), n, seq)[me]
    first_ok = np.array_equal(f(base)[me], want)
    print(f"STEP first call done, correct={first_ok}", flush=True)
    if me == n - 1:
        straggler_action()
    t0 = time.time()
    out = f(base)[me]
    second = {"seconds": round(time.time() - t0, 2), "correct": bool(np.array_equal(out, want)),
              "all_nan": bool(np.all(np.isnan(out)))}
    print(f"STEP second call done: {second}", flush=True)
    try:
        ws.check()
        check_error = None
    except RuntimeError as err:
        check_error = str(err)
    print(f"STEP check done: {check_error}", flush=True)
    try:
        f(base)
        third_error = None
    except Exception as err:
        third_error = str(err)[:2000]
    return ws, me, first_ok, second, check_error, third_error


def missing_peer(mesh, n):
    """The last rank stalls far past the timeout: the others fail, naming it, and do not hang."""
    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=3.0, straggler_action=lambda: time.sleep(15))
    if me == n - 1:
        return {"ok": first_ok, "role": "straggler"}
    named = f"CP ranks [{n - 1}] never arrived"
    ok = (first_ok and second["all_nan"] and check_error is not None and named in check_error
          and third_error is not None and "timed out" in third_error and second["seconds"] < 12)
    return {"ok": ok, "role": "waiter", "second_call": second, "check_error": check_error,
            "third_call_error": third_error}


def slow_peer(mesh, n):
    """The last rank stalls 3 s, well inside a 20 s timeout: everyone's results stay correct."""
    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=20.0, straggler_action=lambda: time.sleep(3))
    ok = first_ok and second["correct"] and check_error is None and third_error is None
    ws.close()
    return {"ok": ok, "second_call": second, "check_error": check_error, "third_call_error": third_error}


def dead_peer(mesh, n):
    """The last rank's process exits before call 2: the others fail within the timeout, naming it."""
    def die():
        print("RESULT " + json.dumps({"scenario": "dead_peer", "ok": True, "role": "dead", "n": n}), flush=True)
        os._exit(0)
    ws, me, first_ok, second, check_error, third_error = _peer_trouble(
        mesh, n, timeout_s=4.0, straggler_action=die)
    named = f"CP ranks [{n - 1}] never arrived"
    ok = first_ok and second["all_nan"] and check_error is not None and named in check_error
    return {"ok": ok, "role": "survivor", "second_call": second, "check_error": check_error,
            "third_call_error": third_error}


SCENARIOS = {"correctness": correctness, "race": race, "wrap": wrap, "errors": errors,
             "missing_peer": missing_peer, "slow_peer": slow_peer, "dead_peer": dead_peer,
             "soak": soak, "lifecycle": lifecycle, "independent": independent, "mismatch": mismatch,
             "exit_open": exit_open, "allocation_failure": allocation_failure}


def main(names: list[str]) -> int:
    if "JAX_CPGRAD_COORDINATOR" in os.environ:
        launch.initialize()
    mesh = cp_mesh(platform="gpu")
    n = mesh.size
    code = 0
    for name in names:
        t0 = time.time()
        try:
            result = SCENARIOS[name](mesh, n)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()[-3000:]}
        result.update(scenario=name, n=n, ranks=local_ranks(mesh), seconds_total=round(time.time() - t0, 2))
        print("RESULT " + json.dumps(result), flush=True)
        code |= 0 if result["ok"] else 1
    sys.stdout.flush()
    if names == ["exit_open"]:
        sys.exit(code)  # a normal interpreter exit, with the workspaces still open
    # Skip jax.distributed's shutdown barrier: a rank that finishes early must not wait on others.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
