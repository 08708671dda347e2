"""Names are data (issue 38): any module, parameter or buffer name PyTorch accepts — hyphens, keywords, non-ASCII
letters, leading digits, text that reads as code — is kept as a string in the file and reached in generated code
through a generated identifier (core/codegen.py). Nothing is refused for its spelling, nothing a name says runs,
and the names come back on load, in `inspect`, in ONNX names and in the model handed back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import fx, nn

import graphgrow as gg
from graphgrow.core import codegen, names
from graphgrow.io.load import load_model


def evil(marker: Path) -> str:
    """Code, if it were pasted where fx writes a name (a module name may hold anything but a `.`)."""
    return f'a"); getattr(__import__("os"), "system")("touch {str(marker).replace(".", "?")}"); ("'


def named_model(marker: Path) -> nn.Sequential:
    """Standard layers (a plain torch.save file loads without --trust) under names fx cannot write bare."""
    torch.manual_seed(0)
    inner = nn.Sequential()
    inner.add_module("class", nn.Conv2d(4, 4, 3, padding=1))  # a keyword: `self.class` does not parse
    inner.add_module("名前", nn.BatchNorm2d(4))  # non-ASCII letters
    model = nn.Sequential()
    model.add_module("block4-0", nn.Conv2d(3, 4, 3, padding=1))  # torchvision's RegNet spelling
    model.add_module("0abc", inner)  # a leading digit
    model.add_module(evil(marker), nn.ReLU())  # code, if it were pasted
    model.add_module("ｓｅｌｆ", nn.AdaptiveAvgPool2d(1))  # NFKC folds it into `self`
    model.add_module("flat", nn.Flatten())
    model.add_module("for", nn.Linear(4, 3))
    return model.eval()


def odd_names(model: nn.Module) -> list[str]:
    """The module names of `model` that are not plain identifiers (what fx would paste or misread)."""
    return sorted(
        {part for path, _ in model.named_modules() for part in path.split(".") if path if not names.is_identifier(part)}
    )


def assert_no_name_in_code(gm: fx.GraphModule, model: nn.Module) -> None:
    """No odd name is in the code as a name, an attribute or a quoted string (nor pasted anywhere, where it holds
    characters an identifier cannot: fx's node names keep the ASCII letters and digits of a path, `_0abc_class`)."""
    import ast

    bound = {v for v in gm.graph.python_code("self").globals.values() if isinstance(v, str)}
    parts = {
        t
        for sub in ast.walk(ast.parse(gm.code))
        for t in (getattr(sub, "id", None), getattr(sub, "attr", None), getattr(sub, "value", None))
    }
    for name in odd_names(model):
        assert name not in parts, name
        assert name in bound, name  # reached through a generated identifier bound to the name
        if not name.replace("_", "a").isalnum() or not name.isascii():
            assert name not in gm.code, name


def test_odd_names_trace_save_and_load_as_data(tmp_path):
    marker = tmp_path / "pwned"
    model = named_model(marker)
    x = torch.randn(2, 3, 8, 8)
    gm = gg.trace(model, (1, 3, 8, 8))
    assert list(gm.state_dict()) == list(model.state_dict())
    assert_no_name_in_code(gm, model)
    gg.save_model(gm, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt").module  # no trust needed
    assert list(loaded.state_dict()) == list(model.state_dict())
    assert {n for n, _ in loaded.named_modules()} == {n for n, _ in model.named_modules()}
    assert_no_name_in_code(loaded, model)
    assert torch.allclose(loaded(x), model(x))
    assert not marker.exists()


def test_odd_parameter_and_buffer_names_of_a_traced_module_are_kept(tmp_path):
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("w-1", nn.Parameter(torch.full((3,), 2.0)))
            self.register_buffer("class", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * getattr(self, "w-1") + getattr(self, "class")

    model = nn.Sequential(Scaled())
    gm = gg.trace(model, (1, 3))
    assert set(gm.state_dict()) == {"0.w-1", "0.class"}
    assert "w-1" not in gm.code and "0.class" not in gm.code
    loaded = load_model(gg.save_model(gm, tmp_path / "m.pt")).module
    assert set(loaded.state_dict()) == {"0.w-1", "0.class"}
    assert torch.equal(loaded(torch.ones(1, 3)), torch.full((1, 3), 3.0))


def test_odd_names_round_trip_through_the_cli(tmp_path):
    """save (a grown model), load without --trust, inspect and ONNX export: every name as it was."""
    marker = tmp_path / "pwned"
    model = named_model(marker)
    torch.save(model, tmp_path / "m.pt")
    proc = run_cli(
        "mutate",
        str(tmp_path / "m.pt"),
        "--pass",
        "grow_width",
        "--input-shape",
        "1,3,8,8",
        "-o",
        str(tmp_path / "g.pt"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    grown = load_model(tmp_path / "g.pt").module
    assert set(model.state_dict()) <= set(grown.state_dict())
    assert_no_name_in_code(grown, model)
    proc = run_cli("inspect", str(tmp_path / "g.pt"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout
    for name in odd_names(model):
        assert json.dumps(name)[1:-1] in shown or name in shown, name
    proc = run_cli("export", str(tmp_path / "g.pt"), "-o", str(tmp_path / "g.onnx"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import onnx

    proto = onnx.load(str(tmp_path / "g.onnx"))
    text = " ".join([n.name for n in proto.graph.node] + [i.name for i in proto.graph.initializer])
    for name in ("block4-0", "0abc.class", "0abc.名前", "for"):
        assert name in text, (name, text[:400])
    assert not marker.exists()


@pytest.mark.slow
def test_regnet_grows_and_loads_again_without_trust(tmp_path):
    """The issue's case: torchvision's RegNet names its blocks `block4-0`; every pass was refused."""
    out = tmp_path / "r.pt"
    proc = run_cli(
        "mutate",
        "torchvision:regnet_y_400mf",
        "--pass",
        "grow_width",
        "--input-shape",
        "1,3,64,64",
        "-o",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("inspect", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and "block4-0" in proc.stdout, proc.stderr
    import torchvision

    reference = torchvision.models.regnet_y_400mf()
    assert list(load_model(out).module.state_dict()) == list(reference.state_dict())


def test_names_pytorch_refuses_are_refused_in_one_line(tmp_path):
    """Only what PyTorch itself would not register: a name that is an attribute of its module (`forward`: fx's
    getattr would find the method, not the child)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    model._modules = type(model._modules)(("forward" if k == "1" else k, v) for k, v in model._modules.items())
    torch.save(model, tmp_path / "m.pt")
    proc = run_cli("inspect", str(tmp_path / "m.pt"), "--input-shape", "1,3,8,8", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'forward'" in lines[0] and "attribute of its module" in lines[0], proc.stderr


def test_the_pytree_form_of_fx_keeps_its_signature_with_generated_names():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module("lin-1", nn.Linear(2, 2))

        def forward(self, pair: dict) -> torch.Tensor:
            return getattr(self, "lin-1")(pair["a"] + pair["b"])

    model = Two()
    graph = fx.Tracer().trace(model, concrete_args={"pair": {"a": fx.PH, "b": fx.PH}})
    kind = type(graph._codegen)
    gm = fx.GraphModule(model, codegen.adopt(graph))
    assert isinstance(gm.graph._codegen, (codegen.NamedByData, kind)) and "lin-1" not in gm.code
    pair = {"a": torch.ones(1, 2), "b": torch.ones(1, 2)}
    assert torch.equal(gm(pair), model(pair))


def test_a_torch_that_stops_asking_for_names_is_refused_not_pasted(monkeypatch):
    """If fx stopped writing paths through the helper codegen.py wraps, the names would be pasted: refused instead."""
    import torch.fx.graph as fx_graph

    model = nn.Sequential()
    model.add_module("block4-0", nn.ReLU())
    graph = codegen.adopt(fx.Tracer().trace(model))
    monkeypatch.setattr(fx_graph, "_format_target", codegen._fx_format_target)
    with pytest.raises(codegen.CodegenError, match="block4-0"):
        fx.GraphModule(model, graph)
