"""The dataflow follower of attention growth: Flow walks the tensors between an attention's projections and the
attention (or from its output to the output projection) in graph order and gives each its factor layout
(head_layout's words: which axis holds heads, head size, q/k/v sections), refusing an op that would cut a growing
factor; it records the reshape constants to rewrite (FactorEdit), the per-head parameters it adopts. Apart from
head_layout (what a layout is, how each op is classified): following a graph is one job of its own.
"""

from __future__ import annotations

import math

from torch import fx

from ..graph.fx_edit import tensor_shape
from . import head_params
from .head_layout import (
    _FACTOR_WORDS,
    HEAD_FACTORS,
    Axis,
    FactorEdit,
    Layout,
    _name,
    broadcasts,
    canon,
    channel_norm,
    data_args,
    op_kind,
    plain,
    refuse,
    size_of,
    words,
    writes,
)
from .head_sizes import constant_factor, follows, joined_sizes


class Flow:
    """Factor layouts of the tensors between the projections and one attention (or its output and the reader)."""

    def __init__(self, gm: fx.GraphModule, growing: set[str], region: set[str]):
        self.gm, self.growing, self.region = gm, growing, region
        self.layout: dict[str, object] = {}  # node → Layout, or a list of (Layout, section) for split/unbind
        self.section: dict[str, int] = {}
        self.edits: list[FactorEdit] = []
        # parameters holding an entry per head (adopt): (path, the axis holding the heads, its factors, new entries)
        self.params: list[tuple[str, int, Axis, float | None]] = []

    def grows(self, axis: Axis) -> bool:
        return any(f in self.growing for f, _ in axis)

    def of(self, a: fx.Node) -> Layout:
        return self.layout[a.name]  # type: ignore[return-value]

    def run(self, nodes: list[fx.Node]) -> None:
        for n in nodes:
            if n.name in self.layout:
                continue
            self.layout[n.name] = self.step(n)
            src = [a for a in data_args(n) if a.name in self.section]
            if src and n.name not in self.section and _name(n) not in ("split", "chunk", "unbind"):
                self.section[n.name] = self.section[src[0].name]

    def step(self, n: fx.Node):
        kind, name, shape = op_kind(self.gm, n), _name(n), tensor_shape(n)
        x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if kind in ("same", "pointwise"):
            return self.of(x)
        if kind == "reduce":
            return self.reduce(n, self.of(x))
        if kind == "norm":
            lay = self.of(x)
            if self.grows(lay[-1]) and any(f in HEAD_FACTORS for f, _ in lay[-1]):  # BitNet's attn_sub_norm
                raise refuse(
                    n,
                    f"normalises over every head's output together ({words(lay[-1])}): new heads or head sizes "
                    "would change its statistics",
                    "this attention's heads and value size cannot grow exactly; grow the model with other passes",
                )
            if self.grows(lay[-1]):
                raise refuse(
                    n,
                    "normalises over a growing axis (a query/key norm over the head size), which cannot grow exactly",
                    "grow heads instead (heads=…), or value_dim=… (the value path has no such norm)",
                )
            return lay
        if kind in ("elementwise", "channelnorm"):  # a BatchNorm: per channel, its entries grow with the heads there
            return channel_norm(self, n) if kind == "channelnorm" else self.broadcast(n, data_args(n), shape)
        if kind == "alloc":
            return self.allocation(n, shape)
        if kind == "write":  # a copy into an allocation's slice: the allocation's rule checked what is copied
            return self.of(n.args[0]) if name == "copy_" else ()
        if name == "view_as_complex":  # (…, d/2, 2) real pairs → (…, d/2) complex numbers: RoPE as complex products
            lay = self.of(x)
            if self.grows(lay[-1]):
                raise refuse(n, f"pairs the entries of a growing axis ({words(lay[-1])}) as complex numbers")
            return lay[:-1]
        if name == "view_as_real":
            return self.of(x) + ((("", 2),),)
        if name == "cat":
            return self.cat(n, shape)
        if name == "stack":
            return self.stack(n, shape)
        if name in ("split", "chunk", "unbind"):
            return self.split(n, name)
        if name == "getitem" and isinstance(self.layout.get(x.name), list):
            lay, sec = self.layout[x.name][n.args[1]]  # type: ignore[index]
            if sec is not None:
                self.section[n.name] = sec
            return lay
        lay = self.of(x)
        if name in ("view_as", "reshape_as"):  # the shape of another tensor of the flow: no constant to edit
            return self.regroup(n, lay, shape)
        if name in ("reshape", "view", "flatten"):
            if name == "flatten":  # merges whole axes: exact, even for a factor of size 1 (a single head)
                start = n.args[1] if len(n.args) > 1 else n.kwargs.get("start_dim", 0)
                end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
                if not lay:
                    return lay
                start, end = start % len(lay), end % len(lay)
                return lay[:start] + (tuple(f for axis in lay[start : end + 1] for f in axis),) + lay[end + 1 :]
            packed = len(n.args) == 2 and isinstance(n.args[1], (list, tuple))
            sizes = n.args[1] if packed else n.args[1:]
            joined = joined_sizes(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], fx.Node) else None
            if joined is not None:  # x.view(x.size()[:-1] + (heads, -1)): the constants are in the tuple added
                read, tail = joined
                out = self.regroup(n, lay, shape, [read] * (len(shape) - len(tail)) + list(tail))
                if any(self.grows(axis) for axis in out[: len(shape) - len(tail)]):
                    raise refuse(n, f"takes the size of a growing axis from '{read}', sizes read at run time")
                self.constants(n.args[1], out[len(shape) - len(tail) :], tail, ("args", 1))
                return out
            out = self.regroup(n, lay, shape, list(sizes))
            self.constants(n, out, sizes, ("args", 1) if packed else ("args",))
            return out
        if name == "unflatten":
            dim = n.args[1] % len(lay)
            part = self.regroup(n, (lay[dim],), shape[dim : dim + len(n.args[2])], list(n.args[2]))
            self.constants(n, part, n.args[2], ("args", 2))
            return lay[:dim] + part + lay[dim + 1 :]
        if name == "transpose":
            i, j = (d % len(lay) for d in n.args[1:3])
            swapped = list(lay)
            swapped[i], swapped[j] = lay[j], lay[i]
            return tuple(swapped)
        if name == "permute":
            dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
            return tuple(lay[d % len(lay)] for d in dims)
        if name == "unsqueeze":
            d = n.args[1] % (len(lay) + 1)
            return lay[:d] + ((),) + lay[d:]
        if name == "squeeze":
            dims = [n.args[1]] if len(n.args) > 1 else [i for i, s in enumerate(tensor_shape(x)) if s == 1]
            dims = [d % len(lay) for d in (dims[0] if isinstance(dims[0], (list, tuple)) else dims)]
            if any(self.grows(lay[d]) for d in dims):
                raise refuse(n, "squeezes away an axis that grows (a single head)")
            return tuple(a for i, a in enumerate(lay) if i not in dims)
        if name == "select":
            return self.index(n, lay, {n.args[1] % len(lay): n.args[2]})
        if name == "getitem":
            return self.index(n, lay, n.args[1])
        if name == "expand":
            return self.expand(n, lay, shape)
        if name == "repeat":  # tiled: the copies of an axis outermost (BLOOM's ALiBi repeated for every batch row)
            lead = len(shape) - len(lay)
            tiles = [s // max(size_of(a), 1) for a, s in zip(lay, shape[lead:])]
            return plain(shape[:lead]) + tuple(a if k == 1 else (("", k),) + a for a, k in zip(lay, tiles))
        raise refuse(
            n,
            "is not an op the analysis follows (reshapes, transposes, slices, splits, expands, "
            "elementwise ops and norms are)",
        )

    # --- rules ---
    def regroup(self, n: fx.Node, lay: Layout, shape: tuple, args=None) -> Layout:
        """Factors of `lay` regrouped into axes of `shape` (a reshape): fixed factors may split, growing ones not. A
        named factor of size 1 (one head) left after axis j is full goes to the first axis whose size in `args` is a
        number (not a size read at run time: the batch): j where its size is 1, else a later one (timm's reshape(B, N,
        3, num_heads, -1)); with none, to the next axis if a head size starts it (reshape(B, N, C), C read), else j."""
        seq = [f for axis in lay for f in axis if f[0] or f[1] != 1]

        def home(j: int) -> int:
            later = [k for k in range(j + 1, len(shape)) if all(s == 1 for s in shape[j + 1 : k])]
            for c in ([j] if shape[j] == 1 else []) + later if args is not None else []:
                if isinstance(args[c], int):
                    return c
            after = next((f for f in seq[i:] if f[1] != 1), ("", 1))  # a head size starting the next axis: with it
            return j if shape[j] == 1 or j + 1 == len(shape) or shape[j + 1] != 1 and after[0] in ("", "s") else j + 1

        out, i = [], 0
        for j, size in enumerate(shape):
            axis, p = [], 1
            while p < size:
                if i >= len(seq):
                    raise refuse(
                        n, f"reshapes {tuple(size_of(a) for a in lay)} into {shape} in a way the analysis cannot follow"
                    )
                name, s = seq[i]
                if size % (p * s) == 0:
                    axis.append(seq[i])
                    p, i = p * s, i + 1
                elif name in self.growing or s % (size // p):
                    raise refuse(n, f"splits the {_FACTOR_WORDS.get(name, 'axis')} ({s}) across axes {shape}")
                else:
                    axis.append(("", size // p))
                    seq[i] = ("", s // (size // p))
                    p = size
            while i < len(seq) and seq[i][1] == 1 and home(j) == j:
                axis.append(seq[i])
                i += 1
            out.append(tuple(axis))
        if i != len(seq):
            raise refuse(
                n, f"reshapes {tuple(size_of(a) for a in lay)} into {shape} in a way the analysis cannot follow"
            )
        return tuple(out)

    def constants(self, n: fx.Node, out: Layout, sizes, at: tuple, first: int = 1, keep: bool = False) -> None:
        """Every size argument of a growing axis: -1 needs nothing, a constant is an edit, mul(size, c) edits c; a
        size computed some other way (C from an input's shape) becomes -1 when no other size of the reshape is.
        `keep`: an expand of size-1 axes, where -1 keeps the old size 1: every growing size must be an edit."""
        if len(sizes) != len(out) and any(map(self.grows, out)):  # one value for every size: x.reshape(y.shape)
            raise refuse(n, f"takes the sizes of growing axes from '{sizes[0]}', a whole shape read at run time")
        free = len(sizes) if keep else sum(1 for a in sizes if a == -1)
        for j, (axis, a) in enumerate(zip(out, sizes)):
            if not self.grows(axis) or (a == -1 and not keep):
                continue
            if a == -1:
                raise refuse(n, f"keeps the size 1 of an axis that grows ({words(axis)})")
            where = at + (j,) if len(at) == 2 else ("args", j + first)
            if isinstance(a, int):
                self.edits.append(FactorEdit(n.name, where, a, axis))
                continue
            if isinstance(a, fx.Node) and follows(self.layout, a, axis, self.growing):
                continue  # computed from sizes read at run time of the growing axis: it follows by itself
            c = constant_factor(a)
            grown = math.prod(s for f, s in axis if f in self.growing)
            if (c is None or c[1] % grown) and free == 0 and isinstance(a, fx.Node):
                free = 1  # reshape infers this one size from the others and the element count: exact
                self.edits.append(FactorEdit(n.name, where, -1, axis, infer=True))
                continue
            k = next((i for i, b in enumerate(sizes) if b == -1), None)
            if (c is None or c[1] % grown) and free == 1 and k is not None and not keep and not self.grows(out[k]):
                free = 2  # the -1 holds a size that does not grow (timm's reshape(B, N, 3, self.num_heads, -1), the
                # head count read from a module attribute): it is written out, and this size is inferred instead
                fixed = at + (k,) if len(at) == 2 else ("args", k + first)
                self.edits.append(FactorEdit(n.name, fixed, size_of(out[k]), out[k]))
                self.edits.append(FactorEdit(n.name, where, -1, axis, infer=True))
                continue
            if c is None or c[1] % grown:
                raise refuse(
                    n,
                    f"takes the size of a growing axis ({words(axis)}) from '{getattr(a, 'name', a)}', "
                    "a computed value the analysis cannot scale",
                )
            self.edits.append(
                FactorEdit(n.name, where, c[1], tuple((f, s) for f, s in axis if f in self.growing), c[0])
            )

    def broadcast(self, n: fx.Node, operands: list[fx.Node], shape: tuple, others: bool = True) -> Layout:
        """The layout of `n` combining `operands` (laid out) by broadcasting to `shape`; `others`: `n`'s other tensor
        arguments (not laid out) must not meet a growing axis at a size above 1."""
        mine = [a for a in operands if a.name in self.layout]
        lays = {a.name: self.of(a) for a in mine}
        out = []
        for j in range(len(shape)):
            axes = [
                lays[a.name][j - len(shape) + len(lays[a.name])]
                for a in mine
                if j - len(shape) + len(lays[a.name]) >= 0
                and size_of(lays[a.name][j - len(shape) + len(lays[a.name])]) == shape[j]
            ]
            axis = max(
                axes, key=lambda ax: sum(bool(f) for f, _ in ax), default=(("", shape[j]),) if shape[j] > 1 else ()
            )
            if any(canon(ax, self.growing) != canon(axis, self.growing) for ax in axes):
                raise refuse(n, f"combines tensors whose axis {j} holds different heads or head sizes")
            for side in operands + [
                a for a in n.args if others and isinstance(a, fx.Node) and a not in operands and tensor_shape(a)
            ]:
                s = tensor_shape(side)
                k = j - len(shape) + len(s) if s is not None else -1
                if side.name in self.layout or k < 0 or s[k] == 1 or not self.grows(axis):
                    continue
                if self.adopt(side, axis, 1.0 if _name(n) in ("mul", "div", "truediv") else 0.0, k - len(s)):
                    continue
                if any(f == "d" for f, _ in axis) and _name(n) == "mul":
                    raise refuse(
                        n,
                        f"multiplies the query/key by '{side.name}' {tuple(s)}, a table per head-size "
                        "coordinate (rotary position embedding): its frequencies depend on the head size, so "
                        "growing the query/key head size cannot keep the attention logits",
                        "grow value_dim=… (the value/output head size: exact with rotary embeddings) or add "
                        "heads (heads=…) instead",
                    )
                raise refuse(
                    n,
                    f"combines it with '{side.name}' {tuple(s)}, which has the old size on a growing axis "
                    f"({words(axis)})",
                )
            out.append(axis)
        return tuple(out)

    def reduce(self, n: fx.Node, lay: Layout) -> Layout:
        """mean/sum/var/amax over axes that do not grow (a norm written out, per head): those axes become size 1
        (keepdim) or go."""
        arg = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        listed = arg if isinstance(arg, (list, tuple)) else [arg]
        if not all(isinstance(d, int) for d in listed) or not isinstance(keep, bool):
            raise refuse(n, "reduces over every axis, the heads' too")
        dims = {int(d) % len(lay) for d in listed}  # type: ignore[call-overload]
        if any(self.grows(lay[d]) and any(f in HEAD_FACTORS for f, _ in lay[d]) for d in dims):  # Dory's L2 sub-norm
            raise refuse(
                n,
                f"reduces over every head's output together ({'; '.join(words(lay[d]) for d in sorted(dims))}): "
                "new heads would change its statistics",
                "this attention's heads cannot grow exactly (a norm over all of them): grow it with other passes",
            )
        if any(self.grows(lay[d]) for d in dims):
            raise refuse(
                n,
                f"reduces over a growing axis ({'; '.join(words(lay[d]) for d in sorted(dims))}): new heads or head "
                "sizes would change its statistics, so they cannot grow exactly",
                "grow heads instead (heads=…), or the sizes this reduction does not read",
            )
        return tuple(() if i in dims else a for i, a in enumerate(lay) if keep or i not in dims)

    def adopt(self, side: fx.Node, axis: Axis, fill: float, at: int = -1) -> bool:
        """`side` meets the heads axis `axis` at its axis `at` and is computed from one parameter that holds an entry
        per head (a sink, a gate bias, a per-head bias table): it grows with the heads (analysis.head_params)."""
        return head_params.adopt(self, side, axis, fill, at)

    def cat(self, n: fx.Node, shape: tuple) -> Layout:
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(shape)
        if len([a for a in n.args[0] if isinstance(a, fx.Node)]) != len(n.args[0]):
            raise refuse(n, "concatenates a constant")
        return self.assemble(n, list(n.args[0]), dim, shape)

    def allocation(self, n: fx.Node, shape: tuple) -> Layout:
        """An allocated tensor filled by copies into slices of one axis: laid out as their concatenation; its size
        arguments on growing axes follow the growth."""
        filled = writes(n)
        if filled is None:
            raise refuse(n, "is allocated and not filled by copies into slices of one axis before it is read")
        dim, ws = filled
        lay = self.assemble(n, [w.source for w in ws], dim, shape)
        first = 1 if _name(n).startswith("new_") else 0
        rest = n.args[first:]
        packed = len(rest) == 1 and isinstance(rest[0], (list, tuple))
        sizes = rest[0] if packed else rest
        self.constants(n, lay, sizes, ("args", first) if packed else ("args",), first=first)
        return lay

    def assemble(self, n: fx.Node, parts: list[fx.Node], dim: int, shape: tuple) -> Layout:
        """Tensors laid side by side along axis `dim` (cat, or copies into an allocation's slices): the known parts'
        common layout, the axis `dim` plain; a part not computed from the projections must be the same for every head
        (shared): see shared()."""
        parts = [a for a in parts if 0 not in (tensor_shape(a) or (1,))]  # empty: nothing (XLM's empty cache)
        if any(a.name in self.layout and self.grows(self.of(a)[dim]) for a in parts):
            raise refuse(n, "concatenates along a growing axis")
        known = [a for a in parts if a.name in self.layout]
        lay = list(self.broadcast(n, known, shape[:dim] + (1,) + shape[dim + 1 :], others=False))
        lay[dim] = (("", shape[dim]),)
        for a in parts:
            if a.name not in self.layout and any(self.grows(ax) for ax in lay):
                self.shared(n, a, tuple(lay[:dim]) + ((("", tensor_shape(a)[dim]),),) + tuple(lay[dim + 1 :]))
        return tuple(lay)

    def shared(self, n: fx.Node, a: fx.Node, lay: Layout) -> None:
        """Part `a` of `n` does not come from the projections; it meets growing axes (`lay`: its place's layout). It
        grows exactly if it is the same for every head: of size 1 on each growing axis (broadcast by the copy), or an
        expand of such a tensor (multi-head latent attention's rotary key, one for all heads), whose sizes on growing
        axes then follow the growth."""
        s = tensor_shape(a)
        grow = [j for j, ax in enumerate(lay) if self.grows(ax)]
        if (
            s is not None
            and len(s) <= len(lay)
            and all(j < len(lay) - len(s) or s[j - len(lay) + len(s)] == 1 for j in grow)
        ):
            return
        x = a
        while op_kind(self.gm, x) == "same" and x.args and isinstance(x.args[0], fx.Node):
            x = x.args[0]
        src = tensor_shape(x.args[0]) if broadcasts(x) else None
        lead = len(lay) - len(src) if src is not None else 0
        if src is None or any(j >= lead and src[j - lead] != 1 for j in grow):
            raise refuse(
                n,
                f"combines the projected heads with '{a.name}', which is not computed from them and not the same "
                "for every head (broadcast from one), so new heads would have nothing to take there",
            )
        if _name(x) == "expand":
            packed = len(x.args) == 2 and isinstance(x.args[1], (list, tuple))
            self.constants(x, lay, x.args[1] if packed else x.args[1:], ("args", 1) if packed else ("args",), keep=True)
        else:
            raise refuse(x, "broadcasts a part shared by every head to the size of another tensor (expand_as)")

    def stack(self, n: fx.Node, shape: tuple) -> Layout:
        """torch.stack: the operands' common layout with a new plain axis of their count (RoPE written as
        rotate-every-two: stack([-x2, x1], -1).flatten(-2), GPT-J's and Cohere's)."""
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(shape)
        parts = [a for a in n.args[0] if isinstance(a, fx.Node)]
        lay = self.broadcast(n, [a for a in parts if a.name in self.layout], shape[:dim] + shape[dim + 1 :])
        if (len(parts) < len(n.args[0]) or any(a.name not in self.layout for a in parts)) and any(
            self.grows(ax) for ax in lay
        ):
            raise refuse(n, "stacks a tensor that does not grow with the heads")
        return lay[:dim] + ((("", shape[dim]),) if shape[dim] > 1 else (),) + lay[dim:]

    def split(self, n: fx.Node, name: str):
        x = n.args[0]
        lay = self.of(x)
        k = 1 if name == "unbind" else 2  # where the dim is: unbind(x, dim), split(x, sizes, dim), chunk(x, n, dim)
        dim = (n.args[k] if len(n.args) > k else n.kwargs.get("dim", 0)) % len(lay)
        axis, width, sizes = lay[dim], tensor_shape(x)[dim], n.args[1] if len(n.args) > 1 else None  # unbind(x)
        count = (
            (width // sizes if isinstance(sizes, int) else len(sizes))
            if name == "split"
            else int(sizes)
            if name == "chunk"
            else width
        )
        sections: list[int | None]
        if axis and axis[0][0] == "s" and axis[0][1] == count:
            rest, sections = axis[1:], list(range(count))
        elif not self.grows(axis) and name == "split" and isinstance(sizes, (list, tuple)) and sum(sizes) == width:
            # unequal pieces of an axis that does not grow (MLA's query: its rotary and non-rotary parts per head)
            return [(lay[:dim] + (((("", s),) if s != 1 else ()),) + lay[dim + 1 :], None) for s in sizes]
        elif not self.grows(axis) and (name != "split" or isinstance(n.args[1], int)) and size_of(axis) % count == 0:
            rest, sections = ((("", size_of(axis) // count),) if name != "unbind" else ()), [None] * count
        else:
            raise refuse(n, f"splits an axis that grows ({words(axis)}) other than into equal q/k/v sections")
        if name == "split" and self.grows(rest):
            self.edits.append(FactorEdit(n.name, ("args", 1), n.args[1], rest))
        if name == "unbind":  # the axis is gone: a factor beside the sections (one head of size 1) would go with it
            if self.grows(rest):
                raise refuse(n, f"unbinds an axis holding {words(rest)} beside the sections q, k, v: it would be lost")
            return [(lay[:dim] + lay[dim + 1 :], s) for s in sections]
        return [(lay[:dim] + (rest,) + lay[dim + 1 :], s) for s in sections]

    def index(self, n: fx.Node, lay: Layout, index) -> Layout:
        shape = tensor_shape(n.args[0])
        if isinstance(index, dict):  # select(dim, i)
            index = tuple(index.get(d, slice(None)) for d in range(len(lay)))
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            k = index.index(Ellipsis)
            index = index[:k] + (slice(None),) * (len(lay) - len(index) + 1) + index[k + 1 :]
        out, d = [], 0
        for i in index:
            if i is None:
                out.append(())
                continue
            axis = lay[d]
            if isinstance(i, int):
                if axis and axis[0][0] == "s" and len(axis) == 1:
                    self.section[n.name] = i % axis[0][1]
                elif self.grows(axis):
                    raise refuse(n, f"picks one entry of a growing axis ({words(axis)})")
            elif isinstance(i, slice) and any(isinstance(b, fx.Node) for b in (i.start, i.stop, i.step)):
                # a bound computed at run time (LUKE's x[:, :word_len], word_len read from a size): the traced
                # shape gives the size; what a growing axis would keep cannot be known
                got = tensor_shape(n)
                if self.grows(axis) or got is None:
                    raise refuse(n, f"indexes a growing axis ({words(axis)}) by a bound computed at run time")
                out.append((("", got[len(out)]),))
            elif (
                isinstance(i, slice)
                and i.step in (None, 1)
                and (i.start or 0) == 0
                and (i.stop is None or i.stop >= shape[d])
            ):
                out.append(axis)
            elif isinstance(i, slice) and not self.grows(axis):
                start, stop, step = i.indices(shape[d])
                part = size_of(axis[1:])  # one whole q/k/v section (GPT-NeoX-Japanese's qkv[..., d:2 * d]): its role
                if axis and axis[0][0] == "s" and step == 1 and stop - start == part and start % part == 0:
                    self.section[n.name] = start // part
                    out.append(axis[1:])
                else:
                    out.append((("", stop - start),))
            else:
                raise refuse(n, f"indexes a growing axis ({words(axis)}) by {i!r}")
            d += 1
        return tuple(out) + lay[d:]

    def expand(self, n: fx.Node, lay: Layout, shape: tuple) -> Layout:
        sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        at = ("args", 1) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else ("args",)
        lead = len(shape) - len(lay)
        # query heads growing around one key/value head (analysis.heads' one_kv): a size-1 axis broadcast to s (the
        # key repeated once per query head: repeat_kv) holds the same values at any size, so it is taken as the query
        # heads r; where it meets the attention, heads checks that it is the query's r
        spread = "r" if "r" in self.growing and "h" not in self.growing else ""
        out = tuple(
            (("", s),) if j < lead else ((spread, s),) if size_of(lay[j - lead]) == 1 and s > 1 else lay[j - lead]
            for j, s in enumerate(shape)
        )
        self.constants(n, out, sizes, at)
        return out
