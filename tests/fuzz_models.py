"""Random small architectures and random pass pipelines for property-based fuzzing (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

IN_CH, SIZE, CLASSES = 3, 8, 4


class FuzzNet(nn.Module):
    """A CNN described by a list of ops; forward unrolls the list (fx traces it)."""

    def __init__(self, ops: list[tuple], head: tuple):
        super().__init__()
        self.ops, self.head = ops, head
        self.layers = nn.ModuleList()
        c, s = IN_CH, SIZE
        for op in ops:
            kind = op[0]
            if kind == "conv":
                _, out, k, stride, grouping = op
                stride = stride if s >= 2 else 1
                groups = (
                    c
                    if grouping == "depthwise"
                    else (2 if grouping == "grouped" and c % 2 == 0 and out % 2 == 0 else 1)
                )
                out = c if grouping == "depthwise" else out
                self.layers.append(nn.Conv2d(c, out, k, stride=stride, padding=k // 2, groups=groups, bias=k == 1))
                c, s = out, (s + 2 * (k // 2) - k) // stride + 1
            elif kind == "bn":
                self.layers.append(nn.BatchNorm2d(c))
            elif kind == "act":
                self.layers.append({"relu": nn.ReLU(), "gelu": nn.GELU(), "hardswish": nn.Hardswish()}[op[1]])
            elif kind == "res":
                self.layers.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)))
            elif kind == "cat":
                _, c1, c2 = op
                self.layers.append(nn.ModuleList([nn.Conv2d(c, c1, 1), nn.Conv2d(c, c2, 1)]))
                c = c1 + c2
            elif kind == "pool":
                stride = 2 if s >= 2 else 1
                self.layers.append(nn.MaxPool2d(2, stride) if op[1] == "max" and s >= 2 else nn.AvgPool2d(3, stride, 1))
                s = (s + 2 - 3) // stride + 1 if not (op[1] == "max" and s >= 2) else s // 2
        features = c if head[0] == "gap" else c * s * s
        self.norm = nn.LayerNorm(features) if head[1] else nn.Identity()
        self.fc = nn.Linear(features, CLASSES)

    def forward(self, x):
        for op, layer in zip(self.ops, self.layers):
            if op[0] == "res":
                x = x + layer(x)
            elif op[0] == "cat":
                x = torch.cat([layer[0](x), layer[1](x)], 1)
            else:
                x = layer(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1) if self.head[0] == "gap" else x, 1)
        return self.fc(self.norm(x))


ops = st.one_of(
    st.tuples(
        st.just("conv"),
        st.integers(2, 8),
        st.sampled_from([1, 3]),
        st.sampled_from([1, 2]),
        st.sampled_from(["full", "full", "depthwise", "grouped"]),
    ),
    st.tuples(st.just("bn")),
    st.tuples(st.just("act"), st.sampled_from(["relu", "gelu", "hardswish"])),
    st.tuples(st.just("res")),
    st.tuples(st.just("cat"), st.integers(1, 4), st.integers(1, 4)),
    st.tuples(st.just("pool"), st.sampled_from(["max", "avg"])),
)
architectures = st.tuples(
    st.lists(ops, min_size=1, max_size=6), st.tuples(st.sampled_from(["gap", "flat"]), st.booleans())
)

PASSES = ["add_residual", "grow_width", "insert_adapter", "add_branch", "remove_branch", "deepen"]


@st.composite
def pass_spec(draw, node_names: list[str], module_names: list[str], layer_names: list[str]) -> str:
    name = draw(st.sampled_from(PASSES))
    ref = st.one_of(st.sampled_from(node_names), st.sampled_from(module_names or node_names), st.just("no_such_node"))
    layer = st.one_of(st.sampled_from(layer_names), ref) if layer_names else ref
    args: dict[str, object] = {}
    if name == "add_residual":
        if draw(st.booleans()):
            args = {"start": draw(ref), "end": draw(ref)}
    elif name == "grow_width":
        if draw(st.booleans()):
            args["target"] = draw(layer)
        if draw(st.booleans()):
            args["to"] = draw(st.integers(1, 16))
        else:
            args["factor"] = draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 2.0, 3.0]))
        args["mode"] = draw(st.sampled_from(["group", "adapter"]))
        args["init"] = draw(st.sampled_from(["zero", "net2net"]))
    elif name == "insert_adapter":
        if draw(st.booleans()):
            args["after"] = draw(ref)
        if draw(st.booleans()):
            args["out_channels"] = draw(st.integers(1, 12))
        args["allow_narrowing"] = draw(st.booleans())
    elif name == "add_branch":
        if draw(st.booleans()):
            args["at"] = draw(ref)
        args["op"] = draw(
            st.sampled_from(
                ["conv3x3", "conv5x5", "sepconv3x3", "sepconv5x5", "dilconv3x3", "avgpool3x3", "maxpool3x3", "identity"]
            )
        )
        args["count"] = draw(st.integers(1, 2))
    elif name == "remove_branch":
        args["index"] = draw(st.integers(-2, 1))
    elif name == "deepen" and draw(st.booleans()):
        args["after"] = draw(ref)
    body = ",".join(f"{k}={v}" for k, v in args.items())
    return f"{name}({body})" if body else name
