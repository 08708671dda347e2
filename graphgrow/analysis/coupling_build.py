"""What the coupling rules work on: the analysis under construction (`Build`) and the node a rule looks at (`Site`).

A rule is a small function `rule(build, site[, module]) -> bool`: it joins tensors whose channels must stay equal,
links derived channels, freezes what it does not understand (with the reason) and records sources, consumers,
per-channel tensors and edits on the build; it returns False when the node is not its case after all, and the next
rule is asked. coupling.py runs them over the graph and turns the build into groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import fx

from .axes import node_axis


@dataclass
class Link:
    """Channels of `dst` that are channels of `src`: for j < repeat, src channel c is dst channels
    offset + j·stride + c·scale + q (q < scale). A cat input (offset), a flatten (scale), a slice or a split
    piece (src is the piece), a reshape that splits the channel axis into blocks (repeat, stride)."""

    src: str  # member node of the source group
    dst: str  # member node of the derived group
    offset: int
    scale: int  # features per channel (flatten of H×W maps gives H·W)
    repeat: int = 1
    stride: int = 0


@dataclass
class Site:
    """The node a rule looks at: its own vertex (None when it has no channel axis) and its inputs that have one."""

    node: fx.Node
    out: str | None
    inputs: list[fx.Node]

    @property
    def x(self) -> fx.Node | None:
        """The first input with a channel axis (the data operand of a layer)."""
        return self.inputs[0] if self.inputs else None


@dataclass
class Build:
    """The coupling analysis while the rules run: the graph of tensors that share channels and what each rule found."""

    gm: fx.GraphModule
    g: nx.Graph = field(default_factory=nx.Graph)
    frozen: dict[str, list[str]] = field(default_factory=dict)
    sources: list[tuple[str, str | None]] = field(default_factory=list)
    consumers: list[tuple[str, str]] = field(default_factory=list)
    channelwise: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    tensors: list[tuple[str, str]] = field(
        default_factory=list
    )  # (attribute path, group member that reads it per channel)
    attr_tensors: list[tuple[str, str]] = field(default_factory=list)
    functional: dict[str, Any] = field(default_factory=dict)  # node → coupling_layers.Functional
    attentions: list[tuple[str, str]] = field(default_factory=list)  # (attention node, member of the group it marks)
    units: dict[str, int] = field(default_factory=dict)  # GroupNorm node → channels per group
    links: list[Link] = field(default_factory=list)
    edits: list[Any] = field(default_factory=list)  # coupling_splits.ChannelEdit
    blocks: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # node → (block count, why)

    def vertex(self, n) -> str | None:
        if isinstance(n, fx.Node) and n.op != "output" and node_axis(n) is not None:
            self.g.add_node(n.name)
            return n.name
        return None

    def freeze(self, nodes, reason: str) -> None:
        for n in nodes:
            v = self.vertex(n)
            if v is not None:
                self.frozen.setdefault(v, []).append(reason)

    def join(self, *nodes) -> None:
        vs = [self.vertex(n) for n in nodes]
        vs = [v for v in vs if v is not None]
        for a, b in zip(vs, vs[1:]):
            self.g.add_edge(a, b)

    def link(self, src, dst, offset: int, repeat: int = 1, stride: int = 0, scale: int = 1) -> None:
        if self.vertex(src) is None or self.vertex(dst) is None:
            self.freeze(
                [src, dst], f"'{dst.name}' takes channels from '{src.name}' without a channel axis on both sides"
            )
            return
        self.links.append(Link(src.name, dst.name, offset, scale, repeat, stride))

    def block(self, node, count: int, why: str) -> None:
        if self.vertex(node) is not None:
            self.blocks.setdefault(node.name, []).append((count, why))
