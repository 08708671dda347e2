"""torch.onnx.export as graphgrow runs it: its table of ONNX translations built once per process (_registry_once),
its optimizer without the rules that are quadratic in the graph's size (onnx_optimizer._linear_rewrites). Rebuilt
on every call, the table was 0.4-1 CPU s of a 2-layer transformer's 5-6 s export, paid by every pass of a sweep."""

from __future__ import annotations

import torch
from torch import nn

import graphgrow as gg
from graphgrow.io import export as gx


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_the_translation_table_is_built_once_and_the_export_is_unchanged(tmp_path, monkeypatch):
    from torch.onnx._internal.exporter import _registration

    owner = _registration.ONNXRegistry
    original = owner.__dict__["from_torchlib"]
    calls = []

    def counted(cls, *args, **kwargs):
        calls.append(args or kwargs)
        return original.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(owner, "from_torchlib", classmethod(counted))
    monkeypatch.setattr(gx, "_REGISTRIES", {})
    gm = gg.trace(Small(), (2, 4))
    first = gx.export_onnx(gm, (2, 4), tmp_path / "a.onnx")
    second = gx.export_onnx(gm, (2, 4), tmp_path / "b.onnx")
    assert len(calls) == 1  # built for the first export only
    assert first.graph.SerializeToString() == second.graph.SerializeToString()
    assert owner.__dict__["from_torchlib"].__func__ is counted  # the class is as the export found it
    table = owner.from_torchlib()
    assert len(calls) == 2 and table.functions  # outside an export: the exporter's own builder


def test_the_optimizer_runs_without_its_quadratic_multi_output_rules(tmp_path, monkeypatch):
    """onnxscript's rules with several output nodes (two Slices of a tensor into a Split) list the whole graph for
    every node they try: quadratic, 80 % of a sweep run on a model whose chunked loop unrolls to thousands of
    Slices. The export's optimizer runs every other default rule; outside an export the defaults are as they were."""
    from onnxscript import rewriter

    def multi(rules):
        return [r for r in rules if not r._matcher.pattern.has_single_output_node]

    defaults = rewriter._DEFAULT_REWRITE_RULES
    assert multi(defaults)  # what this test is about: onnxscript has such a rule (else it tests nothing)
    seen = []
    init = rewriter.RewritePass.__init__

    def spy(self, rules, *args, **kwargs):
        seen.append(list(rules))
        init(self, rules, *args, **kwargs)

    monkeypatch.setattr(rewriter.RewritePass, "__init__", spy)
    gm = gg.trace(Small(), (2, 4))
    gx.export_onnx(gm, (2, 4), tmp_path / "a.onnx")
    assert seen and all(rules and not multi(rules) for rules in seen)
    assert len(seen[0]) == len(defaults) - len(multi(defaults))  # only those left out
    assert rewriter._DEFAULT_REWRITE_RULES is defaults
