"""Model names: timm:NAME, torchvision:NAME, package.module:factory(key=literal, …); arguments parsed,
never evaluated; the default input shape from the zoo's own metadata; random weights, no download."""
from __future__ import annotations

import json

import pytest
import torch

import graphgrow as gg
from conftest import ROOT, run_cli
from graphgrow.load import plain_output_path
from graphgrow.zoo import parse_name


@pytest.mark.parametrize("text, target, kwargs", [
    ("timm:resnet26d", "timm:resnet26d", {}),
    ("timm:resnet26d(num_classes=10, drop_path_rate=0.1)", "timm:resnet26d", {"num_classes": 10, "drop_path_rate": 0.1}),
    ("pkg.mod:factory(widths=[8, 16], name='x', flag=True, extra=None)", "pkg.mod:factory",
     {"widths": [8, 16], "name": "x", "flag": True, "extra": None}),
    ("timm:vit_tiny_patch16_224.augreg_in21k", "timm:vit_tiny_patch16_224.augreg_in21k", {}),
])
def test_names_and_literal_arguments(text, target, kwargs):
    name = parse_name(text)
    assert name.target == target and name.kwargs == kwargs


@pytest.mark.parametrize("text, message", [
    ("torchvision:resnet18(num_classes=__import__('os').getpid())", "not a literal"),
    ("torchvision:resnet18(num_classes=2+2)", "not a literal"),
    ("torchvision:resnet18(7)", "key=value"),
    ("torchvision:resnet18(**{'a': 1})", "key=value"),
    ("torchvision:resnet18(num_classes=", "not closed"),
    ("torchvision:resnet18(num_classes=)", "cannot read"),
    ("torchvision:resnet18(x=" + "1," * 2000 + ")", "characters long"),
])
def test_arguments_are_never_evaluated(text, message):
    with pytest.raises(gg.LoadError, match=message):
        gg.load_model(text)


def test_unknown_zoo_models_are_named():
    with pytest.raises(gg.LoadError, match="torchvision has no model 'resnet19'"):
        gg.load_model("torchvision:resnet19")
    with pytest.raises(gg.LoadError, match="timm has no model 'resnt26d'"):
        gg.load_model("timm:resnt26d")


def test_zoo_models_bring_their_input_shape_and_arguments():
    loaded = gg.load_model("torchvision:resnet18(num_classes=7)")
    assert loaded.input_shape == [1, 3, 224, 224] and loaded.module.fc.out_features == 7
    timm_model = gg.load_model("timm:resnet26d(num_classes=5)")
    assert timm_model.input_shape == [1, 3, 224, 224] and timm_model.module.num_classes == 5
    assert plain_output_path("timm:resnet26d(num_classes=5)").name == "resnet26d.grown.pt"


def test_a_factory_takes_literal_arguments(tmp_path):
    proc = run_cli("inspect", "factories:small_cnn", "--input-shape", "1,3,16,16", "--json", cwd=tmp_path,
                   env={"PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("inspect", "torchvision.models:resnet18(num_classes=3)", "--input-shape", "1,3,64,64", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 11_178_051


@pytest.mark.slow
def test_a_timm_model_by_name_grows_and_checks_without_an_input_shape(tmp_path):
    proc = run_cli("mutate", "timm:resnet26d", "--pass", "add_residual", "--onnx", str(tmp_path / "m.onnx"), "--check",
                   "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["input_shape"] == [1, 3, 224, 224] and report["equivalence"]["passed"]
    assert (tmp_path / "resnet26d.grown.pt").exists()


@pytest.mark.parametrize("text", ["timm:resnet18(pretrained=True)", "timm:resnet18(checkpoint_path='w.pth')",
                                  "torchvision:resnet18(weights='IMAGENET1K_V1')", "torchvision:resnet18(pretrained=True)"])
def test_arguments_asking_for_stored_weights_are_refused_before_anything_is_built(text, monkeypatch):
    import torchvision

    monkeypatch.setattr(torchvision.models, "get_model", lambda *a, **k: pytest.fail("built anyway"))
    with pytest.raises(gg.LoadError, match="random weights only"):
        gg.load_model(text)


@pytest.mark.parametrize("text, message", [
    ("os:system(command='touch {tmp}/pwned')", "standard library"),
    ("subprocess:run(args='touch {tmp}/pwned', shell=True)", "standard library"),
    ("builtins:open(file='{tmp}/pwned', mode='w')", "standard library"),
    ("shutil:copy(src='/etc/hostname', dst='{tmp}/pwned')", "standard library"),
    ("torch:load(f='{tmp}/evil.pt', weights_only=False)", "torch's own load"),
    ("torch.hub:download_url_to_file(url='http://x', dst='{tmp}/pwned')", "torch's own download_url_to_file"),
    ("numpy:save(file='{tmp}/pwned', arr=1)", "numpy's own save"),
    ("factories:load_weights(f='{tmp}/evil.pt', weights_only=False)", "torch's own load"),  # re-exported elsewhere
])
def test_names_of_loaders_and_the_standard_library_are_not_called(tmp_path, text, message):
    proc = run_cli("inspect", text.format(tmp=tmp_path), "--input-shape", "1,4", cwd=tmp_path,
                   env={"PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "pwned").exists()


def test_nn_module_classes_of_torch_are_factories():
    loaded = gg.load_model("torch.nn:Linear(in_features=4, out_features=3)")
    assert isinstance(loaded.module, torch.nn.Linear) and loaded.module.out_features == 3


def test_the_current_folder_is_importable_only_while_a_factory_is_built(tmp_path, monkeypatch):
    import importlib.util
    import sys

    (tmp_path / "mymodels.py").write_text("import helper\n\ndef build():\n    return helper.net()\n")
    (tmp_path / "helper.py").write_text("import torch\n\ndef net():\n    import lazy_sibling\n    return lazy_sibling.NET\n")
    (tmp_path / "lazy_sibling.py").write_text("import torch\nNET = torch.nn.Linear(4, 2)\n")
    (tmp_path / "probe_optional_dep.py").write_text("raise SystemExit('a stray module in the current folder ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    loaded = gg.load_model("mymodels:build")  # its siblings import at import time and lazily, while it builds
    assert isinstance(loaded.module, torch.nn.Linear)
    assert str(tmp_path) not in sys.path and importlib.util.find_spec("probe_optional_dep") is None
    for name in ("mymodels", "helper", "lazy_sibling"):
        sys.modules.pop(name, None)


def test_an_argument_given_twice_is_refused():
    with pytest.raises(gg.LoadError, match="num_classes of timm:resnet26d is given twice"):
        parse_name("timm:resnet26d(num_classes=10, num_classes=5)")


def test_a_model_too_large_to_hold_is_refused_before_anything_is_allocated(monkeypatch):
    from graphgrow import load

    with pytest.raises(gg.LoadError, match="would hold 3,814,701.1 MiB of parameters and buffers"):
        gg.load_model("factories:square_linear(n=1000000)")  # 4 TB: a real build would not even get to fail cleanly
    monkeypatch.setattr(load, "MAX_LOAD_BYTES", 10 << 20)  # --max-load 10M
    with pytest.raises(gg.LoadError, match="limit 10.0 MiB"):
        gg.load_model("torchvision:resnet18")
    assert gg.load_model("factories:square_linear(n=100)").module.weight.shape == (100, 100)
    assert gg.load_model("factories:needs_real_tensors").module.in_features == 3  # not pre-checkable: built as before
