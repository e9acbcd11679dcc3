"""What a CP rank's attention would cost with cuDNN's causal mask aligned bottom-right: each query
chunk in ONE call over its whole key prefix, its diagonal block included (jax's binds align the
mask top-left only, so the layer needs a separate causal call for the diagonal blocks and a merge).

Rank r of N (chunks r and 2N-1-r of c tokens): call A is chunk r against keys [0, (r+1)c), call B
chunk 2N-1-r against [0, (2N-r)c), both causal bottom-right; their key gradients are summed in
float32 over A's keys, as a rank would before returning them. The prefixes are passed as
separate inputs (a handler would take a pointer into the gathered keys: no copy). Beside them,
in the same run: the layer's rank alone (``rank_without_transfer``) and the unsharded causal
cuDNN call; ratios N x t_rank / t_unsharded (ideal 1.00), the slowest of ranks 0, N/2, N-1.

The calls go through ``cudnn_bottom_right.cc`` (the cuDNN frontend, as XLA FFI handlers), a probe
built outside the package: pass its library with --lib, or --build to compile it with g++ (needs
the cuDNN frontend's headers, cuDNN's and nvrtc's: --include DIR, repeatable). First the calls
are checked against a float32 XLA reference (output, log-sum-exp and gradients).

    python benchmarks/sweeps/cudnn_bottom_right.py --lib /tmp/br.so --seq 16k 32k --kv-heads 8 32
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention import fwd_bwd, human_tokens, inputs, parse_tokens, seconds  # noqa: E402

from jax_cpgrad.attention import rank_without_transfer  # noqa: E402

F32 = jnp.float32
HERE = os.path.dirname(os.path.abspath(__file__))


def build(out: str, includes: list[str]) -> str:
    flags = ["-std=c++17", "-O2", "-shared", "-fPIC", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"]
    dirs = [*includes, "/usr/local/cuda/include", jax.ffi.include_dir()]
    cmd = [
        "g++",
        *flags,
        *(f"-I{d}" for d in dirs),
        os.path.join(HERE, "cudnn_bottom_right.cc"),
        "-o",
        out,
        "-ldl",
    ]
    subprocess.run(cmd, check=True)
    return out


def load(lib_path: str) -> None:
    # cuDNN as jax loaded it: run one cuDNN attention call, then find the library in the maps.
    x = jnp.ones((1, 128, 1, 64), jnp.bfloat16)
    jax.block_until_ready(jax.nn.dot_product_attention(x, x, x, implementation="cudnn"))
    maps = open("/proc/self/maps").read().split()
    found = [p for p in maps if "libcudnn_graph.so" in p] or [p for p in maps if "/libcudnn.so" in p]
    if not found:
        raise SystemExit("cuDNN is not loaded in this process")
    lib = ctypes.cdll.LoadLibrary(lib_path)
    if lib.init_cudnn(found[0].encode()) != 0:
        raise SystemExit(f"could not dlopen {found[0]}")
    print(f"cuDNN from {found[0]}", flush=True)
    for name in ("BottomRightForward", "BottomRightBackward"):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")


NO_MASK, TOP_LEFT, BOTTOM_RIGHT, SHIFTED_BAND = 0, 1, 2, 3  # the handlers' "mask" attribute


def _fwd(q, k, v, scale, mask=BOTTOM_RIGHT):
    b, t, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), F32))
    return jax.ffi.ffi_call("BottomRightForward", shapes)(
        q, k, v, scale=np.float32(scale), mask=np.int64(mask)
    )


def _bwd(q, k, v, o, lse, do, scale, mask=BOTTOM_RIGHT):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return jax.ffi.ffi_call("BottomRightBackward", shapes)(
        q, k, v, o, lse, do, scale=np.float32(scale), mask=np.int64(mask)
    )


def attention(mask: int):
    """The probe's differentiable attention with ``mask``."""

    @jax.custom_vjp
    def attend(q, k, v):
        return _fwd(q, k, v, q.shape[-1] ** -0.5, mask)[0]

    def attend_fwd(q, k, v):
        o, lse = _fwd(q, k, v, q.shape[-1] ** -0.5, mask)
        return o, (q, k, v, o, lse)

    def attend_bwd(res, do):
        q, k, v, o, lse = res
        return _bwd(q, k, v, o, lse, do.astype(q.dtype), q.shape[-1] ** -0.5, mask)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


attend = attention(BOTTOM_RIGHT)


def diagnose(seq: int, kv_heads: int, opts) -> None:
    """The whole causal sequence: jax's cuDNN call against the probe's (top-left, bottom-right),
    fwd+bwd and forward alone, with each one's longest kernels."""
    import step_profile

    full = inputs(seq, opts.heads, kv_heads, 128)
    jax_cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    for name, f in (
        ("jax cuDNN", jax_cudnn),
        ("probe top-left", attention(TOP_LEFT)),
        ("probe bottom-right", attend),
    ):
        step = fwd_bwd(f)
        fwd = jax.jit(f)
        t = seconds(step, full, opts.iters, opts.reps)
        t_fwd = seconds(fwd, full[:3], opts.iters, opts.reps)
        print(
            f"S={human_tokens(seq)} KV {kv_heads} {name}: fwd+bwd {t * 1e3:.3f} ms, fwd {t_fwd * 1e3:.3f} ms",
            flush=True,
        )
        for kernel, us, launches in step_profile.top_kernels(step, full, steps=2, count=4):
            print(f"      {us:9.1f} us  x{launches:<3d} {kernel[:110]}", flush=True)
    # A rank's far chunk: 1k queries against 8k keys, its diagonal block last.
    q, k, v = (x[:, :8192] for x in full[:3])
    q = q[:, -1024:]
    for name, mask in (("no mask", NO_MASK), ("bottom-right", BOTTOM_RIGHT), ("shifted band", SHIFTED_BAND)):
        step = fwd_bwd(attention(mask))
        args = (q, k, v, full[3][:, :1024])
        try:
            t = seconds(step, args, opts.iters, opts.reps)
        except Exception as e:  # noqa: BLE001 (a mask this cuDNN refuses: say so, go on)
            print(f"Tq=1k Tk=8k {name}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        print(f"Tq=1k Tk=8k {name}: fwd+bwd {t * 1e3:.3f} ms", flush=True)
        for kernel, us, launches in step_profile.top_kernels(step, args, steps=2, count=2):
            print(f"      {us:9.1f} us  x{launches:<3d} {kernel[:110]}", flush=True)


def reference(q, k, v):
    """float32 attention, query i of Tq seeing keys 0..Tk-Tq+i; (out, lse [B, H, Tq])."""
    b, tq, h, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    qg = q.astype(F32).reshape(b, tq, hk, h // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(F32)) * d**-0.5
    mask = jnp.arange(tk)[None, :] <= jnp.arange(tq)[:, None] + (tk - tq)
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", jnp.exp(s - lse[..., None]), v.astype(F32))
    return o.reshape(b, tq, h, d), lse.reshape(b, h, tq)


def check() -> dict:
    """The probe's calls against the float32 reference: worst relative errors."""
    key = jax.random.key(1)
    errors = {}
    for tq, tk, h, hk in ((256, 768, 4, 2), (512, 512, 4, 4), (128, 1024, 8, 1)):
        kq, kk, kv, kd = jax.random.split(jax.random.fold_in(key, tk), 4)
        q = jax.random.normal(kq, (1, tq, h, 128), jnp.bfloat16)
        k = jax.random.normal(kk, (1, tk, hk, 128), jnp.bfloat16)
        v = jax.random.normal(kv, (1, tk, hk, 128), jnp.bfloat16)
        do = jax.random.normal(kd, (1, tq, h, 128), jnp.bfloat16)
        o, lse = jax.jit(lambda q, k, v: _fwd(q, k, v, 128**-0.5))(q, k, v)
        o_ref, lse_ref = reference(q, k, v)
        grads = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))(q, k, v, do)
        grads_ref = jax.vjp(lambda q, k, v: reference(q, k, v)[0], q, k, v)[1](do.astype(F32))
        rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(F32) - b)) / jnp.max(jnp.abs(b)))
        case = f"Tq={tq} Tk={tk} H={h} Hk={hk}"
        errors[case] = dict(
            out=rel(o, o_ref),
            lse=float(jnp.max(jnp.abs(lse - lse_ref))),
            **{name: rel(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True)},
        )
        print(f"check {case}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors[case].items()), flush=True)
    return errors


def rank_step():
    """jit(qa, qb, ka, va, kb, vb, doa, dob) -> the rank's dq (both chunks), dk and dv over B's keys."""

    def step(qa, qb, ka, va, kb, vb, doa, dob):
        _, vjp_a = jax.vjp(attend, qa, ka, va)
        _, vjp_b = jax.vjp(attend, qb, kb, vb)
        dqa, dka, dva = vjp_a(doa)
        dqb, dkb, dvb = vjp_b(dob)
        n_a = ka.shape[1]

        def total(ga, gb):  # float32 over A's keys, rounded once
            head = (ga.astype(F32) + gb[:, :n_a].astype(F32)).astype(gb.dtype)
            return jnp.concatenate([head, gb[:, n_a:]], axis=1)

        return dqa, dqb, total(dka, dkb), total(dva, dvb)

    return jax.jit(step)


def measure(seq: int, kv_heads: int, ns: list[int], opts) -> list[dict]:
    full = inputs(seq, opts.heads, kv_heads, 128)
    unsharded = fwd_bwd(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    )
    ours_whole = fwd_bwd(attend)
    t_full = seconds(unsharded, full, opts.iters, opts.reps)
    t_ours_whole = seconds(ours_whole, full, opts.iters, opts.reps)
    print(
        f"S={human_tokens(seq)} KV {kv_heads}: unsharded jax cuDNN {t_full * 1e3:.3f} ms, "
        f"the probe's call on the whole sequence {t_ours_whole * 1e3:.3f} ms",
        flush=True,
    )
    q, k, v, ct = full
    step = rank_step()
    rows = []
    for n in ns:
        c = seq // (2 * n)
        if c < 512:
            continue
        layer = fwd_bwd(
            lambda q, k, v, rank, n=n: rank_without_transfer(q, k, v, rank, n, implementation="cudnn")
        )
        t_br, t_layer = {}, {}
        for r in sorted({0, n // 2, n - 1}):
            a, b = slice(r * c, (r + 1) * c), slice((2 * n - 1 - r) * c, (2 * n - r) * c)
            args = (q[:, a], q[:, b], k[:, : (r + 1) * c], v[:, : (r + 1) * c], k[:, : (2 * n - r) * c],
                    v[:, : (2 * n - r) * c], ct[:, a], ct[:, b])  # fmt: skip
            t_br[r] = seconds(step, args, opts.iters, opts.reps)
            local = tuple(jnp.concatenate([x[:, a], x[:, b]], axis=1) for x in full)
            t_layer[r] = seconds(layer, (*local, jnp.int32(r)), opts.iters, opts.reps)
        row = dict(
            seq=seq, kv_heads=kv_heads, n=n, chunk=c, t_unsharded_ms=t_full * 1e3,
            t_probe_whole_ms=t_ours_whole * 1e3,
            bottom_right_ms={str(r): t * 1e3 for r, t in t_br.items()},
            layer_ms={str(r): t * 1e3 for r, t in t_layer.items()},
            ratio_bottom_right=n * max(t_br.values()) / t_full,
            ratio_layer=n * max(t_layer.values()) / t_full,
        )  # fmt: skip
        print(
            f"  N={n} chunk {human_tokens(c)}: bottom-right calls {row['ratio_bottom_right']:.3f} "
            f"({', '.join(f'{r}: {t * 1e3:.3f}' for r, t in t_br.items())} ms), "
            f"the layer {row['ratio_layer']:.3f} "
            f"({', '.join(f'{r}: {t * 1e3:.3f}' for r, t in t_layer.items())} ms)",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default="/tmp/cudnn_bottom_right.so")
    p.add_argument("--build", action="store_true")
    p.add_argument("--include", action="append", default=[])
    p.add_argument("--seq", nargs="+", default=["16k", "32k"])
    p.add_argument("--kv-heads", nargs="+", type=int, default=[8, 32])
    p.add_argument("--n", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--diagnose", action="store_true", help="only the whole-sequence comparison")
    opts = p.parse_args()
    if opts.build:
        build(opts.lib, [d for pattern in opts.include for d in glob.glob(pattern)])
    load(opts.lib)
    if opts.diagnose:
        for seq in map(parse_tokens, opts.seq):
            diagnose(seq, opts.kv_heads[0], opts)
        return 0
    result = dict(check=check(), rows=[], device=jax.devices()[0].device_kind, jax=jax.__version__)
    for seq in map(parse_tokens, opts.seq):
        for kv in opts.kv_heads:
            result["rows"] += measure(seq, kv, opts.n, opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
