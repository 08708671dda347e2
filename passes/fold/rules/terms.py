"""Rule family: trivial terms of sums and products, a + 0·b → a and 1·x → x (shapes permitting)."""

from __future__ import annotations

from graphgrow.passes.fold.graph import ADD, MUL, SUB, bypass, scalar_operand  # noqa: TID251 (the fold package's own module)
from torch import fx

from graphgrow.rewrite import tensor_shape


def drop_zero_terms(gm: fx.GraphModule) -> int:
    """a + 0·b → a and 1·x → x (shapes permitting)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in MUL and (s := scalar_operand(n)) and s[0] == 1.0:
            bypass(n, s[1])
            count += 1
        elif n.target in ADD + SUB and len(n.args) == 2 and not n.kwargs:
            for i, a in enumerate(n.args):
                if (
                    isinstance(a, fx.Node)
                    and a.op == "call_function"
                    and a.target in MUL
                    and (s := scalar_operand(a))
                    and s[0] == 0.0
                ):
                    other = n.args[1 - i]
                    if (
                        isinstance(other, fx.Node)
                        and tensor_shape(other) == tensor_shape(n)
                        and (i == 1 or n.target in ADD)
                    ):
                        bypass(n, other)
                        count += 1
                        break
    gm.graph.eliminate_dead_code()
    return count
