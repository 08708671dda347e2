"""Elementwise functions written out op by op on the stream (stream.py): GELU as 0.5·x·(1 + tanh(c·(x + 0.044715·x³)))
(ALBERT's and FNet's gelu_new), x·sigmoid(x), … A region of same-shape ops whose only tensor input is one stream
tensor x and whose other operands are numbers or one-element constants computes y = f(x) coordinate by coordinate.
Whether it does, and whether f(0) = 0 (so a zero new coordinate stays zero), is decided by running the region on probe
values, never by the ops' names: an op that mixes coordinates (a softmax, a sum) changes other outputs when one input
moves, and is no part of such a function.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from ..graph.fx_edit import from_input, tensor_shape

MAX_NODES = 64  # a written-out activation has a dozen ops; a larger region is not looked for


def region(r: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, the region's nodes in graph order) when `r` = f(x) elementwise (probed) through call_function/method ops of
    `r`'s shape, x one tensor of that shape; None otherwise."""
    shape = tensor_shape(r)
    if shape is None or r.op not in ("call_function", "call_method"):
        return None
    inside: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [r]
    while todo:
        n = todo.pop()
        if n in inside or n in leaves:
            continue
        if n is not r and (n.op not in ("call_function", "call_method") or tensor_shape(n) != shape):
            leaves.add(n)
            continue
        inside.add(n)
        if len(inside) > MAX_NODES:
            return None
        for a in n.all_input_nodes:
            if tensor_shape(a) == shape:
                todo.append(a)
            elif not _constant(a):
                return None
    wide = [a for a in leaves if tensor_shape(a) == shape]
    if len(wide) != 1 or any(u not in inside for n in inside - {r} for u in n.users):
        return None
    nodes = [n for n in r.graph.nodes if n in inside]
    return (wide[0], nodes) if _elementwise(wide[0], nodes, r) else None


def one_op(n: fx.Node) -> fx.Node | None:
    """x when `n` alone (a call on x and numbers) is an elementwise function of its input x, of its shape (probed),
    else None: what `region` finds when the ops before `n` are views of other shapes."""
    x = n.args[0] if n.op in ("call_function", "call_method") and n.args else None
    if not isinstance(x, fx.Node) or tensor_shape(x) != tensor_shape(n) or tensor_shape(n) is None:
        return None
    if any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
        return None
    return x if _elementwise(x, [n], n) else None


def zero_at_zero(x: fx.Node, nodes: list[fx.Node], r: fx.Node) -> bool:
    """Whether the region's f(0) = 0."""
    out = _run(x, nodes, r, torch.zeros(3))
    return out is not None and bool((out == 0).all())


def _constant(a: fx.Node) -> bool:
    shape = tensor_shape(a)
    return shape is not None and all(d == 1 for d in shape) and not from_input(a)


def _elementwise(x: fx.Node, nodes: list[fx.Node], r: fx.Node) -> bool:
    """Output i depends on input i alone: moving one input coordinate moves that output only (probed twice)."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, generator=g)
    base = _run(x, nodes, r, v)
    if base is None or base.shape != v.shape:
        return False
    for i in (0, 3):
        w = v.clone()
        w[i] += 0.5
        moved = _run(x, nodes, r, w)
        others = [j for j in range(4) if j != i]
        if moved is None or not torch.equal(moved[others], base[others]):
            return False
    return True


def _run(x: fx.Node, nodes: list[fx.Node], r: fx.Node, value: torch.Tensor) -> torch.Tensor | None:
    """The region evaluated with x = `value` (a vector; one-element constants are computed from the graph's own
    parameters, read as they are)."""
    gm = r.graph.owning_module
    env: dict[fx.Node, object] = {x: value.to(_dtype(x))}

    def get(a):
        if isinstance(a, fx.Node):
            if a not in env:
                env[a] = _value(gm, a, env)
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(get(b) for b in a)
        return a

    try:
        with torch.no_grad():
            for n in nodes:
                args, kwargs = get(n.args), {k: get(v) for k, v in n.kwargs.items()}
                if n.op == "call_method":
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    env[n] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a region that does not run on a vector is not an elementwise function
        return None
    out = env.get(r)
    return out.float() if isinstance(out, torch.Tensor) else None


def _value(gm, a: fx.Node, env: dict) -> object:
    """A one-element constant's value: a parameter or buffer, or computed from such (its inputs first)."""
    if a.op == "get_attr":
        t = gm
        for part in str(a.target).split("."):
            t = getattr(t, part)
        return t.detach() if isinstance(t, torch.Tensor) else t
    if a.op in ("call_function", "call_method"):
        args = fx.node.map_arg(a.args, lambda b: env.setdefault(b, _value(gm, b, env)))
        kwargs = fx.node.map_arg(a.kwargs, lambda b: env.setdefault(b, _value(gm, b, env)))
        if a.op == "call_method":
            return getattr(args[0], a.target)(*args[1:], **kwargs)
        return a.target(*args, **kwargs)
    raise ValueError(f"no value for {a.name}")


def _dtype(x: fx.Node) -> torch.dtype:
    dtype = x.meta.get("gg_dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def region_root(x: fx.Node, u: fx.Node) -> fx.Node | None:
    """The last op r downstream of `u` (a user of x) such that r = f(x) elementwise through `u`, f(0) = 0."""
    shape, seen, todo = tensor_shape(u), list[fx.Node](), [u]
    while todo and len(seen) <= MAX_NODES:
        n = todo.pop()
        if n in seen or tensor_shape(n) != shape or n.op not in ("call_function", "call_method"):
            continue
        seen.append(n)
        todo.extend(n.users)
    order = {n: i for i, n in enumerate(u.graph.nodes)}
    for r in sorted(seen, key=order.__getitem__, reverse=True):
        found = region(r)
        if found is not None and found[0] is x and u in found[1] and zero_at_zero(*found, r):
            return r
    return None


def scales_tokens(m: torch.nn.Module, shape: tuple, width: int, flags: int = 0, rest: tuple = (), at: int = 0) -> bool:
    """Whether module `m` maps x to s·x, s one number per token and per draw, the same at any width (drop-path,
    stochastic depth: identity in eval mode, a per-sample scale in train mode, whatever its class is called). Probed
    on x and on x with 3 more coordinates under one seed, in both modes; the hidden axis is x's last of that size.
    `flags`: m is called as m(*flags, x) (a ModeSwitch: export's drop-path, its flag the module's `training`), probed
    for every value of the flags; `rest`: numbers it also takes, x at place `at` among them (timm's drop-path as a
    switch: m(*flags, x, keep_prob))."""
    axis = max((i for i, d in enumerate(shape) if d == width), default=None)
    if axis is None or any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.rand(shape, generator=g) + 1.0
    wide = torch.cat([x, torch.rand((*shape[:axis], 3, *shape[axis + 1 :]), generator=g) + 1.0], axis)
    was = m.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for mode in itertools.product((False, True), repeat=max(flags, 1)):
                m.train(mode[0])
                torch.manual_seed(1)
                y = m(*mode[:flags], *rest[:at], x, *rest[at:])
                torch.manual_seed(1)
                yw = m(*mode[:flags], *rest[:at], wide, *rest[at:])
                if not (isinstance(y, torch.Tensor) and isinstance(yw, torch.Tensor)) or yw.shape != wide.shape:
                    return False
                s = (yw / wide).amax(axis, keepdim=True)
                if not (torch.allclose(yw, s * wide) and torch.allclose(y, s * x)):
                    return False
        return True
    except Exception:  # noqa: BLE001 - a module that fails on the probe is not such a scale
        return False
    finally:
        m.train(was)


def number_of(gm: torch.fx.GraphModule, a: object) -> object:
    """`a` as a Python number when it is one or is computed from the model's constants alone (1 - drop_prob, read as
    an attribute), else None."""
    if isinstance(a, (int, float)):
        return a
    try:
        value = _value(gm, a, {}) if isinstance(a, fx.Node) and tensor_shape(a) is None else None
    except Exception:  # noqa: BLE001 - not computable from constants: no number
        return None
    return value if isinstance(value, (int, float)) else None
