"""torch.onnx.export's table of ONNX translations is built once per process (graphgrow.io.export._registry_once):
rebuilt on every call it was 0.4-1 CPU s of a 2-layer transformer's 5-6 s export, paid by every pass of a sweep.
What is exported stays the same, and the exporter's class is left as it was."""

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
