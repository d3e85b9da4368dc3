"""PartitionSpecs for quantized arrays and models (docs/sharding.md).

A :class:`~jax_fp4.QArray` stores a logical array blocked along ``axis`` as leaves with
the blocked axis moved last (``data`` (rest..., K*bits/8), ``scales`` / ``zeros``
(rest..., K/block_size), a scalar ``tensor_scale``). The helpers here turn the
PartitionSpec of the float array into specs of those leaves, so that a sharded model
quantizes into a sharded quantized model over the same mesh axes, and the ops' sharding
rules (:mod:`jax_fp4.partitioning`) then run on each device's blocks without gathering.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Union

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .layout import untile_weight
from .prims import all_reduce
from .qarray import QArray

__all__ = ["qarray_partition_specs", "shard_qarray", "named_shardings", "quantized_specs",
           "tensor_parallel_specs", "fsdp_specs", "gather_weights", "with_out_sharding",
           "Collective", "collectives", "MEGATRON_COLUMN", "MEGATRON_ROW"]

#: Layer names of Megatron's column-parallel layers (output features sharded): attention
#: q/k/v and MLP gate/up projections, as Hugging Face Llama / Mistral / Qwen name them
#: (q_proj, ..., fused qkv_proj, gate_up_proj), Meta's Llama (wq, wk, wv; w1 gate, w3 up)
#: and w_gate / w_up
MEGATRON_COLUMN = (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj"
                   r"|wq|wk|wv|w1|w3|w_gate|w_up)(\.|$)")
#: ... and of its row-parallel layers (input features sharded, partial sums all-reduced):
#: attention output and MLP down projections (o_proj, down_proj; Meta's wo, w2; w_down)
MEGATRON_ROW = r"(^|\.)(o_proj|down_proj|wo|w2|w_down)(\.|$)"


def _entries(spec, ndim):
    spec = tuple(P() if spec is None else spec)
    if len(spec) > ndim:
        raise ValueError(f"spec: expected at most {ndim} entries for a rank-{ndim} array, "
                         f"got {P(*spec)}")
    return spec + (None,) * (ndim - len(spec))


def qarray_partition_specs(spec, q: QArray) -> QArray:
    """The PartitionSpecs of ``q``'s leaves for a float array sharded as ``spec``.

    Args:
      spec: PartitionSpec (or None: replicated) of the logical (float) array, of rank
        ``q.ndim`` at most (missing trailing entries are None).
      q: the QArray (or any QArray of the same structure, e.g. from ``jax.eval_shape``).
    Returns:
      a QArray of the same structure whose leaves are PartitionSpecs, usable as
      ``in_shardings`` / ``out_shardings`` of ``jax.jit`` or (through
      ``NamedSharding``) with ``jax.device_put``: ``data``, linear ``scales`` and
      ``zeros`` take spec's entries for the other axes in order, then the blocked axis'
      entry last; ``tensor_scale`` is replicated (``P()``). The blocked axis shards at
      whole blocks only where K / (devices on its mesh axes) is a multiple of the block
      size (the caller's choice; the ops reshard otherwise). Layouts: ``"tiled"``
      (:func:`jax_fp4.prepare`) interleaves K within 128-row tiles, so its blocked axis
      is replicated (rows shard where each device holds whole 128-row tiles);
      ``"swizzled"`` scales are 2-D 128x4 tiles: rows sharded only for a 2-D array, K
      never.
    Raises:
      TypeError: q is not a QArray.
      ValueError: spec has more entries than q has axes.
    """
    if not isinstance(q, QArray):
        raise TypeError(f"q: expected a QArray, got {type(q).__name__}")
    entries = _entries(spec, q.ndim)
    ax = q.axis
    rest = entries[:ax] + entries[ax + 1:]
    k = None if q.scale_layout == "tiled" else entries[ax]
    block = P(*rest, k)
    if q.scale_layout == "swizzled":
        scales = P(rest[0] if len(rest) == 1 else None, None)
    else:
        scales = block
    return QArray(block, scales, None if q.tensor_scale is None else P(),
                  None if q.zeros is None else block, format=q.format, axis=q._axis,
                  shape=q._shape, dtype=q.dtype, block_size=q.block_size,
                  scale_layout=q.scale_layout)


def _is_spec_leaf(x):
    return x is None or isinstance(x, (P, QArray))


def named_shardings(mesh, specs):
    """A pytree of PartitionSpecs (None: replicated; QArrays of specs included) as
    NamedShardings on ``mesh``, for ``jax.device_put`` or ``jax.jit``'s shardings."""
    def named(s):
        if isinstance(s, QArray):  # its absent leaves (None) stay absent
            return jax.tree.map(lambda leaf: NamedSharding(mesh, leaf), s)
        return NamedSharding(mesh, P() if s is None else s)

    return jax.tree.map(named, specs, is_leaf=_is_spec_leaf)


def shard_qarray(q: QArray, mesh, spec) -> QArray:
    """``q`` placed on ``mesh`` as its float array would be with ``spec``: ``jax.device_put``
    of each leaf with :func:`qarray_partition_specs` (spec, q).

    A prepared (``"tiled"``) weight whose blocked axis ``spec`` shards (a row-parallel
    layer) is placed in the linear layout (:func:`jax_fp4.unprepare`; the same values):
    the prepared layout interleaves K within 128-row tiles, so its K cannot be split, and
    a K-replicated weight would make every device gather the layer's input instead of
    summing partial products. Raises as :func:`qarray_partition_specs`."""
    if q.scale_layout == "tiled" and _entries(spec, q.ndim)[q.axis] is not None:
        data, scales, zeros = untile_weight(q.data, q.scales, q.zeros, q.block_size)
        q = QArray(data, scales, q.tensor_scale, zeros, format=q.format, axis=q._axis,
                   shape=q._shape, dtype=q.dtype, block_size=q.block_size,
                   scale_layout="linear")
    return jax.device_put(q, named_shardings(mesh, qarray_partition_specs(spec, q)))


def quantized_specs(specs, qtree):
    """Specs of a quantized pytree from the specs of the float pytree it came from.

    Args:
      specs: the float tree's PartitionSpecs (a pytree of PartitionSpec / None with the
        float tree's structure, e.g. ``nnx.get_partition_spec(nnx.state(model))`` or, for
        Linen, ``nn.logical_to_mesh(nn.get_partition_spec(variables), rules)``).
      qtree: the quantized tree (:func:`jax_fp4.nn.quantize_params` of the float tree):
        QArrays where the float tree had the quantized kernels.
    Returns:
      a pytree of qtree's structure: :func:`qarray_partition_specs` for each QArray, the
      float spec elsewhere.
    """
    return jax.tree.map(lambda s, q: qarray_partition_specs(s, q) if isinstance(q, QArray)
                        else s, specs, qtree, is_leaf=_is_spec_leaf)


def tensor_parallel_specs(tree, axis: str = "model", *, column: str = MEGATRON_COLUMN,
                          row: str = MEGATRON_ROW, default: Any = None) -> Any:
    """Megatron-style tensor-parallel PartitionSpecs of a (float or quantized) parameter tree.

    Column-parallel layers (path matches ``column``) shard their output features over
    mesh axis ``axis``: each device computes its slice of the output with no communication,
    and the activations stay sharded on features into the next layer. Row-parallel layers
    (``row``) shard their input (contraction) features: each device contracts its slice
    and one all-reduce sums the partial outputs. Pairing them (q/k/v then o; gate/up then
    down) costs one all-reduce per attention block and one per MLP.

    Leaves are told apart by name as :func:`jax_fp4.nn.quantize_params` does: ``kernel``
    (Flax, (in, out)) or ``weight`` (PyTorch / Equinox / Hugging Face, (out, in)) 2-D
    leaves, float or QArray; a 1-D ``bias`` of a column-parallel layer is sharded like its
    output features. Every other leaf gets ``default`` (None: replicated).

    Args:
      tree: parameter pytree (plain / Linen dict, NNX State, safetensors dict), with float
        arrays or QArrays.
      axis: mesh axis name (or tuple of names) to shard over.
      column, row: regexes searched in the dotted path (jax_fp4.nn.path_str) of each leaf;
        defaults: Llama-style names (MEGATRON_COLUMN, MEGATRON_ROW).
      default: spec for everything else.
    Returns:
      pytree of tree's structure with PartitionSpec leaves (QArrays of specs for QArrays,
      see :func:`qarray_partition_specs`).
    """
    from .tree_paths import contraction_axis, path_str

    def spec(path, leaf):
        p = path_str(path)
        is_col, is_row = bool(re.search(column, p)), bool(re.search(row, p))
        name = p.rsplit(".", 1)[-1]
        ndim = leaf.ndim if hasattr(leaf, "ndim") else None
        out = default
        if (is_col or is_row) and ndim == 2 and contraction_axis(p) is not None:
            k = contraction_axis(p)
            entries = [None, None]
            entries[k if is_row else 1 - k] = axis
            out = P(*entries)
        elif is_col and ndim == 1 and name == "bias":
            out = P(axis)
        return qarray_partition_specs(out, leaf) if isinstance(leaf, QArray) else out

    return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=lambda x: isinstance(x, QArray))


def _axes_size(mesh, axis):
    names = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for a in names:
        size *= mesh.shape[a]
    return size


def fsdp_specs(tree, mesh, axis: Any = "fsdp", *, default: Any = None) -> Any:
    """FSDP (ZeRO-3) PartitionSpecs: each weight stored sharded at rest over ``axis``.

    Each 2-D ``kernel`` / ``weight`` leaf (float or QArray, told apart by name as
    :func:`jax_fp4.nn.quantize_params` does) is split along its output features (the axis
    it is not contracted on) where they divide over ``axis``' devices -- for a QArray the
    rows of ``data``, ``scales`` and ``zeros`` (:func:`qarray_partition_specs`), whole
    128-row tiles for a prepared (``"tiled"``) weight. Every other leaf gets ``default``.
    Gather the weights just before use with :func:`gather_weights`: a QArray is gathered
    as its packed leaves (4-bit codes and scales: about 4x fewer bytes than bf16).

    Args:
      tree: parameter pytree with float arrays or QArrays.
      mesh: the Mesh (or AbstractMesh) ``axis`` belongs to (for the sizes).
      axis: mesh axis name (or tuple of names) to shard over.
      default: spec for every other leaf (None: replicated).
    Returns:
      pytree of tree's structure with PartitionSpec leaves (QArrays of specs for QArrays).
    """
    from .layout import TILE_ROWS
    from .tree_paths import contraction_axis, path_str

    n = _axes_size(mesh, axis)

    def spec(path, leaf):
        k = contraction_axis(path_str(path))
        out = default
        if k is not None and getattr(leaf, "ndim", None) == 2:
            rows = leaf.shape[1 - k]
            tiled = isinstance(leaf, QArray) and leaf.scale_layout == "tiled"
            if rows % (n * (TILE_ROWS if tiled else 1)) == 0:
                entries = [None, None]
                entries[1 - k] = axis
                out = P(*entries)
        return qarray_partition_specs(out, leaf) if isinstance(leaf, QArray) else out

    return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=lambda x: isinstance(x, QArray))


def gather_weights(tree, mesh=None, specs=None):
    """FSDP's all-gather at use: ``tree``'s arrays laid out as ``specs`` (default: replicated).

    Call it inside ``jax.jit`` on weights stored sharded (:func:`fsdp_specs`) just before
    the layer that uses them; XLA schedules the all-gathers (on GPU asynchronously,
    overlapping earlier layers' compute). A QArray is constrained leaf by leaf, so its
    packed ``data`` (uint8, K*bits/8 bytes per row), ``scales`` and ``zeros`` are what
    cross the interconnect, never a dequantized float weight: 4-bit weights move about
    4x fewer bytes than bf16 ones (NVFP4: 4.5 bits per element with its E4M3 scales).

    Args:
      tree: pytree of arrays and QArrays (a layer's parameters, or the whole model's).
      mesh: the Mesh of the specs; None: the context mesh (``jax.set_mesh``).
      specs: the layout to gather to, a spec pytree of tree's structure (e.g.
        :func:`tensor_parallel_specs` to gather the FSDP axis only and keep the tensor-
        parallel split), or None: every leaf replicated.
    Returns:
      ``tree`` with each leaf passed through :func:`with_out_sharding` to its spec
      (``with_sharding_constraint`` on Auto mesh axes, ``reshard`` on Explicit ones).
    Raises:
      ValueError: specs does not have tree's structure (from ``jax.tree.map``).
    """
    def named(s):
        s = P() if s is None else s
        return s if mesh is None else NamedSharding(mesh, s)

    if specs is None:
        return jax.tree.map(lambda x: with_out_sharding(x, named(P())), tree)
    target = jax.tree.map(lambda s: jax.tree.map(named, s) if isinstance(s, QArray)
                          else named(s), specs, is_leaf=_is_spec_leaf)
    return jax.tree.map(with_out_sharding, tree, target)


def with_out_sharding(y, out_sharding):
    """``y`` laid out as ``out_sharding`` (the ``out_sharding=`` of ``lax.dot_general``).

    Args:
      y: array.
      out_sharding: None (``y`` unchanged), a NamedSharding, or a PartitionSpec under a
        mesh context (``jax.set_mesh``).
    Returns:
      ``jax.sharding.reshard(y, out_sharding)`` where the mesh has Explicit axes (the
      sharding becomes part of y's type), ``jax.lax.with_sharding_constraint`` where all
      its axes are Auto.
    """
    if out_sharding is None:
        return y
    mesh = (out_sharding.mesh if isinstance(out_sharding, NamedSharding)
            else jax.sharding.get_abstract_mesh())
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return jax.lax.with_sharding_constraint(y, out_sharding)
    return jax.sharding.reshard(y, out_sharding)


# XLA's collectives (jax-fp4's in-graph all-reduce is a custom call to all_reduce.TARGET)
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute")
# one HLO instruction: "%name = TYPE opcode(...": the opcode is the first word followed by
# "(" after the result type (a type never holds one: "f32[8]{0}", "(f32[], u32[])")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (:func:`collectives`).

    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
      "collective-permute", or "in-graph all-reduce" (jax-fp4's own all-reduce of
      row-parallel partial sums on the GPUs of one process, a custom call to
      ``jax_fp4_all_reduce_v1``: docs/sharding.md).
    type: its result per device as the HLO text prints it, e.g. ``"f32[16,128]{1,0}"``,
      or a tuple ``"(u8[64,256]{1,0}, f32[])"`` where XLA's combiners merged several
      arrays into one op; for an asynchronous one the result of its ``-done`` half (an
      all-gather's gathered array).
    """
    kind: str
    type: str

    @property
    def arrays(self) -> tuple:
        """((dtype name as HLO spells it, shape), ...) of the result, e.g. (("f32", (16,
        128)),)."""
        return tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                     for dt, dims in _ARRAY.findall(self.type))

    @property
    def nbytes(self) -> int:
        """Bytes of the result per device (pred 1 byte an element, u4 / s4 half)."""
        total = 0
        for dt, shape in self.arrays:
            bits = 8 if dt == "pred" else int(re.search(r"\d+", dt).group())
            total += math.prod(shape) * bits // 8
        return total


def collectives(program: Union[str, Any]) -> list:
    """The collectives of a compiled program, each once, in the order the HLO text lists
    them: what a sharded step communicates (docs/sharding.md, "Checking for
    communication").

    Args:
      program: a compiled function (``jax.jit(f).lower(*args).compile()``) or its HLO text
        (``.as_text()``).
    Returns:
      list of :class:`Collective`. An asynchronous collective counts once, at its
      ``-done`` half (``all-reduce-start`` / ``all-reduce-done``), or once as the plain op
      inside the computation that XLA's generic ``async-start`` wraps; each op is
      listed once per place in the program text (a collective inside a loop body once).
    Raises:
      TypeError: ``program`` is neither a string nor has ``as_text()``.
    """
    if not isinstance(program, str):
        if not callable(getattr(program, "as_text", None)):
            raise TypeError(f"collectives: program must be a compiled function (with "
                            f"as_text()) or its HLO text, got {type(program).__name__}")
        program = program.as_text()
    found = []
    for line in program.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        type_, op = m.groups()
        if op.endswith("-start"):
            continue
        kind = op[:-len("-done")] if op.endswith("-done") else op
        if kind in _COLLECTIVES:
            found.append(Collective(kind, type_))
        elif op == "custom-call" and f'custom_call_target="{all_reduce.TARGET}"' in line:
            found.append(Collective("in-graph all-reduce", type_))
    return found
