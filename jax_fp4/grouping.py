"""Grouped W4A16 calls: :func:`group_matmuls`, a function transformation that runs the
W4A16 matmuls sharing one activation -- a transformer layer's q / k / v projections,
its gate / up projections -- as one call of ``wmatmul_group_p``
(:mod:`jax_fp4.prims.wmatmul_group`).

Why. At decode sizes a W4A16 kernel moves a few MB in a few microseconds, so each call's
fixed start-up (the first loads' round trip, the graph node XLA re-records and launches
every step) is a large part of it. Models that store q / k / v or gate / up fused
(vLLM's QKVParallelLinear, MaxText's fused_qkv) pay it once per group; models written
with separate projections -- Llama in Flax or Equinox, most checkpoints -- pay it per
projection. The transformation gives the second kind the first kind's launches without
changing the model's parameters or code.

How. The function is traced to a jaxpr; in it (and in the jaxprs of nested ``jit``,
``scan``, ``while``, ``cond``, ``remat``, custom-derivative calls), W4A16 calls
(``wmatmul_p``, what :func:`jax_fp4.dot_general` / :func:`jax_fp4.matmul` bind for a 2-D
QArray weight) with the same activation (the same variable, or one computed from it
the same way, e.g. cast to the same dtype again) and the same parameters (format, block
size, layout, output dtype, precision) are grouped, up to 4 a group, in the order they
appear, where every member's weight can be computed at the first member's place (the
casts and reshapes before each call move there); the jaxpr is then evaluated with one
group call in the first member's place. The results are the
same up to the summation order of the kernels' K-splits (the W4A16 tolerance,
docs/spec.md section 5); on a backend without the grouped kernel each member runs as
before.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax.extend import core

from .prims.wmatmul import _MAX_GROUP, wmatmul_p
from .prims.wmatmul_group import wmatmul_group_p

__all__ = ["group_matmuls"]


def group_matmuls(fun):
    """``fun`` with its W4A16 calls that share an activation run as one call each.

    Use it inside the ``jit`` (or around the function you jit)::

        step = jax.jit(jax_fp4.group_matmuls(decode_step))

    Args:
      fun: a function of arrays and pytrees of arrays (QArray weights included); leaves
        that are not arrays (Python numbers, strings, None) are passed through unchanged,
        as static values.
    Returns:
      a function with ``fun``'s signature and results (the same pytree structure, shapes
      and dtypes). Differentiable as ``fun`` is (w.r.t. activations; QArray weights are
      constants of the W4A16 matmul, as in :func:`jax_fp4.dot_general`), and composable
      with ``jit``, ``vmap``, ``grad`` and sharding (the grouped call has the sharding
      rules of :mod:`jax_fp4.partitioning`).
    Raises:
      TypeError: ``fun`` is not callable.
    """
    if not callable(fun):
        raise TypeError(f"fun: expected a callable, got {type(fun).__name__}")

    @functools.wraps(fun)
    def grouped(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, v in enumerate(leaves) if _is_array(v)]

        def flat_fun(*values):
            full = list(leaves)
            for i, v in zip(dynamic, values):
                full[i] = v
            a, k = jax.tree.unflatten(tree, full)
            return fun(*a, **k)

        values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*values)
        outs = _eval(closed.jaxpr, closed.consts, values)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return grouped


def _is_array(v):
    return isinstance(v, (jax.Array, np.ndarray, np.generic))


def _groups(jaxpr):
    """The jaxpr's groups: ({index of a group's first member: [indices of its members]},
    {index of a group's first member: indices of the equations that compute its later
    members' weights after that place, in order}). A call joins an open group of its key
    (activation variable, parameters) where its weights need no equation at or after the
    group's first member other than pure, non-matmul ones that need none of those either
    (the weights' casts and reshapes that :func:`jax_fp4.dot_general` emits before each
    call): they are evaluated first, in the group's place (hoisted)."""
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    same = _same_values(jaxpr)
    open_groups, groups, hoists = {}, {}, {}

    def needed(atoms, first, acc):
        """The equations after `first` that `atoms` need, into acc; False if they need
        the group's first member or an equation that may not move."""
        for v in atoms:
            if isinstance(v, core.Literal):
                continue
            i = producer.get(v, -1)
            if i < first or i in acc:
                continue
            eqn = jaxpr.eqns[i]
            if i == first or eqn.primitive is wmatmul_p or eqn.effects:
                return False
            if not needed(eqn.invars, first, acc):
                return False
            acc.add(i)
        return True

    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is not wmatmul_p or isinstance(eqn.invars[0], core.Literal):
            continue
        key = (same.get(eqn.invars[0], eqn.invars[0]), tuple(sorted(eqn.params.items())))
        g = open_groups.get(key)
        acc = set(hoists.get(g[0], ())) if g else set()
        if g is not None and needed(eqn.invars[1:], g[0], acc):
            g.append(i)
            hoists[g[0]] = acc
            if len(g) == _MAX_GROUP:
                del open_groups[key]
        else:
            open_groups[key] = groups[i] = [i]
    groups = {i: g for i, g in groups.items() if len(g) > 1}
    return groups, {i: sorted(hoists.get(i, ())) for i in groups}


def _same_values(jaxpr):
    """{variable: the first variable computed the same way}: equations of one primitive,
    parameters and (so mapped) operands compute the same values where they are pure. So
    the activation each layer casts or reshapes again before its call (a Flax layer's
    dtype promotion, dot_general's view of x as rows) counts as one activation."""
    same, first = {}, {}

    def atom(v):
        if isinstance(v, core.Literal):
            return ("literal", np.asarray(v.val).tobytes(), str(v.aval))
        return same.get(v, v)

    for eqn in jaxpr.eqns:
        if eqn.effects or any(True for _ in _subjaxprs(eqn.params)):
            continue
        try:
            key = (eqn.primitive, tuple(sorted(eqn.params.items())),
                   tuple(atom(v) for v in eqn.invars))
            hash(key)
        except TypeError:  # a parameter that is not hashable (an array): not compared
            continue
        if key in first:
            same.update(zip(eqn.outvars, first[key]))
        else:
            first[key] = eqn.outvars
    return same


def _has_group(jaxpr):
    """Whether the jaxpr, or a jaxpr inside one of its equations, has a group."""
    if _groups(jaxpr)[0]:
        return True
    return any(_has_group(sub) for eqn in jaxpr.eqns for sub in _subjaxprs(eqn.params))


def _subjaxprs(params):
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _avals_args(avals):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in avals]


def _transform_closed(closed):
    if not _has_group(closed.jaxpr):
        return closed
    fn = functools.partial(_eval, closed.jaxpr, closed.consts)
    return jax.make_jaxpr(lambda *a: fn(list(a)))(*_avals_args(closed.in_avals))


def _transform_open(jaxpr):
    """An open jaxpr (no constants, e.g. remat's) transformed, where the result needs no
    constants either; else the jaxpr as it is."""
    if jaxpr.constvars or not _has_group(jaxpr):
        return jaxpr
    closed = _transform_closed(core.ClosedJaxpr(jaxpr, []))
    return closed.jaxpr if not closed.consts else jaxpr


def _transform_params(params):
    out = {}
    for k, v in params.items():
        if isinstance(v, core.ClosedJaxpr):
            v = _transform_closed(v)
        elif isinstance(v, core.Jaxpr):
            v = _transform_open(v)
        elif isinstance(v, tuple) and v and all(isinstance(b, core.ClosedJaxpr) for b in v):
            v = tuple(_transform_closed(b) for b in v)
        out[k] = v
    return out


def _eval(jaxpr, consts, args):
    """``jax.core.eval_jaxpr`` with each group bound as one ``wmatmul_group_p`` call in its
    first member's place, and nested jaxprs transformed the same way."""
    env = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    def run(eqn):
        with eqn.ctx.manager if hasattr(eqn, "ctx") else contextlib.nullcontext():
            bind_params = eqn.primitive.get_bind_params(_transform_params(eqn.params))
            subfuns = []
            if isinstance(bind_params, tuple):  # (subfuns, params) on older jax
                subfuns, bind_params = bind_params
            ans = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, ans):
                env[v] = x
        else:
            env[eqn.outvars[0]] = ans

    groups, hoists = _groups(jaxpr)
    done = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if i in done:
            continue
        if i not in groups:
            run(eqn)
            continue
        for j in hoists[i]:
            run(jaxpr.eqns[j])
        members = [jaxpr.eqns[j] for j in groups[i]]
        with eqn.ctx.manager if hasattr(eqn, "ctx") else contextlib.nullcontext():
            outs = wmatmul_group_p.bind(
                read(eqn.invars[0]), *(read(v) for m in members for v in m.invars[1:]),
                **eqn.params)
        for m, y in zip(members, outs):
            env[m.outvars[0]] = y
        done.update(groups[i][1:], hoists[i])
    return [read(v) for v in jaxpr.outvars]
