"""The residual stream of a transformer: every tensor that carries its hidden size, who writes it, who reads it,
and the norms on it — what growing the hidden size (grow_hidden) must change, found from the graph.

The stream is grown from its norms (LayerNorm, RMSNorm, F.layer_norm, F.rms_norm over the last dimension, of the
width of the model's last such norm, its final norm): from each tensor on it the analysis walks to its producer
and to its users, following the hidden axis through ops that act on every hidden coordinate alike and linearly
(adds of stream tensors, a `cat` or `stack` along the tokens, dropout, identities, scalar multiples, views,
transposes, token selection and pooling, products and Linear maps over other axes: stream_channels). It stops
at *writers* (a Linear's or conv's output rows, an Embedding's columns, a parameter tensor such as a position
embedding or class token) and *readers* (a Linear's input columns). Anything else touching the stream is refused
with the node and the reason: a pass never guesses.

New hidden coordinates get one *fill* per stream tensor: `mean` (each new coordinate equals the mean of the old
ones: what a LayerNorm's input needs) or `zero` (what an RMSNorm's input and every norm's output need — a norm's new
outputs are its β = 0). Tensors joined by adds, views and the like share a fill; a norm separates its input from its
output. When one tensor needs both (a post-norm stream: BERT, nn.TransformerEncoder with norm_first=False, where a
LayerNorm's output is added to a sublayer's output that feeds the next LayerNorm) `conflict` says where, and only
replicating every coordinate equally (an integer factor) stays exact.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import computed_from, tensor_shape
from .stacked import stacked_product, weight_axes
from .stream_blocks import FlatRead, flat_readers, query_reader
from .stream_channels import ChannelOp, across_others, channel_op, shared_factors
from .stream_joins import cat_readers, is_add, is_cat, operand_axis, operands, split_source, tuple_element, user_axis
from .stream_joins import is_stack as _is_stack
from .stream_joins import piece_axis as _piece_axis
from .stream_joins import stream_product as _stream_product
from .stream_norms import Norm
from .stream_norms import norm_of as _norm_of
from .stream_norms import normalised as _normalised
from .stream_ops import (
    EXTREMA_WITH_INDICES,
    FLAT_AT_ZERO,
    averages_over,
    base_name,
    constant_like,
    drops_axis_by_index,
    extremum,
    fourier_along,
    value_free_read,
)
from .stream_ops import arg as _arg
from .stream_ops import forward_axis as _forward_axis
from .stream_ops import input_axis as _input_axis
from .stream_ops import token_scale as _token_scale
from .stream_ops import zero_activation_input as _zero_activation_input
from .stream_parts import Reader, Stream, Writer, kept_whole, linear_reader, recurrent_reader
from .stream_parts import refuse as _refuse
from .stream_parts import what as _what
from .stream_regions import region, region_root, zero_at_zero
from .stream_through import through

EMBEDDINGS = (F.embedding, torch.embedding)  # F.embedding(input, weight, …), torch.embedding(weight, input, …)
SHAPE_QUERIES = ops.SHAPE_QUERIES
VIEWS = ops.RESHAPES | {"expand", "new_zeros"}  # their shape arguments name the width: grown with it


def find_stream(gm: fx.GraphModule) -> Stream:
    """The residual stream of an annotated graph (shapes from shapes.annotate); NotApplicable when there is none
    or when something on it is not understood."""
    nodes = {n.name: n for n in gm.graph.nodes}
    norms = [n for n in gm.graph.nodes if _norm_of(gm, n) is not None and _normalised(gm, n)]
    if not norms:
        raise NotApplicable(
            "the model has no LayerNorm or RMSNorm over a last dimension: no residual stream found",
            "grow_hidden grows a transformer's stream; widen other layers with grow_width",
        )
    # the last norm the outputs depend on (a final norm) is on the stream; q/k norms over heads are not. A branch the
    # output never reads may be kept in the graph for its random draws (CANINE's unused final encoder): its norms run
    # but cannot be the final norm
    live = computed_from(next(n for n in gm.graph.nodes if n.op == "output"))
    final = [n for n in norms if n in live]
    if not final:
        raise NotApplicable(
            "no LayerNorm or RMSNorm over a last dimension reaches the model's outputs: no residual stream found",
            "grow_hidden grows a transformer's stream; widen other layers with grow_width",
        )
    norms = [n for n in norms if n is not final[-1]] + [final[-1]]
    width = _normalised(gm, norms[-1])
    stream = Stream(width, {})
    walk = _Walk(gm, stream, nodes)
    walk.inner |= {nodes[v] for m in norms for v in _norm_of(gm, m).inner}  # type: ignore[union-attr]  # written out
    # the final norm's stream, then each other norm of that width with its own tensors unless they are not understood:
    # a norm inside a block whose inner width happens to equal the hidden size (BitNet's attention sub-norm) is not
    # on the stream, and a component the walk never reached from the final norm grows or stays as a whole
    off = []
    for n in [norms[-1]] + [m for m in norms[:-1] if _normalised(gm, m) == width]:
        if n.name not in stream.axes:
            saved = walk.snapshot()
            try:
                walk.add(n.args[0], len(tensor_shape(n.args[0])) - 1)
                walk.run()
            except NotApplicable:
                if n is norms[-1]:
                    raise
                walk.restore(saved)
                off.append(n)
    on = {_norm_of(gm, nodes[m.node]).module or m.weight for m in stream.norms} - {None}  # type: ignore[union-attr]
    for n in off:
        if (n.target if n.op == "call_module" else _norm_of(gm, n).weight) in on:  # type: ignore[union-attr]
            raise _refuse(n, "normalises tensors off the stream with a norm the stream also uses")
    walk.check()
    stream.fill, stream.conflict = walk.fills()
    bare = next((m.node for m in stream.norms if m.weight is None and not m.l2), None)
    if stream.conflict is None and bare is not None:  # only replication keeps its outputs (rewrite/stream._grow_norm)
        stream.fill, stream.conflict = {}, f"'{bare}' is a norm without a weight: none absorbs the factor its old "
        stream.conflict += "outputs change by when the new coordinates are 0"
    sphere = next((m.node for m in stream.norms if m.l2), None)
    if stream.conflict is not None and sphere is not None:  # a sum of squares: replication multiplies it
        raise _refuse(
            nodes[sphere],
            f"divides by the norm of the whole vector, which only zero new coordinates keep, and {stream.conflict}",
        )
    return stream


class _Walk:
    """The worklist over stream tensors, with a union-find of tensors that share a fill."""

    def __init__(self, gm: fx.GraphModule, stream: Stream, nodes: dict[str, fx.Node]):
        self.gm, self.s, self.nodes = gm, stream, nodes
        self.todo: list[fx.Node] = []
        self.parent: dict[str, str] = {}
        self.needs: dict[str, str] = {}  # tensor → the fill a norm needs there
        self.why: dict[str, str] = {}
        self.done_users: set[str] = set()
        self.inner: set[fx.Node] = set()  # the ops inside a written-out activation (stream_regions): not followed

    # --- bookkeeping ---
    SAVED = ("axes", "writers", "readers", "norms", "grouped", "eps", "read_views")  # the Stream's findings

    def snapshot(self) -> tuple:
        walk = (dict(self.parent), dict(self.needs), set(self.done_users), set(self.inner))
        return tuple(copy.copy(getattr(self.s, f)) for f in self.SAVED) + walk

    def restore(self, saved: tuple) -> None:
        """Back to a snapshot (the tensors a refused component added are no part of the stream)."""
        for f, value in zip(self.SAVED, saved, strict=False):
            setattr(self.s, f, value)
        self.parent, self.needs, self.done_users, self.inner = saved[len(self.SAVED) :]
        self.todo = []

    def add(self, n: fx.Node, axis: int, like: fx.Node | None = None) -> None:
        shape = tensor_shape(n)
        if shape is None or shape[axis] != self.s.width:
            raise _refuse(n, f"does not keep the hidden size {self.s.width} at its axis {axis} (shape {shape})")
        old = self.s.axes.get(n.name)
        if old is not None and old != axis:
            raise _refuse(n, f"carries the hidden size on two axes ({old} and {axis})")
        self.parent.setdefault(n.name, n.name)
        if like is not None:
            self.join(n, like)
        if old is None:
            self.s.axes[n.name] = axis
            self.todo.append(n)

    def find(self, a: str) -> str:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def join(self, a: fx.Node, b: fx.Node) -> None:
        self.parent.setdefault(a.name, a.name)
        self.parent.setdefault(b.name, b.name)
        self.parent[self.find(a.name)] = self.find(b.name)

    def need(self, n: fx.Node, fill: str, why: str) -> None:
        self.needs.setdefault(n.name, fill)
        if self.needs[n.name] != fill:
            self.needs[n.name] = "both"
        self.why[f"{n.name}:{fill}"] = why

    def run(self) -> None:
        while self.todo:
            n = self.todo.pop()
            self.producer(n)
            for u in list(n.users):
                self.user(n, u)

    def fills(self) -> tuple[dict[str, str], str | None]:
        """One fill per class of tensors; the first class that needs both is the conflict."""
        classes: dict[str, dict[str, str]] = {}
        for name, fill in self.needs.items():
            for f in ("mean", "zero") if fill == "both" else (fill,):
                classes.setdefault(self.find(name), {}).setdefault(f, name)
        for need in classes.values():
            if len(need) == 2:
                a, b = need["mean"], need["zero"]
                return {}, (
                    f"'{a}' must have new coordinates equal to the mean of the old ones ({self.why[f'{a}:mean']}) "
                    f"and '{b}', joined with it through adds, zero ({self.why[f'{b}:zero']})"
                    + (": a post-norm stream" if "LayerNorm" in self.why[f"{a}:mean"] else "")
                )
        return {t: next(iter(classes.get(self.find(t), {"zero": t}))) for t in self.s.axes}, None

    # --- rules ---
    def producer(self, n: fx.Node) -> None:
        axis = self.s.axes[n.name]
        norm = _norm_of(self.gm, n)
        if norm is not None:
            return self.norm(n, norm)
        if n.op == "placeholder":
            raise _refuse(n, "is the model's input (the hidden size is fixed by the caller)")
        if n.op == "get_attr":
            return self.writer(n, "tensor", [(str(n.target), axis)])
        if n.op == "call_module":
            m = self.gm.get_submodule(n.target)
            if isinstance(m, nn.Linear) and axis == len(tensor_shape(n)) - 1:
                return self.writer(
                    n, "linear", [(f"{n.target}.weight", 0)] + ([(f"{n.target}.bias", 0)] if m.bias is not None else [])
                )
            if isinstance(m, nn.modules.conv._ConvNd) and m.groups == 1 and axis == 1:
                return self.writer(
                    n, "conv", [(f"{n.target}.weight", 0)] + ([(f"{n.target}.bias", 0)] if m.bias is not None else [])
                )
            if isinstance(m, nn.Embedding) and axis == len(tensor_shape(n)) - 1:
                if m.max_norm is not None:
                    raise _refuse(n, "renormalises its rows (max_norm): a wider row has another norm")
                return self.writer(n, "embedding", [(f"{n.target}.weight", 1)])
        if n.op == "call_function" and n.target in EMBEDDINGS and axis == len(tensor_shape(n)) - 1:
            # an Embedding written as a call on a weight tensor (export's form of a subclass's forward; Gemma's and
            # Blenderbot's scaled embeddings read the tied LM head's weight this way): its columns write the stream
            weight = _arg(n, 1, "weight") if n.target is F.embedding else _arg(n, 0, "weight")
            if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
                raise _refuse(n, "takes its weight from a computed tensor")
            if n.target is F.embedding and _arg(n, 3, "max_norm") is not None:
                raise _refuse(n, "renormalises its rows (max_norm): a wider row has another norm")
            return self.writer(n, "embedding", [(str(weight.target), 1)])
        if n.op == "call_function" and n.target is F.linear and axis == len(tensor_shape(n)) - 1:
            given = [_arg(n, 1, "weight"), _arg(n, 2, "bias")]  # by position or by name (F.linear(x, weight=…))
            params = [(a.target, 0) for a in given if isinstance(a, fx.Node)]
            if any(a.op != "get_attr" for a in given if isinstance(a, fx.Node)):
                raise _refuse(n, "takes its weight from a computed tensor")
            return self.writer(n, "linear", params)
        piece = split_source(n)
        if piece is not None:
            if _piece_axis(n, axis, back=True) is None:
                raise _refuse(n, "is a piece of a split along the hidden axis")
            return self.add(piece[0], _piece_axis(n, axis, back=True), like=n)  # type: ignore[arg-type]
        if tuple_element(n) is not None:  # ((x,) + rest)[0] is x
            return self.add(tuple_element(n), axis, like=n)  # type: ignore[arg-type]
        if is_add(n) or is_cat(n) or _is_stack(n):
            for a in operands(n):
                self.add(a, operand_axis(n, a, axis, self.s.width), like=n)
            return
        if _zero_activation_input(self.gm, n) is not None:
            return self.activation(n.args[0], n)
        product = stacked_product(self.gm, n)
        if product is not None:  # one Linear per expert (analysis.stacked): its output rows write the stream
            if axis != product.y_axis:
                raise _refuse(n, f"carries the hidden axis along a batch axis of a product with '{product.weight}'")
            return self.writer(n, "stacked", [(product.weight, product.out_axis)])
        scaled = _token_scale(n, axis, self.s.width)
        if scaled is not None:
            return self.add(scaled[0], scaled[1], like=n)
        table = weight_axes(self.gm, n)  # a parameter or buffer gathered by indices (a position table[positions])
        at = table[1][axis] if table is not None and None in table[1] else None
        if table is not None and at is not None:
            return self.writer(n, "tensor", [(table[0], at)])
        channel = channel_op(self.gm, n, axis, self.s.width)
        if channel is not None:
            return self.channelwise(n, axis, channel)
        x = through(self.gm, n, self.s.width)
        if x is not None:
            back = _input_axis(n, x, axis, self.s.width)
            if back is None:
                raise _refuse(n, "moves the hidden axis in a way the analysis cannot follow back")
            return self.add(x, back, like=n)
        found = region(n)  # an activation written out op by op (stream_regions)
        if found is not None and zero_at_zero(*found, n):
            self.inner |= set(found[1])
            return self.activation(found[0], n)
        if base_name(n) == "new_zeros":  # zeros in the stream's shape (an empty history): any fill; its size: views
            return None
        if fourier_along(n, axis):  # FNet mixes tokens and hidden coordinates by a 2-D DFT
            raise _refuse(n, "comes from a Fourier transform along the hidden axis: every output depends on the width")
        if (pair := _stream_product(n, axis, self.s.width)) is not None:
            return self.product(n, axis, pair)
        raise kept_whole(self.gm, n) or _refuse(n, "produces stream values the analysis does not understand")

    def user(self, x: fx.Node, u: fx.Node) -> None:
        key = f"{x.name}->{u.name}"
        if key in self.done_users:
            return
        self.done_users.add(key)
        axis = self.s.axes[x.name]
        if u.op == "output":
            raise _refuse(  # the model returns the stream (a backbone without a classifier): nothing reads it out
                x,
                "is a model output: the model returns the stream itself, so its hidden size is fixed by the "
                "output's shape (growing it would change what the model returns)",
            )
        if u in self.inner:
            return
        if (
            (u.op == "call_method" and u.target in SHAPE_QUERIES)
            or (u.op == "call_function" and u.target is getattr and u.args[1] in SHAPE_QUERIES)
            or value_free_read(u, x)
        ):
            return
        if constant_like(u, x):
            return self.constant(u, axis)
        if base_name(u) == "expand_as" and u.args[0] is not x:  # y.expand_as(x): x's shape, y's values (walked back)
            return self.add(u, axis)
        if averages_over(u, x, axis):  # CBAM's spatial attention reads the channels' mean (and max)
            return self.need(x, "mean", f"'{u.name}' averages over the hidden axis")
        norm = _norm_of(self.gm, u)
        if norm is not None and norm.input == x.name:
            if axis != len(tensor_shape(x)) - 1 or _normalised(self.gm, u) != self.s.width:
                raise _refuse(u, "normalises over more than the hidden axis")
            return self.add(u, axis)
        if (across := across_others(self.gm, u, axis, self.s.width)) is not None and across.x is x:
            return self.channelwise(u, axis, across)  # a Linear over the tokens
        is_linear = (u.op == "call_module" and isinstance(self.gm.get_submodule(u.target), nn.Linear)) or (
            u.op == "call_function" and u.target is F.linear
        )
        if (
            is_linear
            and _arg(u, 0, "input") is x
            and all(a is not x for a in list(u.args[1:]) + [v for k, v in u.kwargs.items() if k != "input"])
        ):
            return self.s.readers.append(linear_reader(u, x, axis))
        if (recurrent := recurrent_reader(self.gm, u, x, axis)) is not None:  # an LSTM's input features
            return self.s.readers.append(recurrent)
        conv = self.gm.get_submodule(u.target) if u.op == "call_module" else None
        if isinstance(conv, nn.modules.conv._ConvNd) and conv.groups == 1 and axis == 1 and u.args == (x,):
            return self.s.readers.append(Reader(u.name, [(f"{u.target}.weight", 1)], x.name))  # its input channels
        pieces = [g for g in u.users if split_source(g) is not None and split_source(g)[0] is x]  # type: ignore[index]
        if pieces and len(pieces) == len(u.users):  # x split along the tokens: every piece a stream tensor
            if _piece_axis(pieces[0], axis) is None:
                raise _refuse(u, "splits the stream along the hidden axis")
            for g in pieces:
                self.add(g, _piece_axis(g, axis), like=x)  # type: ignore[arg-type]
            return None
        if u.target is operator.add and isinstance(u.args[0], tuple):  # (x,) + rest: followed to its x = t[i]
            for g in u.users:
                if tuple_element(g) is x:
                    self.add(g, axis, like=x)
                elif not (base_name(g) == "getitem" and isinstance(g.args[1], int)):  # another element: not x
                    raise _refuse(g, "reads the stream out of a tuple in a way the analysis cannot follow")
            return None
        if is_cat(u) and _arg(u, 1, "dim", 0) % len(tensor_shape(u)) == axis:
            return self.cat_reader(u, axis)
        if is_add(u) or is_cat(u) or _is_stack(u):
            return self.add(u, user_axis(u, x, axis), like=x)
        if _zero_activation_input(self.gm, u) is x:
            return self.activation(x, u)
        product = stacked_product(self.gm, u)
        if product is not None and product.x is x:  # one Linear per expert: its input columns read the stream
            if axis != product.x_axis:
                raise _refuse(
                    u, f"multiplies the stream with '{product.weight}' along another axis than the hidden one"
                )
            return self.s.readers.append(Reader(u.name, [(product.weight, product.in_axis)], x.name))
        out = tensor_shape(u)
        if out is not None and _token_scale(u, axis + len(out) - len(tensor_shape(x)), self.s.width) == (x, axis):
            return self.add(u, axis + len(out) - len(tensor_shape(x)), like=x)
        ends = [u] if extremum(u) else list(u.users) if base_name(u) in EXTREMA_WITH_INDICES else []
        if ends and all(extremum(g) for g in ends):  # amax, or max's (values, indices) with the values read alone
            for g, (_, dims, keep) in ((g, extremum(g)) for g in ends):  # type: ignore[misc]
                if axis in dims:  # the old coordinates' mean lies between their extrema: a new one keeps them
                    self.need(x, "mean", f"'{g.name}' takes the extremum over the hidden axis")
                    continue
                self.add(g, axis if keep else axis - sum(d < axis for d in dims))
            return None
        channel = channel_op(self.gm, u, axis, self.s.width)
        if channel is not None and channel.x is x and channel.x_axis == axis:
            return self.channelwise(u, axis, channel)
        if (q := query_reader(u, x, axis, self.s.width)) is not None:  # a learned query dotted with the stream
            self.s.read_views += q[2]
            return self.s.readers.append(Reader(u.name, [(q[0], q[1])], x.name))
        flat = flat_readers(self.gm, u, x, axis, self.s.width)
        if flat is not None:  # the stream's copies flattened into one vector per token for Linear layers
            return self.flat_reader(x, flat)
        if through(self.gm, u, self.s.width) is x:
            a = _forward_axis(u, x, axis)
            if a is None:
                raise _refuse(u, "mixes the hidden axis with others (a reshape or index across it)")
            return self.add(u, a, like=x)
        if (pair := _stream_product(u, axis, self.s.width)) is not None and x in pair:
            return self.product(u, axis, pair)
        root = region_root(x, u)  # an activation written out op by op from x, u one of its ops
        if root is not None:
            self.inner |= set(region(root)[1])  # type: ignore[index]
            return self.activation(x, root)
        raise kept_whole(self.gm, u) or _refuse(
            u,
            "reads it in a way the analysis does not understand (only Linear layers, norms, adds, "
            "concatenation along the tokens, dropout, views and token selection are)",
        )

    def norm(self, n: fx.Node, norm: Norm) -> None:
        if norm.node in {m.node for m in self.s.norms}:
            return
        x = self.nodes[norm.input]
        if _normalised(self.gm, n) != self.s.width:
            raise _refuse(n, "normalises another width")
        self.s.norms.append(norm)
        self.add(x, len(tensor_shape(x)) - 1)
        kind = "an RMSNorm's input: its mean square" if norm.rms else "a LayerNorm's input: its mean and variance"
        kind = "an L2 norm's input: its sum of squares" if norm.l2 else kind
        self.need(x, "zero" if norm.rms else "mean", kind)
        self.need(n, "zero", "a norm's output: its new outputs are β = 0")

    def activation(self, x: fx.Node, n: fx.Node) -> None:
        """`n` = f(x) elementwise with f(0) = 0: new coordinates zero on both sides (or every coordinate replicated)."""
        axis = self.s.axes.get(x.name, self.s.axes.get(n.name))
        self.add(x, axis)
        self.add(n, axis)
        why = f"'{n.name}' is an elementwise activation: f(0) = 0, but not f(mean) = mean(f)"
        self.need(x, "zero", why)
        self.need(n, "zero", why)
        kind = type(self.gm.get_submodule(n.target)) if n.op == "call_module" else n.target
        if kind in FLAT_AT_ZERO:  # new units must be copies of old ones (replication), as on a post-norm stream
            self.need(
                n, "mean", f"'{n.name}' is a ReLU: a new unit held at 0 gets no gradient, a copy of an old one does"
            )

    def cat_reader(self, u: fx.Node, axis: int) -> None:
        """Stream tensors concatenated along the hidden axis for Linear layers alone (stream_joins.cat_readers)."""
        parts, linear = cat_readers(self.gm, u, axis, self.s.width)
        for a in parts:
            self.add(a, len(tensor_shape(a)) - 1, like=parts[0])
        for v in (v for v in linear if v.name not in {r.node for r in self.s.readers}):  # once, not per part
            self.s.readers.append(Reader(v.name, [(f"{v.target}.weight", 1)], parts[0].name, len(parts)))

    def flat_reader(self, x: fx.Node, flat: FlatRead) -> None:
        """Linear layers reading the stream's copies flattened side by side (stream_blocks): a block of columns each."""
        if flat.scaled:
            self.need(x, "zero", f"its {flat.blocks} copies flattened have a mean square (no other fill keeps it)")
        for v, path in (r for r in flat.linear if r[0].name not in {q.node for q in self.s.readers}):
            self.s.readers.append(Reader(v.name, [(path, 1)], x.name, flat.blocks, flat.scaled))
        self.s.eps += [e for e in flat.eps if e not in self.s.eps]

    def channelwise(self, n: fx.Node, axis: int, op: ChannelOp) -> None:
        """`n` = a per-channel op of the stream (stream_channels): new coordinates zero on both sides (or replicated);
        its factors grow with the stream (any value multiplies a zero: the old ones' mean), its shifts with zeros."""
        self.add(op.x, op.x_axis)
        self.add(n, axis, like=None if op.fills else op.x)  # no fill of its own: linear, alike for every channel
        why = f"'{n.name}' {op.why}"
        for fill in op.fills:  # zero and mean: replication alone
            self.need(op.x, fill, why)
            self.need(n, fill, why)
        for path, dim, kind in op.params:
            self.s.writers.append(Writer(n.name, kind, [(path, dim)], n.name, op.via))
        if op.groups and n.name not in self.s.grouped:  # F.conv1d(…, groups=width): one group per coordinate
            self.s.grouped.append(n.name)
        self.s.read_views += [v for v in op.views if v not in self.s.read_views]  # the factor's sizes grow with it

    def product(self, n: fx.Node, axis: int, pair: list[fx.Node]) -> None:  # x · y (stream_joins): zero or copies
        for t in [*pair, n]:
            self.add(t, axis)
            self.need(t, "zero", f"'{n.name}' multiplies two stream tensors: 0·y = 0, but mean(x·y) ≠ mean(x)·mean(y)")

    def constant(self, c: fx.Node, axis: int) -> None:
        """`c` = zeros_like(stream) and the like: no value of the stream, its shape. Uniform, so an integer index along
        the hidden axis reads the same value at any width (a token-type id made as zeros_like(x)[..., 0]); any other
        use would see the new size."""
        for v in c.users:
            if v.op == "call_method" and v.target in SHAPE_QUERIES or drops_axis_by_index(v, axis):
                continue
            a = (
                _forward_axis(v, c, axis) if through(self.gm, v, self.s.width) is c else None
            )  # a view, a cast: uniform still
            if a is None:
                raise _refuse(v, "reads a constant shaped like the stream other than by an index along the hidden axis")
            self.constant(v, a)

    def writer(self, n: fx.Node, what: str, params: list[tuple[str, int]]) -> None:
        if n.name not in {w.node for w in self.s.writers}:
            self.s.writers.append(Writer(n.name, what, params, n.name))

    def check(self) -> None:
        """Every parameter tensor written onto the stream is read only there (checked once all is known)."""
        for w in self.s.writers:
            n = self.nodes[w.node]
            others = [u for u in n.users if u.name not in self.s.axes] if w.what == "tensor" else []
            if others:
                raise _refuse(n, f"is also read by '{others[0].name}' off the stream")
        scales = [(p, w.node, w.via) for w in self.s.writers if w.what == "scale" for p, _ in w.params]
        if stray := shared_factors(self.gm, scales):
            raise _refuse(self.nodes[stray], "is a per-channel factor of the stream also read off it")
        self.s.views = [
            t
            for t in self.s.axes
            if self.nodes[t].op in ("call_method", "call_function") and _what(self.nodes[t]) in VIEWS
        ]
