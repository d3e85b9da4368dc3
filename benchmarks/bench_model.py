"""The headline benchmark: a jitted decoder step of a Llama-3-8B-shaped model, 4-bit vs bf16.

What a user sees (docs/benchmarks.md): the wall time of one jitted step of a decoder with
Llama-3-8B's shapes (hidden 4096; GQA attention with 32 query and 8 key/value heads of
128; SwiGLU MLP of 14336; RMSNorm, RoPE and residuals; `--model 70b`: Llama-3-70B's, hidden
8192, 64 query heads, MLP 28672), random weights, `--layers` of its 32 (80) layers and the
final RMSNorm. Each step takes M rows of activations: B = min(M, 64) sequences of T = M / B new
tokens that attend (causally among themselves) to a KV cache of `--context` tokens per
sequence (read every step; the cache update is not part of the step). The whole step is
one `jax.jit`; weights are bf16 for the baseline and `jax_fp4.nn.quantize_params(params,
fmt)` with its defaults for each 4-bit format; activations bf16.

Per (format, M), two wall times per step, each as a ratio to bf16 measured in the same
run and process (bf16 first at each M): the median of `--iters` steps each blocked on (the
host's dispatch and the wait for the result in every step, as a loop that reads each token
on the host sees it), and a decode loop (`--iters` steps back to back, each step's output
the next one's input, one block at the end: the host dispatches while the GPU works, as a
generate loop that samples on the device sees it; median of 3 loops). Beside them the GPU's
kernel time per step from the profiler's device trace (bench_quant.device_time) and the
decode loop's tokens/s. Prints a markdown table and appends it, with the command, GPU and
date, to RESULTS.md.

  python benchmarks/bench_model.py [--formats nvfp4 mxfp4 nf4 bnb_fp4 int4]
      [--ms 1 4 16 64 256 1024] [--model 8b|70b] [--layers 8] [--iters 30] [--tp 1 2] [--fsdp 2]
      [--no-kernel-sum] [--fused] [--group] [--scan] [--tiny]   (a small model for a CPU smoke run)

With `--fused` the layer stores its q / k / v kernels as one (hidden, (H + 2 G) D) kernel
and gate / up as one (hidden, 2 MLP) kernel, as vLLM's QKVParallelLinear /
MergedColumnParallelLinear and MaxText's fused_qkv / fused_mlp do: the same weights
(concatenated), the same step, 5 matmuls a layer instead of 7, for bf16 and 4-bit alike.

With `--group` each 4-bit format is measured a second time, in the same process, with
the step under `jax_fp4.group_matmuls` (column "<format>+group"): the model and its
parameters unchanged, q / k / v and gate / up each one W4A16 launch (the grouped call).

With `--scan` the layers' parameters are stacked (one array per parameter, as MaxText
and Flax's nn.scan store a model; the 4-bit ones by `quantize_params(..., stacked=True)`)
and the step runs them under `lax.scan`: the same model and step, with fewer arrays to
pass (8 layers, nvfp4: 27 instead of 202; one device). XLA then copies each layer's bf16
kernels out of the stack every step, where the W4A16 calls read their slice in place
(RESULTS.md table AJ).

With `--tp N` the step runs Megatron-style tensor parallel over N devices (q/k/v/gate/up
column-parallel, o/down row-parallel, the KV cache sharded by head), the QArray leaves
sharded by jax_fp4.sharding's specs. With `--fsdp N` the weights are stored sharded over
N devices (jax_fp4.sharding.fsdp_specs) and all-gathered inside the step before use
(gather_weights: a QArray as its packed codes and scales), the sequences of the batch
(and their KV cache) split over the devices where B divides (data parallel; else every
device runs the whole batch). Each of `--tp N [N ...]` and `--fsdp N [N ...]` is a
layout measured in the same run (`--tp 1 2`: one device, then two); every layout gets a
table and the compiled HLO's collectives per format, and with `--tp 1` among them a table
of each layout's speed-up over one device, per format and M. The kernel time of a
multi-device step is the mean over its devices.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4 as jf
import jax_fp4.nn  # noqa: F401  (quantize_params)
from jax_fp4 import sharding as jsh

FORMATS = ["nvfp4", "mxfp4", "nf4", "bnb_fp4", "int4"]


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    layers: int = 8
    context: int = 2048
    max_batch: int = 64  # sequences per step; M beyond it is several new tokens each

    def batch(self, m):
        """(sequences B, new tokens per sequence T) with B * T = M."""
        b = min(m, self.max_batch)
        if m % b:
            raise ValueError(f"M = {m} must be a multiple of min(M, {self.max_batch})")
        return b, m // b


# Llama-3-70B's layer shapes (`--model 70b`): tensor parallelism's test case, whose matmuls
# per device outweigh an all-reduce's latency where the 8B's do not
LLAMA3_70B = Config(hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672)
# The smoke-test model: GQA like Llama's, and every kernel's output at least 256 wide, so
# that tensor parallelism over 2 devices splits even the K / V projections into whole
# 128-row tiles of a prepared weight (narrower ones are gathered on GPUs)
TINY = Config(hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1024, layers=2, context=64,
              max_batch=4)

# Megatron tensor parallelism: which axis of each (in, out) kernel is split over "tp"
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


def init_params(cfg: Config, key):
    """Random bf16 weights (Flax layout: kernel (in, out)) scaled like a trained model's."""
    shapes = {"wq": (cfg.hidden, cfg.heads * cfg.head_dim),
              "wk": (cfg.hidden, cfg.kv_heads * cfg.head_dim),
              "wv": (cfg.hidden, cfg.kv_heads * cfg.head_dim),
              "wo": (cfg.heads * cfg.head_dim, cfg.hidden),
              "w_gate": (cfg.hidden, cfg.ffn), "w_up": (cfg.hidden, cfg.ffn),
              "w_down": (cfg.ffn, cfg.hidden)}
    layers = []
    for i in range(cfg.layers):
        ks = jax.random.split(jax.random.fold_in(key, i), len(shapes))
        layer = {name: {"kernel": (jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]))
                        .astype(jnp.bfloat16)}
                 for k, (name, s) in zip(ks, shapes.items())}
        layer["attn_norm"] = jnp.ones((cfg.hidden,), jnp.bfloat16)
        layer["mlp_norm"] = jnp.ones((cfg.hidden,), jnp.bfloat16)
        layers.append(layer)
    return {"layers": layers, "norm": jnp.ones((cfg.hidden,), jnp.bfloat16)}


# --fused: each fused kernel and the kernels it concatenates along the output features
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params):
    """The same model with each group of FUSED one kernel: params as init_params gives
    them; returns the tree with, per layer, "wqkv" (hidden, (H + 2 G) D) = [q | k | v] and
    "w_gate_up" (hidden, 2 MLP) = [gate | up] in place of their parts (bf16 kernels, the
    Flax (in, out) layout)."""
    def fuse(layer):
        parts = {n for names in FUSED.values() for n in names}
        out = {k: v for k, v in layer.items() if k not in parts}
        for name, names in FUSED.items():
            out[name] = {"kernel": jnp.concatenate([layer[n]["kernel"] for n in names], 1)}
        return out

    return {"layers": [fuse(layer) for layer in params["layers"]], "norm": params["norm"]}


def project(h, layer, fused, widths):
    """The projections FUSED[fused] of h (M, hidden), as a list of (M, width) arrays: one
    matmul and a split where the layer holds the fused kernel, else one matmul each."""
    if fused in layer:
        return jnp.split(dense(h, layer[fused]["kernel"]), np.cumsum(widths)[:-1].tolist(),
                         axis=-1)
    return [dense(h, layer[n]["kernel"]) for n in FUSED[fused]]


def tree_nbytes(tree):
    """Bytes of the arrays of a pytree (a QArray counts its codes, scales, zero points and
    tensor scale)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree))


def init_cache(cfg: Config, b, key):
    """Per layer a (k, v) pair, each (B, kv_heads, context, head_dim) bf16 (head-major, so
    that the attention's contractions read it in place; one array per layer, as a serving
    engine keeps it, so that no slice of a larger one is copied)."""
    shape = (b, cfg.kv_heads, cfg.context, cfg.head_dim)
    keys = jax.random.split(key, 2 * cfg.layers)
    return [(jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
             jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16)) for i in range(cfg.layers)]


def dense(x, w):
    """x (..., K) @ w (K, N): a QArray weight takes jax_fp4's W4A16 matmul."""
    return jf.matmul(x, w) if isinstance(w, jf.QArray) else jnp.dot(x, w)


def rms_norm(x, w, eps=1e-5):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x, pos, theta=500000.0):
    """Rotary position embedding (Llama 3's base) on (..., T, heads, head_dim)."""
    d = x.shape[-1]
    inv = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = pos[:, None] * inv[None, :]  # (T, d / 2)
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def attention(cfg: Config, q, k_new, v_new, k_cache, v_cache):
    """GQA over the cache and the new tokens (causal among the new ones), the cache read
    in place (no concatenated copy). q (B, T, H, D); k_new, v_new (B, T, G, D); caches
    (B, G, S, D). Returns (B, T, H * D).

    The softmax spans both parts through their common maximum and sum, as a split-KV
    (flash-decoding) attention merges its parts: concatenating the two score arrays
    instead lets XLA fuse the new tokens' scores and RoPE into the concatenation, a
    fusion slower than the cache's score GEMM (benchmarks/RESULTS.md, section W)."""
    b, t = q.shape[:2]
    g, r = cfg.kv_heads, cfg.heads // cfg.kv_heads
    q = q.reshape(b, t, g, r, cfg.head_dim)
    scale = 1.0 / np.sqrt(cfg.head_dim)
    # float32 scores and sums (XLA's CPU dot has no bf16 x bf16 -> float32: there, bf16)
    acc = None if jax.default_backend() == "cpu" else jnp.float32
    s_cache = jnp.einsum("btgrd,bgsd->bgrts", q, k_cache,
                         preferred_element_type=acc).astype(jnp.float32) * scale
    s_new = jnp.einsum("btgrd,bugd->bgrtu", q, k_new,
                       preferred_element_type=acc).astype(jnp.float32) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    s_new = jnp.where(causal, s_new, -jnp.inf)
    s_max = jnp.maximum(s_cache.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    e_cache, e_new = jnp.exp(s_cache - s_max), jnp.exp(s_new - s_max)
    total = e_cache.sum(-1, keepdims=True) + e_new.sum(-1, keepdims=True)
    o = (jnp.einsum("bgrts,bgsd->btgrd", (e_cache / total).astype(q.dtype), v_cache,
                    preferred_element_type=acc)
         + jnp.einsum("bgrtu,bugd->btgrd", (e_new / total).astype(q.dtype), v_new,
                      preferred_element_type=acc))
    return o.astype(q.dtype).reshape(b, t, cfg.heads * cfg.head_dim)


def stack_layers(params):
    """--scan: the model scanned over its layers, as MaxText and Flax's nn.scan store it:
    each parameter of the layers stacked on a leading axis (one array per parameter, not
    per layer)."""
    return {"layers": jax.tree.map(lambda *a: jnp.stack(a), *params["layers"]),
            "norm": params["norm"]}


def stack_cache(cache):
    """--scan: the KV cache as one (k, v) pair of (layers, B, kv_heads, context, head_dim)
    arrays."""
    return tuple(jnp.stack(c) for c in zip(*cache))


def decoder_layer(cfg: Config, x, layer, kv, b, t, pos):
    """One layer of the step on x (M, hidden); kv: its (k, v) cache."""
    h = rms_norm(x, layer["attn_norm"])
    qd, kd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    q, k, v = project(h, layer, "wqkv", (qd, kd, kd))
    q = q.reshape(b, t, cfg.heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.kv_heads, cfg.head_dim)
    o = attention(cfg, rope(q, pos), rope(k, pos), v, *kv)
    x = x + dense(o.reshape(b * t, -1), layer["wo"]["kernel"])
    h = rms_norm(x, layer["mlp_norm"])
    gate, up = project(h, layer, "w_gate_up", (cfg.ffn, cfg.ffn))
    return x + dense((jax.nn.silu(gate.astype(jnp.float32)) * up).astype(h.dtype),
                     layer["w_down"]["kernel"])


def step(cfg: Config, params, cache, x):
    """One decoder step: x (B, T, hidden) bf16 -> (B, T, hidden). The projections see the
    activations as (M = B * T, hidden) rows, as a serving engine batches them. Layers as a
    list run one after another; stacked (stack_layers) under ``lax.scan``."""
    b, t, hidden = x.shape
    x = x.reshape(b * t, hidden)
    pos = cfg.context + jnp.arange(t, dtype=jnp.float32)
    if isinstance(params["layers"], dict):
        x = jax.lax.scan(lambda x, lc: (decoder_layer(cfg, x, *lc, b, t, pos), None), x,
                         (params["layers"], cache))[0]
    else:
        for layer, kv in zip(params["layers"], cache):
            x = decoder_layer(cfg, x, layer, kv, b, t, pos)
    # Llama's final RMSNorm (before the LM head, not modelled): it also keeps a decode
    # loop that feeds each step's output back as x bounded
    return rms_norm(x, params["norm"]).reshape(b, t, hidden)


def quantized(params, fmt):
    """The 4-bit model a user gets: quantize_params with its defaults (stacked layers:
    each layer quantized on its own, ``stacked=True``)."""
    if fmt == "bf16":
        return params
    stacked = isinstance(params["layers"], dict)
    q = jax.jit(lambda p: jf.nn.quantize_params(p, fmt, stacked=stacked))(params)
    return jax.block_until_ready(q)


def fsdp_shardings(params, cache, x, mesh):
    """FSDP placements: each kernel sharded at rest along its output features over "fsdp"
    (a QArray as its packed leaves); the batch of sequences and its KV cache split over
    "fsdp" where B divides, else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P


    params = jax.device_put(params, jsh.named_shardings(mesh, jsh.fsdp_specs(params, mesh)))
    batch = "fsdp" if x.shape[0] % mesh.shape["fsdp"] == 0 else None
    cache = jax.device_put(cache, NamedSharding(mesh, P(batch)))
    x = jax.device_put(x, NamedSharding(mesh, P(batch)))
    return params, cache, x


def tp_shardings(params, cache, mesh):
    """Megatron-style placements: column-parallel kernels split on out, row-parallel on
    in, the KV cache by head; QArray leaves follow their float weight's spec."""
    from jax.sharding import NamedSharding, PartitionSpec as P


    def spec_of(path, leaf):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "kernel" not in names:
            return P()
        proj = names[names.index("kernel") - 1]
        return P(None, "tp") if proj in COLUMN else P("tp", None) if proj in ROW else P()

    def place(path, leaf):
        spec = spec_of(path, leaf)
        if isinstance(leaf, jf.QArray):
            return jsh.shard_qarray(leaf, mesh, spec)
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    params = jax.tree_util.tree_map_with_path(place, params,
                                              is_leaf=lambda v: isinstance(v, jf.QArray))
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, "tp", None, None)))
    return params, cache


def wall_times(fn, args, iters, loops=3):
    """(median wall time of a step, each call blocked on; wall time per step of a decode
    loop: `iters` steps dispatched back to back, each step's output the next one's x, the
    host's dispatch overlapping the GPU's work and one block at the end, as a generate loop
    that samples on the device runs; median of `loops` loops; the host's time per step to
    dispatch that loop, its calls returned before the block: where it is as long as the
    loop's, the loop is bound by the host, not the GPU)."""
    p, c, x = args
    jax.block_until_ready(fn(p, c, fn(p, c, x)))  # compile both input shardings, warm up
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    per_step, dispatch = [], []
    for _ in range(loops):
        y = x
        t0 = time.perf_counter()
        for _ in range(iters):
            y = fn(p, c, y)
        dispatch.append((time.perf_counter() - t0) / iters)
        jax.block_until_ready(y)
        per_step.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts), statistics.median(per_step), statistics.median(dispatch)


def kernel_sum(fn, args):
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_quant import device_time

    try:
        return device_time(fn, args)
    except Exception as e:  # no GPU trace (CPU): no kernel sum
        print(f"#   kernel sum unavailable: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return float("nan")


def collectives(fn, args):
    """{kind: (count, bytes of their results per device)} of the compiled step's collectives
    (jax_fp4.sharding.collectives: each op once; after XLA's combiners one op may carry
    several arrays)."""
    found = {}
    for c in jsh.collectives(fn.lower(*args).compile()):
        n, nbytes = found.get(c.kind, (0, 0))
        found[c.kind] = (n + 1, nbytes + c.nbytes)
    return found


def coll_str(coll):
    return ", ".join(f"{n} {kind} ({nbytes / 2**20:.2f} MiB)"
                     for kind, (n, nbytes) in sorted(coll.items()))


def layouts(args):
    """[(kind, devices)]: "tp" for tensor parallel (1: one device), "fsdp"."""
    out = [("tp", n) for n in args.tp] + [("fsdp", n) for n in args.fsdp]
    for kind, n in out:
        if n < 1 or n > len(jax.devices()):
            raise SystemExit(f"--{kind} {n}: {len(jax.devices())} devices")
    return out


def layout_name(kind, n):
    return "1 device" if (kind, n) == ("tp", 1) else f"{kind.upper()}={n}"


def variants(args):
    """(label, format, grouped) of each step measured at each M, bf16 first: each 4-bit
    format's step as written, and with `--group` also under jax_fp4.group_matmuls (label
    "<format>+group")."""
    out = [("bf16", "bf16", False)]
    for f in args.formats:
        out.append((f, f, False))
        if args.group:
            out.append((f + "+group", f, True))
    return out


def run(args):
    cfg = TINY if args.tiny else LLAMA3_70B if args.model == "70b" else Config()
    cfg = dataclasses.replace(cfg, layers=args.layers or cfg.layers,
                              context=args.context or cfg.context)
    key = jax.random.key(0)
    params = init_params(cfg, key)
    if args.fused:
        params = fuse_projections(params)
    if args.scan:
        params = stack_layers(params)
    rows = []
    models = {}
    for fmt in ["bf16", *args.formats]:
        models[fmt] = quantized(params, fmt) if fmt != "bf16" else params
    weight_bytes = {label: tree_nbytes(models[fmt]) for label, fmt, _ in variants(args)}
    for kind, n in layouts(args):
        mesh = (None if n == 1 else
                jax.sharding.Mesh(np.array(jax.devices()[:n]), (kind,)))
        if kind == "fsdp":
            from jax_fp4.sharding import gather_weights

            body = functools.partial(lambda p, c, x, mesh: step(cfg, gather_weights(p, mesh), c, x),
                                     mesh=mesh)
        else:
            body = functools.partial(step, cfg)
        fns = {False: jax.jit(body), True: jax.jit(jf.group_matmuls(body))}
        for m in args.ms:
            b, t = cfg.batch(m)
            cache = init_cache(cfg, b, jax.random.fold_in(key, 1000 + m))
            if args.scan:
                cache = stack_cache(cache)
            x = jax.random.normal(jax.random.fold_in(key, 2000 + m), (b, t, cfg.hidden),
                                  jnp.bfloat16)
            cache_bytes = tree_nbytes(cache)
            base = None
            for label, fmt, grouped in variants(args):
                fn = fns[grouped]
                p, c, xs = models[fmt], cache, x
                if kind == "tp" and mesh is not None:
                    p, c = tp_shardings(p, cache, mesh)
                elif kind == "fsdp" and mesh is not None:
                    p, c, xs = fsdp_shardings(p, cache, x, mesh)
                fargs = (p, c, xs)
                wall, loop, host = wall_times(fn, fargs, args.iters)
                ksum = (float("nan") if args.no_kernel_sum or jax.default_backend() == "cpu"
                        else kernel_sum(fn, fargs) / n)  # the trace has every device's
                coll = collectives(fn, fargs) if mesh is not None else {}
                if fmt == "bf16":
                    base = (wall, ksum, loop)
                rows.append(dict(layout=(kind, n), fmt=label, m=m, wall=wall, ksum=ksum,
                                 ratio=base[0] / wall, kratio=base[1] / ksum, loop=loop,
                                 lratio=base[2] / loop, tps=m / loop, host=host, coll=coll,
                                 step_bytes=weight_bytes[label] + cache_bytes))
                print(f"# {layout_name(kind, n):8s} M={m:5d} {label:8s} wall "
                      f"{wall * 1e3:8.3f} ms  x{base[0] / wall:5.2f}  "
                      f"kernels {ksum * 1e3:8.3f} ms  x{base[1] / ksum:5.2f}  "
                      f"decode loop {loop * 1e3:8.3f} ms  x{base[2] / loop:5.2f}  "
                      f"(dispatch {host * 1e3:6.3f} ms)"
                      + (f"  {coll_str(coll)}" if coll else ""), file=sys.stderr, flush=True)
                del p, c, xs, fargs
            del cache, x
    return cfg, rows


def table(cfg, rows):
    """Per layout: the ratio table to bf16; with one device among the layouts, each other
    layout's speed-up over it."""
    fmts = list(dict.fromkeys(r["fmt"] for r in rows))
    ms = list(dict.fromkeys(r["m"] for r in rows))
    by = {(r["layout"], r["fmt"], r["m"]): r for r in rows}
    head = ["| M | " + " | ".join(fmts) + " |", "|---:|" + "---|" * len(fmts)]
    parts = []
    for lay in dict.fromkeys(r["layout"] for r in rows):
        out = list(head)
        for m in ms:
            cells = []
            for f in fmts:
                r = by[(lay, f, m)]
                # without a kernel sum (--no-kernel-sum, CPU) its place reads "-"
                if f == "bf16":
                    k = "-" if math.isnan(r["ksum"]) else f"{r['ksum'] * 1e3:.3f}"
                    cells.append(f"{r['wall'] * 1e3:.3f} / {r['loop'] * 1e3:.3f} ms ({k}), "
                                 f"{r['tps']:.0f} tok/s")
                else:
                    k = "-" if math.isnan(r["kratio"]) else f"{r['kratio']:.2f}x"
                    cells.append(f"**{r['ratio']:.2f}x / {r['lratio']:.2f}x** ({k})")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        coll = "; ".join(f"{f}: {coll_str(by[(lay, f, ms[0])]['coll'])}" for f in fmts)
        kind, n = lay
        where = ("one device" if n == 1 else
                 f"tensor parallel (Megatron) over {n} devices" if kind == "tp" else
                 f"FSDP over {n} devices (weights gathered at use, batch split where B "
                 f"divides)")
        parts.append(f"**{layout_name(*lay)}**: {where}"
                     + (f". Collectives per step at M = {ms[0]} (count, result MiB per "
                        f"device): {coll}" if n > 1 else "") + "\n\n"
                     + "\n".join(out))
    one = ("tp", 1)
    others = [lay for lay in dict.fromkeys(r["layout"] for r in rows) if lay != one]
    if any(r["layout"] == one for r in rows) and others:
        out = ["| layout | M | " + " | ".join(fmts) + " |",
               "|---|---:|" + "---|" * len(fmts)]
        for lay in others:
            for m in ms:
                out.append(f"| {layout_name(*lay)} | {m} | " + " | ".join(
                    f"{by[(one, f, m)]['wall'] / by[(lay, f, m)]['wall']:.2f}x / "
                    f"{by[(one, f, m)]['loop'] / by[(lay, f, m)]['loop']:.2f}x"
                    for f in fmts) + " |")
        parts.append("**Speed-up over one device** (wall time per step, blocked / decode "
                     "loop, same format and M)\n\n" + "\n".join(out))
    lay = next(iter(dict.fromkeys(r["layout"] for r in rows)))
    out = list(head)
    for m in ms:
        bf16 = by[(lay, "bf16", m)]["step_bytes"]
        out.append(f"| {m} | {bf16 / 1e6:.1f} MB | " + " | ".join(
            f"{by[(lay, f, m)]['step_bytes'] / 1e6:.1f} MB ({bf16 / by[(lay, f, m)]['step_bytes']:.2f}x)"
            for f in fmts[1:]) + " |")
    parts.append("**Bytes a step reads at least** (weights and KV cache, all devices "
                 "together; in brackets bf16's over the format's: the speed-up of a step "
                 "that streams its bytes as fast as bf16's)\n\n" + "\n".join(out))
    note = (f"Wall-time ratio to bf16 per step in the same layout: each step blocked on / "
            f"a decode loop (steps back to back, each one's output the next one's input; "
            f"in brackets: the kernel-time ratio from the profiler, per device); bf16 "
            f"column: blocked / decode-loop ms per step (kernel ms), decode-loop tokens/s. "
            f"{cfg.layers} layers of hidden {cfg.hidden} / MLP {cfg.ffn}, context "
            f"{cfg.context}.")
    return "\n\n".join(parts) + "\n\n" + note + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--model", choices=["8b", "70b"], default="8b",
                    help="Llama-3-8B's layer shapes (default) or Llama-3-70B's")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    ap.add_argument("--context", type=int, default=None, help="KV-cache tokens (default 2048)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tp", nargs="+", type=int, default=[1],
                    help="tensor-parallel degrees to measure, e.g. 1 2 (1: one device)")
    ap.add_argument("--fsdp", nargs="+", type=int, default=[],
                    help="FSDP degrees to measure (weights sharded at rest, gathered at use)")
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--no-kernel-sum", action="store_true")
    ap.add_argument("--scan", action="store_true",
                    help="layers stacked and run under lax.scan (one array per parameter)")
    ap.add_argument("--fused", action="store_true",
                    help="q/k/v and gate/up as one kernel each (fuse_projections)")
    ap.add_argument("--group", action="store_true",
                    help="also each 4-bit format's step under jax_fp4.group_matmuls")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the rows as JSON (benchmarks/model_results.py reads it)")
    args = ap.parse_args(argv)
    if args.fused and (args.fsdp or any(n > 1 for n in args.tp)):
        # a fused kernel split over devices would need its q / k / v columns grouped per
        # device (Megatron's layout); these layouts are measured unfused
        ap.error(f"--fused runs on one device: got --tp {args.tp} --fsdp {args.fsdp}")
    if args.scan and (args.fsdp or any(n > 1 for n in args.tp)):
        # the layouts' shardings are written for a list of layers
        ap.error(f"--scan runs on one device: got --tp {args.tp} --fsdp {args.fsdp}")
    for f in args.formats:
        jf.get_format(f)  # unknown names fail before any work
    cfg, rows = run(args)
    dev = jax.devices()[0]
    flags = os.environ.get("XLA_FLAGS", "")  # part of the command: they change the step's graph
    head = (f"### bench_model.py, {datetime.date.today()}, {getattr(dev, 'device_kind', dev.platform)}"
            f" x{max(n for _, n in layouts(args))}, jax {jax.__version__}"
            f"\n\n`{f'XLA_FLAGS={flags} ' if flags else ''}python3 benchmarks/bench_model.py "
            + " ".join(argv if argv is not None else sys.argv[1:]) + "`\n\n")
    text = head + table(cfg, rows)
    print(text)
    if not args.no_append:
        with open(args.results, "a") as fh:
            fh.write("\n" + text)
    if args.json:
        gpu = str(getattr(dev, "device_kind", dev.platform))
        with open(args.json, "w") as fh:
            json.dump([dict(gpu=gpu, table=head.splitlines()[0].lstrip("# "), m=r["m"],
                            fmt=r["fmt"], layout=layout_name(*r["layout"]), ratio=r["ratio"],
                            loop_ratio=r["lratio"], bf16_ms=r["wall"] * r["ratio"] * 1e3,
                            bf16_loop_ms=r["loop"] * r["lratio"] * 1e3,
                            loop_ms=r["loop"] * 1e3, dispatch_ms=r["host"] * 1e3)
                       for r in rows if r["fmt"] != "bf16"], fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
