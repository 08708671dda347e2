"""A tied embedding on a replicated stream: the reader's shares moved onto the norm before it (grow_hidden).

Replicating the stream (a post-norm stream: BERT, RoBERTa; a pre-norm one with a norm right after its embedding:
BLOOM) copies each writer's rows and splits each reader's columns in shares that sum to the old column. An LM head
tied to the token embedding is both at once: the embedding needs the copies, the head the shares, on one tensor.
When the head reads the output of an affine norm that nothing else reads (BERT's MLM transform LayerNorm, BLOOM's
final LayerNorm), the head can take the copies too: every old coordinate then appears new/old times in its input,
so the norm's γ and β divided by new/old give the old logits exactly — the shares live in the norm, not the tie.
"""

from __future__ import annotations

from torch import fx

from ..analysis.stream import Stream
from ..analysis.stream_ops import arithmetic
from .tensor_paths import tensor_at as _tensor


def shares_on_norms(
    gm: fx.GraphModule, stream: Stream, plans: dict[str, list[tuple[int, str, str]]], owners: dict[int, list[str]]
) -> set[str]:
    """For a replicated stream: readers whose weight is tied to a writer's and who alone read an affine norm's output
    take 'copy' instead of 'shares' (plans changed in place); returns the norm nodes whose γ and β must be divided
    by the replication factor."""
    written = {id(_tensor(gm, p)) for w in stream.writers for p, _ in w.params}
    norms = {n.node: n for n in stream.norms}
    nodes = {n.name: n for n in gm.graph.nodes}
    scaled: set[str] = set()
    for r in stream.readers:
        tied = [p for p, _ in r.params if id(_tensor(gm, p)) in written]
        norm = _norm_behind(nodes, stream, norms, r.input, r.node)
        if not tied or norm is None or norm.weight is None:
            continue
        shared = [q for q in (norm.weight, norm.bias) if q is not None and len(owners.get(id(_tensor(gm, q)), [])) > 1]
        if shared or any(m.node != norm.node and (m.weight, m.bias) == (norm.weight, norm.bias) for m in stream.norms):
            continue  # a norm whose parameters serve elsewhere too cannot take the shares
        role = f"read by '{r.node}'"
        for path, _ in r.params:
            plans[path] = [
                (dim, "copy" if how == "shares" and who == role else how, who) for dim, how, who in plans[path]
            ]
        scaled.add(norm.node)
    return scaled


def _norm_behind(nodes: dict[str, fx.Node], stream: Stream, norms: dict, name: str, reader: str):
    """The norm whose output reaches `reader` alone, through stream ops of that one input (a slice of the last
    positions, a view, dropout: linear, so a scale on the norm passes through them), else None."""
    n, prev = nodes[name], reader
    while n.name not in norms:
        ins = [a for a in n.all_input_nodes if a.name in stream.axes]
        # one stream input; another input only as a per-token factor of a product (Flaubert's padding mask)
        single = len(n.all_input_nodes) == 1 or (arithmetic(n) == "mul" and len(ins) == 1)
        if {u.name for u in n.users} != {prev} or not single or not ins or n.name not in stream.axes:
            return None
        prev, n = n.name, ins[0]
    return norms[n.name] if {u.name for u in n.users} == {prev} else None
