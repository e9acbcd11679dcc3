"""benchmarks/grad_return.py and benchmarks/ceiling.py on the CPU: the smoke run, the report's
arithmetic, the ceiling's refusal of same-GPU targets, and what the GPU-only paths trace to."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from run_python import run_python, script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ceiling  # noqa: E402
import grad_return as bench  # noqa: E402

from workspace_stub import workspace_spec  # noqa: E402

SMOKE = "benchmarks/grad_return.py --cpu --sizes 64K 1M --dtypes float32 --reps 2 --iters 2 --calls 3".split()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    js, png = tmp / "b.json", tmp / "b.png"
    out = run_python([*SMOKE, "--json", str(js), "--png", str(png)])
    return out, json.loads(js.read_text()), png


def test_cpu_smoke_run_measures_every_cpu_baseline_in_both_modes_and_ops(smoke):
    out, data, _ = smoke
    for block in (
        "grad_return, latency",
        "grad_return, bandwidth",
        "all_gather, latency",
        "all_gather, bandwidth",
    ):
        assert f"== {block} mode" in out, out
    assert "not NCCL" in out  # the CPU's collectives are named for what they are
    assert data["n"] == 8 and data["backend"] == "cpu" and data["processes"] == 1
    assert data["shared_gpu"] is False and data["jax"] == jax.__version__
    assert set(data["transports"]) == {"local", "nccl", "xla-recipe"}
    assert data["modes"] == ["latency", "bandwidth"] and data["ops"] == ["grad_return", "all_gather"]
    assert data["command"][0].endswith("grad_return.py") and "--cpu" in data["command"]
    for key in ("date", "host", "device_kind", "calls", "iters", "reps"):
        assert key in data
    assert data["ceilings"] == [] and "no ceiling" in data["ceiling"]
    points = {(r["op"], r["mode"], r["global_bytes_per_tensor"], r["transport"]) for r in data["rows"]}
    expected = {
        (op, mode, size, t)
        for op in ("grad_return", "all_gather")
        for t in ("local", "nccl", "xla-recipe")
        for mode, size in (("latency", 64 << 10), ("latency", 1 << 20), ("bandwidth", 1 << 20))
    }
    assert points == expected
    for r in data["rows"]:
        assert r["backend"] == "cpu" and r["n"] == 8 and r["tensors"] == 2 and r["dtype"] == "float32"
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["calls_per_run"] == (3 if r["mode"] == "latency" else 2)
        assert r["of_ceiling"] is None and r["ceiling_s"] is None
        if r["transport"] == "local":  # moves nothing between devices: no bandwidth or ratio
            assert r["busbw_gbps"] is None and r["vs_best_nccl"] is None
        elif (
            r["mode"] == "bandwidth"
        ):  # wall time; a latency row is a slope, which noise on a busy CPU can flip
            assert r["min_s"] > 0 and r["vs_best_nccl"] > 0
            assert r["busbw_gbps"] == pytest.approx(
                7 / 8 * 2 * r["global_bytes_per_tensor"] / r["median_s"] / 1e9
            )
        if r["transport"] == "nccl":
            assert r["vs_best_nccl"] == pytest.approx(1.0)


def test_cpu_smoke_run_writes_the_plot_and_replots_from_its_json(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, png = smoke
    assert png.exists() and png.stat().st_size > 1000
    again = tmp_path / "again.png"
    run_python(
        ["benchmarks/grad_return.py", "--from-json", str(png.with_suffix(".json")), "--png", str(again)]
    )
    assert again.exists() and again.stat().st_size > 1000


def test_without_matplotlib_the_script_skips_the_plot_and_succeeds(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    args = [*SMOKE[1:], "--sizes", "64K", "--op", "grad_return", "--json", str(js), "--png", str(png)]
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = {[script('benchmarks/grad_return.py'), *args]!r}; "
        f"runpy.run_path({script('benchmarks/grad_return.py')!r}, run_name='__main__')"
    )
    out = run_python(["-c", code])
    assert "skipped the plot" in out
    assert js.exists() and not png.exists()


# -- the report's arithmetic --------------------------------------------------------------------


def _row(transport, seconds, mode="bandwidth", size=1 << 20):
    return {
        "op": "grad_return",
        "mode": mode,
        "dtype": "bfloat16",
        "n": 4,
        "global_bytes_per_tensor": size,
        "tensors": 2,
        "transport": transport,
        "median_s": seconds,
    }


def test_busbw_and_ratios_against_the_faster_nccl_and_the_ceiling():
    rows = [
        _row("nccl", 4e-3),
        _row("nccl-symm", 5e-3),
        _row("peer-memop", 2e-3),
        _row("nccl", 1e-3, mode="latency"),
        _row("peer-memop", 4e-3, mode="latency"),
    ]
    bench.annotate(rows, {("grad_return", "bfloat16", 1 << 20): 1e-3})
    nccl, symm, peer, nccl_lat, peer_lat = rows
    # (R-1)/R * 2 tensors * 1 MiB / 2 ms
    assert peer["busbw_gbps"] == pytest.approx(0.75 * 2 * (1 << 20) / 2e-3 / 1e9)
    assert bench.busbw_gbps(1, 1 << 20, 2, 1e-3) == 0.0  # nothing crosses a link with R = 1
    assert peer["vs_best_nccl"] == pytest.approx(2.0)  # against nccl (4 ms), the faster of the two
    assert nccl["vs_best_nccl"] == pytest.approx(1.0) and symm["vs_best_nccl"] == pytest.approx(0.8)
    assert peer_lat["vs_best_nccl"] == pytest.approx(0.25)  # each mode against its own NCCL
    assert peer["of_ceiling"] == pytest.approx(0.5) and nccl_lat["of_ceiling"] == pytest.approx(1.0)
    assert peer["ceiling_s"] == 1e-3
    lonely = [_row("peer-memop", 1e-3, size=64 << 10)]  # no NCCL, no ceiling at this point
    bench.annotate(lonely, {})
    assert lonely[0]["vs_best_nccl"] is None and lonely[0]["of_ceiling"] is None


def test_points_keep_the_sequence_divisible_by_2n():
    p = bench.make_point(64 << 10, "bfloat16", 8)
    assert p.seq % 16 == 0 and p.global_bytes == 64 << 10 and p.local_bytes == 8 << 10
    tiny = bench.make_point(1, "float32", 4)
    assert tiny.seq == 8 and tiny.global_bytes == 8 * 1024 * 4


def test_transport_plan():
    names = lambda *a: [t.name for t in bench.plan_transports(*a)]
    assert names("gpu", False, True, ["device", "memop"]) == [
        "local",
        "nccl",
        "nccl-symm",
        "xla-recipe",
        "peer-device",
        "peer-memop",
    ]
    assert names("gpu", True, True, ["memop"]) == ["local", "peer-memop"]  # NCCL cannot share a GPU
    assert names("cpu", False, False, ["device"]) == ["local", "nccl", "xla-recipe"]
    symm = bench.plan_transports("gpu", False, False, ["memop"])[2]
    assert dict(symm.compiler_options) == {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True}


# -- the ceiling --------------------------------------------------------------------------------


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"bench_ext.{name} used although the ceiling must be refused first")


class _FakeWorkspace:
    slot_bytes = 1 << 20

    def __init__(self, targets):
        self.targets = targets

    def push_targets(self):
        return self.targets


def test_push_ceiling_refuses_targets_on_the_writers_own_gpu(monkeypatch):
    # One process, two CP ranks on one physical GPU (the bus id spelled two ways).
    ws = _FakeWorkspace(
        [
            (0, 0, "0000:18:00.0", [(0x7F0000, "00000000:18:00.0")]),
            (0, 1, "0000:18:00.0", [(0x7F1000, "0000:18:00.0")]),
        ]
    )
    with pytest.raises(ValueError, match="own GPU"):
        ceiling.push_ceiling(ws, 1 << 20, 5, 3, bench=_Untouchable(), sync=lambda name: None)
    monkeypatch.setattr(ceiling, "load_bench", lambda: _Untouchable().load_bench())  # nor look for one
    with pytest.raises(ValueError, match="own GPU"):
        ceiling.push_ceiling(ws, 1 << 20, 5, 3, sync=lambda name: None)
    with pytest.raises(ValueError, match="own GPU"):
        ceiling.ceilings(ws, ["grad_return"], 2, 1 << 19, 2, 5, 3, sync=lambda name: None)


class _FakeBench:
    def __init__(self):
        self.calls = []

    def push_bandwidth(self, members, bytes_per_peer, iters, reps, engine):
        self.calls.append(("push", members, bytes_per_peer, engine))
        ms = {"sm": 2.0, "ce": 1.5}[engine]
        return {"median_ms": ms, "min_ms": ms - 0.1, "max_ms": ms + 0.1}

    def copy_bench(self, src, dst, nbytes, iters, reps):
        self.calls.append(("copy", src, dst, nbytes))
        return {"median_ms": nbytes / 1e9, "min_ms": nbytes / 1e9, "max_ms": nbytes / 1e9}


def _two_gpus():
    return _FakeWorkspace(
        [
            (0, 0, "0000:18:00.0", [(0x1000, "0000:2A:00.0")]),
            (1, 1, "0000:2a:00.0", [(0x2000, "0000:18:00.0")]),
        ]
    )


def test_push_ceiling_measures_both_engines_together_and_keeps_the_faster():
    fake, syncs = _FakeBench(), []
    got = ceiling.push_ceiling(_two_gpus(), 1 << 20, 5, 3, bench=fake, sync=syncs.append)
    assert [c[3] for c in fake.calls] == ["sm", "ce"]
    assert fake.calls[0][1] == [(0, [0x1000]), (1, [0x2000])]  # every local GPU at once
    assert len(syncs) == 2 and len(set(syncs)) == 2  # a fresh barrier before each engine
    assert got["engine"] == "ce" and got["median_s"] == pytest.approx(1.5e-3)
    assert got["engines"]["sm"]["median_s"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="slot"):
        ceiling.push_ceiling(_two_gpus(), 2 << 20, 5, 3, bench=_Untouchable(), sync=syncs.append)


def test_ceiling_adds_the_local_traffic_as_a_device_copy():
    fake = _FakeBench()
    n, local, tensors = 2, 1 << 18, 2
    got = ceiling.ceilings(
        _two_gpus(),
        ["grad_return", "all_gather"],
        n,
        local,
        tensors,
        5,
        3,
        bench=fake,
        sync=lambda name: None,
    )
    assert fake.calls[0][2] == tensors * local  # each peer gets this rank's part of both tensors
    copies = {c[3] for c in fake.calls if c[0] == "copy"}
    assert copies == {(n + 1) * local * tensors // 2, n * local * tensors}
    for op, nbytes in (("grad_return", (n + 1) * local * tensors // 2), ("all_gather", n * local * tensors)):
        assert got[op]["push_s"] == pytest.approx(1.5e-3)
        assert got[op]["local_copy"]["bytes"] == nbytes
        assert got[op]["total_s"] == pytest.approx(1.5e-3 + nbytes / 1e12)


# -- the GPU-only paths, as far as the CPU can trace them ---------------------------------------


def _cpu_mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("cp",))


@pytest.mark.parametrize("op_name", ["grad_return", "all_gather"])
def test_peer_bodies_trace_to_one_custom_call_per_call(op_name):
    mesh, n, calls = _cpu_mesh(4), 4, 3
    op, point = bench.OPS[op_name], bench.make_point(64 << 10, "float32", n)
    ws = workspace_spec(n, nbytes=bench.TENSORS * point.local_bytes)
    body = bench.Transport("peer-memop", "peer", "", "memop").body(op, ws)
    pair = bench.make_pairs(mesh, op, n, point, 1)[0]
    target = f"@jax_cpgrad_{op_name}("
    chain = bench.latency_fn(body, calls)
    text = bench.jitted(mesh, chain).trace(pair).lower(lowering_platforms=("cuda",)).as_text()
    # the chain's barriers between calls, and each call's own on its operands (no slices)
    assert text.count(target) == calls and text.count("stablehlo.optimization_barrier") == 2 * calls - 1
    loop = bench.bandwidth_fn(body, 4)
    text = bench.jitted(mesh, loop).trace(pair).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(target) == 1 and "stablehlo.while" in text


def test_latency_chain_keeps_every_collective_and_the_symmetric_option_compiles():
    mesh, n, calls = _cpu_mesh(4), 4, 3
    op, point = bench.OPS["grad_return"], bench.make_point(64 << 10, "float32", n)
    body = bench.Transport("nccl", "bare", "").body(op, None)
    pair = bench.make_pairs(mesh, op, n, point, 1)[0]
    chain = bench.latency_fn(body, calls)
    text = bench.jitted(mesh, chain).trace(pair).lower().as_text()
    assert text.count("stablehlo.reduce_scatter") == bench.TENSORS * calls
    # The option name must exist in this jaxlib's DebugOptions (an unknown one raises here).
    compiled = bench.compile_fn(mesh, chain, (pair,), tuple(bench.SYMM_OPTIONS.items()))
    out = np.asarray(jax.block_until_ready(compiled(pair)))
    # One scalar per rank: the first element of each call's outputs, summed. Tensor t is filled
    # with t + 1 on every rank, so its reduce-scatter's elements are n (t + 1).
    per_call = n * sum(t + 1 for t in range(bench.TENSORS))
    assert out.shape == (n,) and (out == calls * per_call).all()


def test_a_workspace_that_cannot_be_created_is_skipped_not_fatal():
    b = bench.setup(bench.parse_args(["--cpu"]))
    peer = bench.Transport("peer-device", "peer", "", "device")
    assert bench.open_workspace(b, peer, bench.make_point(1 << 20, "float32", b.n)) is None
    assert "peer-device" in b.skipped and b.notes


class _FakeGpuWorkspace:
    """Workspace(protocol="memop") on two GPUs; protocol "device" fails as an older Workspace would."""

    closed = []

    def __init__(self, mesh, axis_name, *, nbytes, name, timeout_s, protocol):
        if protocol == "device":
            raise TypeError("Workspace.__init__() got an unexpected keyword argument 'protocol'")
        self.protocol, self.slot_bytes = protocol, nbytes
        self.targets = _two_gpus().targets

    def push_targets(self):
        return self.targets

    def close(self):
        _FakeGpuWorkspace.closed.append(self)


def test_gpu_bookkeeping_with_a_fake_workspace_and_bench(monkeypatch, tmp_path, capsys):
    """The GPU-only bookkeeping (skips, ceilings, ratios, tables, outputs), timings faked."""
    js, png = tmp_path / "g.json", tmp_path / "g.png"
    opts = bench.parse_args(
        ["--sizes", "64K", "4M", "--dtypes", "bfloat16", "--json", str(js), "--png", str(png)]
    )
    b = bench.setup(opts)
    b.backend, b.ceiling_off = "gpu", None
    b.transports = bench.plan_transports("gpu", False, True, ["device", "memop"])
    seconds = {"local": 1e-5, "nccl": 4e-5, "xla-recipe": 5e-5, "peer-memop": 2e-5}

    def fake_measure(b_, op, mode, transport, ws, point):
        if transport.name == "nccl-symm":
            raise RuntimeError("INVALID_ARGUMENT: No such compile option")
        assert (ws is not None) == (transport.kind == "peer")
        return {
            "op": op.name,
            "mode": mode,
            "transport": transport.name,
            "backend": "gpu",
            "dtype": point.dtype,
            "n": b_.n,
            "global_bytes_per_tensor": point.global_bytes,
            "tensors": 2,
            "calls_per_run": 1,
            "median_s": seconds[transport.name],
            "min_s": 1e-6,
            "max_s": 1e-4,
        }

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench.cpg, "Workspace", _FakeGpuWorkspace)
    monkeypatch.setattr(ceiling, "load_bench", lambda: (_FakeBench(), None))
    rows, ceils = bench.run(b)
    assert set(b.skipped) == {"nccl-symm", "peer-device"}
    assert {r["transport"] for r in rows} == {"local", "nccl", "xla-recipe", "peer-memop"}
    assert len(_FakeGpuWorkspace.closed) == 2  # one workspace per point, closed
    assert {(c["op"], c["global_bytes_per_tensor"]) for c in ceils} == {
        (op, size) for op in ("grad_return", "all_gather") for size in (64 << 10, 4 << 20)
    }
    peer = next(r for r in rows if r["transport"] == "peer-memop" and r["op"] == "all_gather")
    assert peer["vs_best_nccl"] == pytest.approx(2.0)
    assert peer["of_ceiling"] == pytest.approx(peer["ceiling_s"] / 2e-5)
    bench.print_tables(b, rows, ceils)
    bench.write_json(str(js), bench.metadata(b), rows, ceils)
    out = capsys.readouterr().out
    assert "ceiling(ce)" in out and "peer-memop" in out
    data = json.loads(js.read_text())
    assert data["ceiling"] == "measured" and data["peer_protocols"] == {"peer-memop": "memop"}
    assert data["ceilings"][0]["push"]["engines"].keys() == {"sm", "ce"}
    if bench.write_png(str(png), bench.metadata(b), rows, ceils):
        assert png.stat().st_size > 1000


def test_workspace_names_give_the_workspace_keywords():
    from workspace_options import workspace_options

    assert workspace_options("device") == {"protocol": "device"}
    assert workspace_options("device:32:0.5+overlap") == {
        "protocol": "device",
        "sm_budget": 32,
        "push_share": 0.5,
        "overlap": True,
    }
    for bad in ("device+fast", "nccl", "device:1:2:3"):
        with pytest.raises(ValueError):
            workspace_options(bad)


def test_step_profile_splits_communication_into_hidden_and_exposed():
    import step_profile

    streams = {  # ns; two steps
        "Stream #1": [("fusion_1", 0, 100), ("cutlass_gemm", 150, 400), ("MemcpyD2D", 400, 420)],
        "Stream #7": [
            ("void jax_cpgrad::fused_grad_return<float>", 50, 200),
            ("ncclDevKernel_AllReduce_Sum_bf16", 380, 500),
            ("ncclDevKernel_ReduceScatter_Sum_bf16", 600, 700),
            ("ncclDevKernel_SendRecv", 700, 710),
        ],
    }
    got = step_profile.summarize_gpu(streams, steps=2)
    per_step = lambda ns: ns / 1e6 / 2
    # peer [50,200]: compute covers [50,100] and [150,200]; the all-reduce [380,500]: [380,400].
    assert got["peer"]["ms"] == per_step(150) and got["peer"]["exposed_ms"] == per_step(50)
    assert got["nccl_params"]["ms"] == per_step(120)
    assert got["nccl_params"]["exposed_ms"] == per_step(100)
    assert got["nccl_cp"]["exposed_ms"] == per_step(100)
    assert got["nccl_other"]["ms"] == per_step(10) and got["copies"]["ms"] == per_step(20)
    assert got["compute_ms"] == per_step(350) and got["compute_streams"] == ["Stream #1"]
    assert got["idle_ms"] == per_step(100)  # [500,600]
    assert got["peer"]["streams"] == ["Stream #7"] and got["peer"]["kernels_per_step"] == 0.5
    assert step_profile.kind_of("void jax_cpgrad::ll_all_gather<true>") == "peer"  # the LL words


def test_step_profile_totals_each_kernel_per_run():
    import step_profile

    events = [("gemm", 0, 4000), ("sort", 4000, 5000), ("gemm", 6000, 8000), ("gemm", 9000, 9500)]
    got = step_profile.per_kernel(events, steps=2)
    assert got == {"gemm": (3.25, 3), "sort": (0.5, 1)}  # us per run: (4 + 2 + 0.5) / 2, 1 / 2


def test_the_head_start_survives_compilation():
    """Its matmuls feed the returned scalar: XLA may not compile them away (it did when they only
    fed an unused output of the optimization barrier)."""
    mesh, n = _cpu_mesh(4), 4
    op, point = bench.OPS["grad_return"], bench.make_point(64 << 10, "float32", n)
    body = bench.Transport("nccl", "bare", "").body(op, None)
    pair = bench.make_pairs(mesh, op, n, point, 1)[0]
    text = bench.compile_fn(mesh, bench.latency_fn(body, 2, head_start=2), (pair,)).as_text()
    assert text.count(" dot(") >= 2, [line for line in text.splitlines() if "dot" in line or "matmul" in line]
