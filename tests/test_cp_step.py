"""benchmarks/cp_step.py on the CPU: its startup check of the attention layer works, the CP
step (the package's transformer layers, jax_cpgrad.models) equals the unsharded model, per-layer
attention options reach the layer, the cuDNN/peer step lowers for CUDA, and the script runs.

Tolerances (float32 on the CPU): the CP step's loss within 3e-6 relative (observed <= 1.1e-6: the
ranks' partial sums and the split attention add in another order than the reference) and its
gradients (parameters, and dK/dV of every layer) within 2e-5 of the largest reference magnitude
(observed <= 7e-7); the layer check within 1e-5.
"""

import dataclasses
import json
import os
import pathlib
import re
import sys
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from run_python import run_python
from workspace_stub import workspace_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cp_step as cs  # noqa: E402

from jax_cpgrad.attention import kernels as attention_kernels  # noqa: E402

XLA_KV_COLLECTIVES = re.compile(r"stablehlo\.(all_gather|reduce_scatter|all_to_all|collective_permute)")

# A model small enough for the CPU: 1 layer, hidden 32, 4 heads, 2 KV heads, 2 timed steps.
TOY_MODEL = [
    "--hidden",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--layers",
    "1",
    "--steps",
    "2",
    "--warmup",
    "1",
]


def _mesh(n):
    return Mesh(np.array(jax.devices("cpu")[:n]), ("cp",))


def _config(**fields):
    base = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, seq=64, dtype="float32")
    return cs.model_config(**{**base, **fields})


# -- the startup check of the layer -------------------------------------------------------------


def test_the_layer_check_passes_on_the_layer_and_catches_a_wrong_one(monkeypatch):
    mesh, cfg = _mesh(4), _config(kv_heads=1)
    assert max(cs.check_layer(mesh, cfg, chunk=8).values()) < 1e-5
    layer = cs.cp_attention  # the layer as the benchmark calls it
    monkeypatch.setattr(cs, "cp_attention", lambda *a, **kw: layer(*a, **kw, scale=0.1))
    assert min(cs.check_layer(mesh, cfg, chunk=8).values()) > 1e-2


# -- the CP step against the unsharded model ----------------------------------------------------


def _cp_vs_reference(cfg, n, transport="xla"):
    rng = np.random.default_rng(1)
    params = cs.init_params_numpy(cfg, seed=3)
    x = rng.standard_normal((cfg.batch, cfg.seq_len, cfg.d_model)).astype(np.float32)
    zeros = [(np.zeros(cfg.local_kv(1).shape, np.float32),) * 2 for _ in range(cfg.layers)]
    ref_loss, (ref_g, ref_pg) = cs.reference_loss_and_grads(params, x, zeros, cfg)

    mesh = _mesh(n)
    probes = [tuple(cs.place(mesh, z, P(None, "cp")) for z in layer) for layer in zeros]
    step = cs.make_step(cfg, mesh, transport)
    loss, grads, probe_grads = step(
        jax.tree.map(lambda a: cs.place(mesh, a, P()), params), cs.to_cp(mesh, x, cfg.dtype), probes
    )
    dkdv = jax.tree.map(lambda a: cs.from_cp(a, n), probe_grads)
    return (float(ref_loss), ref_g, ref_pg), (float(loss), jax.tree.map(np.asarray, grads), dkdv)


def _max_rel(got, ref):
    flat = lambda tree: np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])
    g, r = flat(got), flat(ref)
    return float(np.max(np.abs(g - r)) / np.max(np.abs(r)))


@pytest.mark.parametrize("ranks,kv_heads,head_groups", [(4, 4, 1), (4, 2, 1), (2, 1, 1), (4, 4, 2)])
def test_cp_step_matches_the_unsharded_float32_model(ranks, kv_heads, head_groups):
    """head_groups 2: --head-groups, the layer's transfer pipelined over two groups of heads."""
    cfg = _config(kv_heads=kv_heads, batch=2, head_groups=head_groups)
    (ref_loss, ref_g, ref_pg), (loss, grads, dkdv) = _cp_vs_reference(cfg, ranks)
    assert abs(loss - ref_loss) <= 3e-6 * abs(ref_loss), (loss, ref_loss)
    assert _max_rel(grads, ref_g) < 2e-5
    assert _max_rel(dkdv, ref_pg) < 2e-5  # dK/dV of every layer as the owners get them


def test_the_none_transport_computes_the_same_shapes_without_kv_communication():
    cfg = _config()
    (ref_loss, _, _), (loss, _, _) = _cp_vs_reference(cfg, n=4, transport="none")
    assert np.isfinite(loss) and loss != ref_loss  # every rank attends to copies of its own K/V
    mesh = _mesh(4)
    args = (cs.init_params_device(mesh, cfg, 0), cs.random_hidden(mesh, cfg, 0), [])
    text = cs.make_step(cfg, mesh, "none").trace(*args).lower().as_text()
    assert not XLA_KV_COLLECTIVES.search(text) and "stablehlo.all_reduce" in text  # only the gradient psum
    text = cs.make_step(cfg, mesh, "xla").trace(*args).lower().as_text()
    assert XLA_KV_COLLECTIVES.search(text)


def test_each_layer_gets_its_own_attention_options(monkeypatch):
    """--local-window-size 16 none: sliding-window and global layers, cycled; each layer's options
    reach the CP layer (recorded here and removed, so this runs before the layer takes them)."""
    opts = cs._parse(["--layers", "3", "--local-window-size", "16", "none", "--hidden", "32", "--heads", "4"])
    (cfg,) = cs.configs(opts, on_gpu=False)
    assert [cfg.attention_options(i) for i in range(3)] == [
        {"local_window_size": 16},
        {},
        {"local_window_size": 16},
    ]
    assert cs.label(cfg).endswith("win=16/g") and cs.model_config(**cs.describe(cfg)) == cfg
    seen, layer = [], cs.cp_attention

    def recording(q, k, v, **kw):
        seen.append(kw.pop("local_window_size", None))
        return layer(q, k, v, **kw)

    monkeypatch.setattr(cs, "cp_attention", recording)
    cfg = dataclasses.replace(_config(layers=3), layer_attention=cfg.layer_attention)
    mesh = _mesh(2)
    args = (cs.init_params_device(mesh, cfg, 0), cs.random_hidden(mesh, cfg, 0), [])
    cs.make_step(cfg, mesh, "xla").trace(*args)
    assert seen == [16, None, 16]
    with pytest.raises(SystemExit):
        cs.layer_attention(["-3"])


def test_on_gpus_a_window_layer_takes_the_layers_own_kernel_choice():
    """cuDNN takes no windows: with a window layer a GPU run defaults to "auto" (the layer's
    implementation=None), else to cudnn; "auto" reaches the layer as None."""
    common = ["--hidden", "32", "--heads", "4", "--dtype", "bfloat16"]
    (windowed,) = cs.configs(cs._parse(["--local-window-size", "16", "none", *common]), on_gpu=True)
    (plain,) = cs.configs(cs._parse(common), on_gpu=True)
    assert (windowed.implementation, plain.implementation) == ("auto", "cudnn")
    assert cs.layer_implementation(windowed) is None and cs.layer_implementation(plain) == "cudnn"


# -- the GPU paths, lowered for CUDA on the CPU ------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_the_cudnn_peer_step_lowers_for_cuda(overlap, monkeypatch):
    monkeypatch.setattr(attention_kernels.cudnn, "max_head_dim", lambda: 256)  # traced as on an H200
    n = 2
    cfg = _config(
        hidden=256,
        heads=2,
        kv_heads=1,
        head_dim=128,
        ffn=512,
        seq=512,
        dtype="bfloat16",
        implementation="cudnn",
    )
    mesh = _mesh(n)
    ws = workspace_spec(n, nbytes=cs.workspace_nbytes(cfg, n), overlap=overlap)
    args = (cs.init_params_device(mesh, cfg, 0), cs.random_hidden(mesh, cfg, 0), [])
    text = cs.make_step(cfg, mesh, "peer", ws).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = Counter(re.findall(r"custom_call @([\w$]+)\(", text))
    # Per layer: K/V gathered forward, dK/dV returned backward (start/done pairs with overlap);
    # the local part and the remote part's two calls (paired and far) each way.
    suffix = "_start" if overlap else ""
    assert (
        calls[f"jax_cpgrad_all_gather{suffix}"] == calls[f"jax_cpgrad_grad_return{suffix}"] == cfg.layers
    ), calls
    assert calls["jax_cpgrad_done"] == (2 * cfg.layers if overlap else 0), calls
    assert calls["__cudnn$fmhaSoftmax"] == calls["__cudnn$fmhaSoftmaxBackward"] == 3 * cfg.layers, calls
    # No XLA collective moves K/V; the parameter-gradient psum is the only one.
    assert not XLA_KV_COLLECTIVES.search(text) and "stablehlo.all_reduce" in text


# -- the script --------------------------------------------------------------------------------


def _run(args, timeout=300):
    return run_python(["benchmarks/cp_step.py", *args], timeout)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("cp_step")
    js, png = out_dir / "s.json", out_dir / "s.png"
    stdout = _run(
        [
            "--cpu",
            "--transport",
            "xla",
            "none",
            "--seq",
            "64",
            "128",
            *TOY_MODEL,
            "--profile-steps",
            "1",
            "--hlo",
            "--json",
            str(js),
            "--png",
            str(png),
        ]
    )
    return stdout, json.loads(js.read_text()), png


def test_the_script_times_each_config_and_transport_and_writes_json(smoke_run):
    stdout, data, _ = smoke_run
    assert data["n"] == 8 and data["processes"] == 1 and data["device_kind"] == "cpu"
    for key in ("command", "date", "host", "jax", "options", "transports", "env"):
        assert data[key], key
    rows = data["rows"]
    assert [(r["seq"], r["transport"]) for r in rows] == [
        (64, "none"),
        (64, "xla"),
        (128, "none"),
        (128, "xla"),
    ]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["tokens_per_s"] > 0
        assert r["kv_heads"] == 2 and r["implementation"] == "xla" and r["peak_bytes_in_use"] is None
        # A CPU trace has no GPU plane (or no trace at all): the profile says why, and the row
        # keeps its timing.
        assert set(r["profile"]) == {"error"}
    assert all(("comm_s" in r) == (r["transport"] == "xla") for r in rows)
    (check,) = data["attention_check"].values()  # once: one implementation, GQA only
    assert check["ok"] and max(check[k] for k in ("out", "dq", "dk", "dv")) < 0.05, check
    hlo = sorted(p.name for p in pathlib.Path(data["options"]["json"]).parent.glob("hlo_*.txt"))
    assert len(hlo) == len(rows) and all(
        "HloModule" in (pathlib.Path(data["options"]["json"]).parent / h).read_text() for h in hlo
    )
    lines = [line for line in stdout.splitlines() if line.startswith("S=64 ") or line.startswith("S=128 ")]
    assert len(lines) == 2 * len(rows)  # one line as each finishes, and the final table


def test_the_script_plots_step_times(smoke_run):
    pytest.importorskip("matplotlib")
    _, _, png = smoke_run
    assert png.exists() and png.stat().st_size > 1000


def test_the_time_budget_stops_starting_configs(tmp_path):
    js = tmp_path / "b.json"
    out = _run(
        [
            "--cpu",
            "--transport",
            "none",
            "--seq",
            "64",
            "128",
            "--hidden",
            "32",
            "--heads",
            "4",
            "--layers",
            "1",
            "--steps",
            "1",
            "--time-budget-s",
            "0",
            "--json",
            str(js),
            "--png",
            str(tmp_path / "b.png"),
        ]
    )
    data = json.loads(js.read_text())
    assert data["rows"] == [] and len(data["skipped_configs"]) == 2 and "time budget" in out


def test_at_n1_the_rows_time_the_transfer_path(tmp_path):
    js = tmp_path / "n1.json"
    args = ["--cpu", "--n", "1", "--transport", "xla", "--seq", "64", *TOY_MODEL, "--no-attention-check"]
    _run([*args, "--hlo", "--json", str(js), "--png", str(tmp_path / "n1.png")])
    data = json.loads(js.read_text())
    assert data["n"] == 1 and data["transfer_at_n1"] and "error" not in data["rows"][0]
    (hlo,) = tmp_path.glob("hlo_*.txt")
    assert "all-gather" in hlo.read_text()  # the layer alone would make one attention call


def test_the_precision_mode_measures_the_errors_of_a_bf16_step(tmp_path):
    js = tmp_path / "p.json"
    out = _run(
        [
            "--cpu",
            "--precision",
            "--n",
            "4",
            "--seq",
            "64",
            *TOY_MODEL,  # its --steps / --warmup do not apply to the precision mode
            "--json",
            str(js),
        ]
    )
    (row,) = json.loads(js.read_text())["rows"]
    assert row["transport"] == "xla" and row["dtype"] == "bfloat16" and "error" not in row, row.get("error")
    for q in ("dk", "dv", "grad_wk", "grad_wv", "grad_all_params"):
        assert 0 < row[q]["rel_rms"] < 3e-2, (q, row[q])  # bf16 computation vs float32
    assert "grad_all_params" in out and "dk_return" not in row


def test_the_script_runs_as_two_processes(tmp_path):
    # One CPU device per process (gloo between them): inputs built per process, the time-budget
    # decision shared, only process 0 writes.
    js = tmp_path / "m.json"
    stdout = run_python(
        [
            "-m",
            "jax_cpgrad.launch",
            "-n",
            "2",
            "--devices",
            "none",
            "--timeout",
            "240",
            "benchmarks/cp_step.py",
            "--cpu",
            "--transport",
            "xla",
            "none",
            "--seq",
            "64",
            *TOY_MODEL,
            "--time-budget-s",
            "600",
            "--json",
            str(js),
            "--png",
            str(tmp_path / "m.png"),
        ]
    )
    data = json.loads(js.read_text())
    assert data["processes"] == 2 and data["n"] == 2
    assert [r["transport"] for r in data["rows"]] == ["none", "xla"] and all(
        "median_s" in r for r in data["rows"]
    )
    assert "[rank 1] S=64" not in stdout  # only process 0 reports


def test_a_workspace_name_with_a_typo_stops_the_run_before_it_starts():
    with pytest.raises(SystemExit):
        cs._parse(["--protocol", "device+overlapp"])
    assert cs._parse(["--protocol", "device:32:0.5+overlap"]).protocol == ["device:32:0.5+overlap"]
