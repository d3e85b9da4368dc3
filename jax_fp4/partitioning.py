"""Sharding rules of the jax-fp4 primitives (``jax.sharding``, SPMD partitioning).

XLA cannot see inside a custom call, so without rules it replicates a custom call's
operands: every jax-fp4 op on a sharded array would all-gather it. This module gives each
primitive of :mod:`jax_fp4.prims` (and :mod:`jax_fp4.stochastic`) a ``jax.experimental.custom_partitioning`` rule,
modelled on ``jax/_src/cudnn/scaled_matmul_stablehlo.py``.

Mechanism. Each primitive ``p`` gets a twin, the *shard-local* primitive ``p_local``
(same parameters and abstract evaluation), which carries ``p``'s per-platform lowerings
(C++ / CUDA kernels or the reference). ``p`` itself lowers to a ``custom_partitioning``
function whose body binds ``p_local``; on one device (or inside ``shard_map``) that body
is inlined, so the compiled program is what it was, kernels included. Under a mesh the
partitioner calls :func:`_partition` with the operands' shardings: it picks the
shardings the op supports without communication, and the per-shard body runs
``p_local`` -- the same kernel -- on each device's block, plus, where a contracted or
reduced axis is sharded, one collective on the result (``psum`` of float32 partial sums,
``pmax`` of an amax). On the GPUs of one process the ``psum`` of partial sums is jax-fp4's
in-graph all-reduce (:mod:`jax_fp4.prims.all_reduce`), which stays inside XLA's command
buffer. ``p``'s batching rule, JVP and transpose are untouched: they bind
``p`` (or other primitives), which partition in turn; ``jax.export`` of a one-device
function lowers as before.

Both partitioners are served: Shardy (the default) from a ``sharding_rule``
(:class:`SdyShardingRule`) built from the same description as the partition callback,
GSPMD from ``infer_sharding_from_operands``.

Description of an op (:data:`_LAYOUTS`): for its canonical 2-D operands and results, each
dimension is a *factor* times a *granule*: ``("r", 1)`` rows, ``("k", bs)`` the blocked
axis of x (K = blocks x block_size), ``("k", bs * bits / 8)`` the same axis of the packed
codes, ``("k", 1)`` of the block scales. A factor sharded over mesh axes splits every
dimension it appears in at whole granules, so the blocked axis always splits at whole
blocks and codes, scales and zero points split where x does. ``None``: a dimension that
never shards (the empty zero-point placeholder; a swizzled scale's column tiles).
``fixed`` factors never shard (the blocked axis of a prepared ("tiled") weight, whose
tiles interleave K; rows of swizzled scales unless whole 128-row tiles). ``reduce``
factors are contracted (matmul K) or reduced (amax): sharded, they leave partial results
that the op's body combines.

Rules that follow (the canonical view, rows x K, blocked axis last):
  * quantize / fake_quantize / dequantize: rows shard freely; K shards at whole blocks;
    the NVFP4 per-row tensor scale follows rows. Swizzled scales: rows at whole 128-row
    tiles, K never. No communication.
  * auto_tensor_scale (NVFP4 ``tensor_scale="auto"``): each device reduces its block to an
    amax (as float32 bit patterns, so the result is bit-exact), one scalar ``pmax`` over
    the sharded axes, then the scale. The tensor is never gathered.
  * wmatmul (W4A16, y = x @ W^T, x (M, K), W (N, K)): M and N shard freely (N at whole
    128-row tiles for a prepared weight; a per-tensor scale given once, (1,), is
    replicated); K sharded on x and W alike: float32 partial sums per device, one
    ``psum`` of the (M_local, N_local) output, then the cast. Where the output is asked
    split (its propagated sharding: rows over the tensor-parallel axis in Megatron's
    sequence parallelism, or columns) over mesh axes that K was sharded on, a
    ``psum_scatter`` on that dimension instead: each device receives only its slice of
    the sum (:func:`_scatter`).
  * wmatmul_group (several W4A16 weights of one x, jax_fp4.group_matmuls): as wmatmul for
    each weight, whose rows are a factor of their own; the weights may split their rows
    over the same mesh axes (factors that share no operand or result may share axes),
    and with K sharded each output's partials are summed (never scattered).
  * scaled_matmul (D = alpha A B^T + bias): as wmatmul; with K sharded the bias is added
    once, after the ``psum`` (or ``psum_scatter``: then each device's slice of it).
A sharding outside these rules (K not at whole blocks, M and N on the same mesh axis, a
sharded dimension that does not divide) is dropped for that factor: the partitioner
reshards the operand first, which is correct, but communicates.

Sharding in types: over Explicit mesh axes (``jax.set_mesh`` with ``AxisType.Explicit``)
each primitive's result type carries the sharding this rule gives it
(:func:`_typed_abstract_eval`), so the program never gathers a result to match a
replicated type.

Limits: the mesh must be known when the function lowers -- a ``jax.sharding.Mesh`` of
``NamedSharding`` s on the arguments, or a ``with mesh`` / ``jax.set_mesh`` context;
otherwise the op runs replicated. The primitives need concrete devices to lower
(``dispatch.prim_requires_devices_during_lowering``), as jax's own cuDNN scaled matmul
does: ``jax.export`` with only an ``AbstractMesh`` is refused.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch  # prim_requires_devices_during_lowering: no public API
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.interpreters import mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from . import reference
from .formats import get_format
from .prims import all_reduce

__all__ = ["shard_local", "register"]

# The 128x4 swizzled scale layout stores 128 rows of scales as 32 rows of its 2-D view.
_SWIZZLE_ROWS, _SWIZZLE_VIEW_ROWS = 128, 32
# The prepared ("tiled") weight layout (jax_fp4.layout.TILE_ROWS) interleaves K within
# 128-row tiles: rows shard at whole tiles, K never.
_TILE_ROWS = 128


# ------------------------------------------------------------------------ op layouts
class Layout:
    """The factor description of one call (see the module docstring).

    ins, outs: per operand / result, a tuple with one entry per dimension: (factor,
      granule) or None. fixed: factors that never shard. reduce: contracted / reduced
      factors (absent from the results)."""

    def __init__(self, ins, outs, fixed=(), reduce=()):
        self.ins, self.outs = tuple(ins), tuple(outs)
        self.fixed, self.reduce = frozenset(fixed), frozenset(reduce)

    def factor_sizes(self, in_shapes, out_shapes):
        sizes = {}
        for dims, shape in zip(self.ins + self.outs, tuple(in_shapes) + tuple(out_shapes)):
            for entry, n in zip(dims, shape):
                if entry is not None:
                    f, g = entry
                    if n % g or sizes.setdefault(f, n // g) != n // g:
                        raise AssertionError(f"inconsistent layout for factor {f}: {entry}, "
                                             f"{shape}")
        return sizes


def _code_bytes(f, block_size):
    """Packed bytes per block, or None where a block is not a whole number of bytes."""
    nbits = block_size * f.bits
    return nbits // 8 if nbits % 8 == 0 else None


def _blocked(f, block_size):
    """Entries of the blocked axis for x, codes and scales, and the fixed factors: K may
    shard where a block's codes are whole bytes (else the codes' axis is not K's blocks,
    and K never shards)."""
    cb = _code_bytes(f, block_size)
    return ("k", block_size), ("k", cb) if cb else None, ("k", 1), () if cb else ("k",)


def _zeros_dims(f, rows=("r", 1)):
    """INT4 zero points are shaped as linear scales; other formats pass an empty (0,)."""
    return (rows, ("k", 1)) if f.family == "int4" else (None,)


def _quantize_layout(params, in_shapes, out_shapes):
    f = get_format(params["fmt"])
    xk, ck, sk, fixed = _blocked(f, params["block_size"])
    if params["swizzled"]:
        ok = in_shapes[0][0] % _SWIZZLE_ROWS == 0
        rows = ("r", _SWIZZLE_ROWS) if ok else ("r", 1)
        scales = (("r", _SWIZZLE_VIEW_ROWS) if ok else None, None)
        return Layout([(rows, xk), (rows,)], [(rows, ck), scales, _zeros_dims(f, rows)],
                      fixed=("k",) + (() if ok else ("r",)))
    rows = ("r", 1)
    return Layout([(rows, xk), (rows,)], [(rows, ck), (rows, sk), _zeros_dims(f)],
                  fixed=fixed)


def _dequantize_layout(params, in_shapes, out_shapes):
    f = get_format(params["fmt"])
    xk, ck, sk, fixed = _blocked(f, params["block_size"])
    rows = ("r", 1)
    return Layout([(rows, ck), (rows, sk), _zeros_dims(f), (rows,)], [(rows, xk)], fixed=fixed)


def _fake_quantize_layout(params, in_shapes, out_shapes):
    xk, _, _, fixed = _blocked(get_format(params["fmt"]), params["block_size"])
    rows = ("r", 1)
    return Layout([(rows, xk), (rows,)], [(rows, xk)], fixed=fixed)


def _auto_tensor_scale_layout(params, in_shapes, out_shapes):
    return Layout([(("r", 1), ("k", 1))], [()], reduce=("r", "k"))


def _wmatmul_layout(params, in_shapes, out_shapes):
    """x (M, K), then codes, scales, zeros, ts of one weight -- or, for the grouped call,
    of each weight i, with its own rows factor n{i} -- and y (M, N_i) per weight."""
    f = get_format(params["fmt"])
    xk, ck, sk, fixed = _blocked(f, params["block_size"])
    fixed = set(fixed)
    m = ("m", 1)
    ins, outs = [(m, xk)], []
    for i in range(len(out_shapes)):
        codes, ts_shape = in_shapes[1 + 4 * i], in_shapes[4 + 4 * i]
        name = "n" if len(out_shapes) == 1 else f"n{i}"
        tiles = params["tiled"] and codes[0] % _TILE_ROWS == 0
        if params["tiled"]:  # K interleaved within tiles; N at whole tiles where it has them
            fixed |= {"k"} if tiles else {"k", name}
        n = (name, _TILE_ROWS if tiles else 1)
        # the per-tensor scale: one per weight row (N,), or one for the whole weight (1,)
        ts = (n,) if ts_shape[0] == codes[0] else (None,)
        ins += [(n, ck), (n, sk), _zeros_dims(f, n), ts]
        outs.append((m, n))
    return Layout(ins, outs, fixed=fixed, reduce=("k",))


def _scaled_matmul_layout(params, in_shapes, out_shapes):
    fa, fb = get_format(params["a_fmt"]), get_format(params["b_fmt"])
    bs = fa.default_block  # same family: nvfp4 16, MX 32 (ops.scaled_matmul checks)
    _, ack, sk, fixed_a = _blocked(fa, bs)
    _, bck, _, fixed_b = _blocked(fb, bs)
    m, n = ("m", 1), ("n", 1)
    return Layout([(m, ack), (m, sk), (m,), (n, bck), (n, sk), (n,), (), (n,)], [(m, n)],
                  fixed=set(fixed_a) | set(fixed_b), reduce=("k",))


# ------------------------------------------------------------------------ per-shard bodies
def _local_params(params, k_parts):
    """Parameters of the shard-local call: ops that carry K as a parameter see their block."""
    if k_parts > 1 and "k" in params:
        return dict(params, k=params["k"] // k_parts)
    return params


def _amax_bits(x):
    """max |x| of x's block as a float32 bit pattern (uint32): reference.amax before its
    final bitcast, so that a pmax of the patterns is the amax of the whole tensor."""
    return jnp.max(reference.to_f32_bits(x) & jnp.uint32(0x7FFFFFFF), initial=jnp.uint32(0))


def _combine(y, axes, scatter, mesh, out_dtype):
    """The sum of the float32 partials ``y`` over mesh ``axes``, in ``out_dtype``: a
    ``psum_scatter`` on each output dimension of ``scatter`` ({dim: axes}, the result
    asked split there) -- each device receives only its slice of the sum -- and a sum over
    the other axes: on the GPUs of one process the in-graph all-reduce
    (:func:`jax_fp4.prims.all_reduce.in_graph_sum`, which also casts), else ``psum``."""
    for d, sa in scatter.items():
        y = lax.psum_scatter(y, sa, scatter_dimension=d, tiled=True)
    rest = tuple(a for a in axes if not any(a in sa for sa in scatter.values()))
    if rest:
        s = all_reduce.in_graph_sum(y, mesh, rest, out_dtype)
        y = s if s is not None else lax.psum(y, rest)
    return y.astype(out_dtype)


def _body(name, local, params, args, axes, scatter, mesh):
    """The per-shard computation: ``local`` on this device's blocks, and where ``axes``
    (mesh axes of the reduced factors) is not empty, the op's combination of partials
    (:func:`_combine`; ``scatter``: output dimensions reduce-scattered)."""
    if not axes:
        return local.bind(*args, **params)
    if name == "jax_fp4_auto_tensor_scale":
        amax = lax.bitcast_convert_type(lax.pmax(_amax_bits(args[0]), axes), jnp.float32)
        return reference.tensor_scale_from_amax(amax)
    out_dtype = params["out_dtype"]
    if name == "jax_fp4_weight_matmul":
        y = local.bind(*args, **dict(params, out_dtype=np.dtype(np.float32)))
        return _combine(y, axes, scatter, mesh, out_dtype)
    if name == "jax_fp4_weight_matmul_group":  # (results are never scattered: _scatter)
        ys = local.bind(*args, **dict(params, out_dtype=np.dtype(np.float32)))
        return [_combine(y, axes, {}, mesh, out_dtype) for y in ys]
    if name == "jax_fp4_scaled_matmul":
        # the bias is added once, to the sum; with N scattered it arrives as this
        # device's slice (:func:`_partition`)
        *ops, bias = args
        n = ops[3].shape[0]
        y = local.bind(*ops, jnp.zeros((n,), bias.dtype),
                       **dict(params, out_dtype=np.dtype(np.float32)))
        return (_combine(y, axes, scatter, mesh, np.float32) + bias[None, :]).astype(out_dtype)
    raise AssertionError(f"{name}: no reduced factors")


_LAYOUTS = {
    "jax_fp4_quantize": _quantize_layout,
    "jax_fp4_dequantize": _dequantize_layout,
    "jax_fp4_fake_quantize": _fake_quantize_layout,
    "jax_fp4_auto_tensor_scale": _auto_tensor_scale_layout,
    "jax_fp4_weight_matmul": _wmatmul_layout,
    "jax_fp4_weight_matmul_group": _wmatmul_layout,
    "jax_fp4_scaled_matmul": _scaled_matmul_layout,
}


# ------------------------------------------------------------------------ partitioning
def _spec_axes(entry):
    """A PartitionSpec entry -> tuple of mesh axis names."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _choose(layout, sizes, mesh, shardings):
    """factor -> mesh axes: for each factor, the axes its first sharded dimension (operands
    first, then results) is split over, where the op supports it (not fixed, divides the
    factor, no mesh axis used by a factor that shares an operand or result with it: the
    rows of the weights of a grouped call may each split over the same axes)."""
    chosen = {}
    peers = {}
    for dims in layout.ins + layout.outs:
        names = {e[0] for e in dims if e is not None}
        for f in names:
            peers.setdefault(f, set()).update(names - {f})
    for dims, sharding in zip(layout.ins + layout.outs, shardings):
        spec = getattr(sharding, "spec", None)
        if spec is None:
            continue
        for d, entry in enumerate(dims):
            if entry is None or d >= len(spec):
                continue
            f = entry[0]
            axes = _spec_axes(spec[d])
            used = {a for h in peers[f] for a in chosen.get(h, ())}
            if f in chosen or f in layout.fixed or not axes or used & set(axes):
                continue
            if sizes[f] % math.prod(mesh.shape[a] for a in axes):
                continue
            chosen[f] = axes
    return chosen


def _specs(dims_list, chosen):
    return [P(*(_spec_entry(chosen.get(e[0], ())) if e is not None else None for e in dims))
            for dims in dims_list]


def _shapes(values):
    return [tuple(v.shape) for v in values]


def _shardings(name, params_key, mesh, arg_shapes, result_shape):
    """(layout, chosen factor axes, arg NamedShardings, result NamedShardings)."""
    params = dict(params_key)
    outs = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
    layout = _LAYOUTS[name](params, _shapes(arg_shapes), _shapes(outs))
    sizes = layout.factor_sizes(_shapes(arg_shapes), _shapes(outs))
    if mesh.empty:
        chosen = {}
    else:
        chosen = _choose(layout, sizes, mesh,
                         [s.sharding for s in arg_shapes] + [s.sharding for s in outs])
    arg_sh = [NamedSharding(mesh, s) for s in _specs(layout.ins, chosen)]
    out_sh = [NamedSharding(mesh, s) for s in _specs(layout.outs, chosen)]
    return layout, chosen, arg_sh, out_sh


def _pack(result_shape, shardings):
    return shardings if isinstance(result_shape, (list, tuple)) else shardings[0]


def _infer(name, params_key, mesh, arg_shapes, result_shape):
    _, _, _, out_sh = _shardings(name, params_key, mesh, arg_shapes, result_shape)
    return _pack(result_shape, out_sh)


def _scatter(layout, chosen, mesh, result_shape, axes):
    """{output dimension: mesh axes} where the result of a reduction over ``axes`` is asked
    split (its propagated sharding, e.g. rows over the tensor-parallel axis in Megatron's
    sequence parallelism) on axes among ``axes`` that no factor of the call uses: there the
    partial sums are reduce-scattered instead of all-reduced and then sliced."""
    spec = getattr(getattr(result_shape, "sharding", None), "spec", None)
    if not axes or spec is None or isinstance(result_shape, (list, tuple)):
        return {}
    free, out = set(axes), {}
    for d, entry in enumerate(layout.outs[0]):
        if entry is None or d >= len(spec) or entry[0] in chosen:
            continue
        want = _spec_axes(spec[d])
        if (want and set(want) <= free
                and result_shape.shape[d] % (math.prod(mesh.shape[a] for a in want) *
                                             entry[1]) == 0):
            out[d] = want
            free -= set(want)
    return out


def _partition(name, local, params_key, mesh, arg_shapes, result_shape):
    layout, chosen, arg_sh, out_sh = _shardings(name, params_key, mesh, arg_shapes,
                                                result_shape)
    axes = tuple(a for f in sorted(layout.reduce) for a in chosen.get(f, ()))
    k_parts = math.prod(mesh.shape[a] for a in chosen.get("k", ())) if not mesh.empty else 1
    params = _local_params(dict(params_key), k_parts)
    scatter = _scatter(layout, chosen, mesh, result_shape, axes)
    if scatter:
        spec = list(out_sh[0].spec) + [None] * (len(layout.outs[0]) - len(out_sh[0].spec))
        for d, sa in scatter.items():
            spec[d] = _spec_entry(sa)
        out_sh = [NamedSharding(mesh, P(*spec))]
        if name == "jax_fp4_scaled_matmul" and 1 in scatter:  # the bias: this N slice
            arg_sh[-1] = NamedSharding(mesh, P(_spec_entry(scatter[1])))

    def body(*args):
        return _body(name, local, params, args, axes, scatter, mesh)

    return mesh, body, _pack(result_shape, out_sh), tuple(arg_sh)


def _sharding_rule(name, params_key, mesh, value_types, result_types):
    """The Shardy rule of one call, from the same layout as :func:`_partition`."""
    in_shapes = [tuple(ir.RankedTensorType(t).shape) for t in value_types]
    out_shapes = [tuple(ir.RankedTensorType(t).shape) for t in result_types]
    layout = _LAYOUTS[name](dict(params_key), in_shapes, out_shapes)
    sizes = layout.factor_sizes(in_shapes, out_shapes)
    whole = set()  # factors that appear as a whole dimension somewhere
    for dims in layout.ins + layout.outs:
        whole |= {e[0] for e in dims if e is not None and e[1] == 1}
    compound_sizes, replicate, fresh = {}, set(layout.fixed), [0]
    # A factor that no mesh axis divides (e.g. 4 blocks of K over 8 devices) could only be
    # split by Shardy over part of an axis (a sub-axis), which custom_partitioning cannot
    # pass on as a PartitionSpec: its dimensions become unrelated replicated ones, and
    # the operands are resharded around the call, as _choose leaves them under GSPMD.
    axis_sizes = tuple(getattr(mesh, "shape", {}).values()) if mesh is not None else ()
    unsplit = {f for f, n in sizes.items()
               if axis_sizes and all(n % a for a in axis_sizes if a > 1)}

    def mapping(dims, shape):
        out = []
        for entry, n in zip(dims, shape):
            if entry is not None and entry[0] in unsplit:
                entry = None
            if entry is None:
                fresh[0] += 1
                name_ = f"z{fresh[0]}"
                replicate.add(name_)
                out.append(name_)
            elif entry[1] == 1:
                out.append(entry[0])
            else:
                f, g = entry
                unit = f"{f}_g{g}"
                compound_sizes[unit] = g
                replicate.add(unit)
                if f not in whole:
                    compound_sizes[f] = sizes[f]
                out.append(CompoundFactor(f, unit))
        return ArrayMapping(*out)

    ins = tuple(mapping(d, s) for d, s in zip(layout.ins, in_shapes))
    outs = tuple(mapping(d, s) for d, s in zip(layout.outs, out_shapes))
    # Shardy numbers factors in order of appearance and wants special factors in that order
    order = list(dict.fromkeys(
        x for m in ins + outs for e in m for x in ((e,) if isinstance(e, str) else e)))
    reduce = tuple(f for f in order if f in layout.reduce and f not in layout.fixed)
    return SdyShardingRule(ins, outs, reduction_factors=reduce,
                           need_replication_factors=tuple(f for f in order if f in replicate),
                           **compound_sizes)


# ------------------------------------------------------------------------ registration
def shard_local(prim: Primitive) -> Primitive:
    """The shard-local twin of ``prim``: same parameters, results and abstract evaluation;
    it receives ``prim``'s per-platform lowerings (prims._common._register_lowerings) and is
    bound only inside the per-shard body of ``prim``'s partitioned lowering."""
    local = Primitive(prim.name + "_local")
    local.multiple_results = prim.multiple_results
    local.abstract_eval = prim.abstract_eval
    return local


def register(prim: Primitive, local: Primitive) -> None:
    """Lower ``prim`` as a ``custom_partitioning`` call of ``local`` with the sharding rules
    of :data:`_LAYOUTS` [prim.name]."""
    name = prim.name

    def call(params_key, *operands):
        return local.bind(*operands, **dict(params_key))

    fn = custom_partitioning(call, static_argnums=(0,))
    fn.def_partition(
        partition=functools.partial(_partition, name, local),
        infer_sharding_from_operands=functools.partial(_infer, name),
        sharding_rule=functools.partial(_sharding_rule, name))

    def lowered(*args, **params):
        out = fn(tuple(sorted(params.items())), *args)
        return list(out) if prim.multiple_results else out

    mlir.register_lowering(prim, mlir.lower_fun(lowered, multiple_results=prim.multiple_results))
    dispatch.prim_requires_devices_during_lowering.add(prim)
    prim.abstract_eval = _typed_abstract_eval(name, prim.abstract_eval)


def explicit_sharding(aval):
    """``aval``'s sharding where its mesh has Explicit axes (sharding in types), else None:
    the ``out_sharding`` a ``lax.dot_general`` inside a rule gives a result typed as
    ``aval`` (an N-sharded cotangent contracted with an N-sharded weight, whose output
    sharding is otherwise ambiguous)."""
    s = getattr(aval, "sharding", None)
    if s is None or s.mesh.empty or AxisType.Explicit not in tuple(s.mesh.axis_types):
        return None
    return s


def _typed_abstract_eval(name, abstract_eval):
    """``abstract_eval`` whose results carry the sharding the rule gives them where the
    operands are sharded over Explicit mesh axes (sharding in types, ``jax.set_mesh`` with
    ``AxisType.Explicit``); elsewhere the results are as ``abstract_eval`` gives them."""

    def rule(*avals, **params):
        outs, effects = abstract_eval(*avals, **params)
        meshes = {a.sharding.mesh for a in avals
                  if getattr(a, "sharding", None) is not None and not a.sharding.mesh.empty
                  and any(t == AxisType.Explicit for t in a.sharding.mesh.axis_types)}
        if len(meshes) != 1:
            return outs, effects
        mesh, = meshes
        multiple = isinstance(outs, (list, tuple))
        out_list = list(outs) if multiple else [outs]
        layout = _LAYOUTS[name](params, _shapes(avals), _shapes(out_list))
        sizes = layout.factor_sizes(_shapes(avals), _shapes(out_list))
        explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types)
                    if t == AxisType.Explicit}
        specs = [P(*(tuple(a for a in _spec_axes(e) if a in explicit) or None for e in
                   a.sharding.spec)) for a in avals]
        chosen = _choose(layout, sizes, mesh, [NamedSharding(mesh, sp) for sp in specs])
        out_list = [o.update(sharding=NamedSharding(mesh, sp))
                    for o, sp in zip(out_list, _specs(layout.outs, chosen))]
        return (out_list if multiple else out_list[0]), effects

    return rule
