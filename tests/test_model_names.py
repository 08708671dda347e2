"""Model names: timm:NAME, torchvision:NAME, package.module:factory(key=literal, …); arguments parsed,
never evaluated; the default input shape from the zoo's own metadata; random weights, no download."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, run_cli

import graphgrow as gg
from graphgrow.io.save import plain_output_path
from graphgrow.io.zoo import parse_name


@pytest.mark.parametrize(
    "text, target, kwargs",
    [
        ("timm:resnet26d", "timm:resnet26d", {}),
        (
            "timm:resnet26d(num_classes=10, drop_path_rate=0.1)",
            "timm:resnet26d",
            {"num_classes": 10, "drop_path_rate": 0.1},
        ),
        (
            "pkg.mod:factory(widths=[8, 16], name='x', flag=True, extra=None)",
            "pkg.mod:factory",
            {"widths": [8, 16], "name": "x", "flag": True, "extra": None},
        ),
        ("timm:vit_tiny_patch16_224.augreg_in21k", "timm:vit_tiny_patch16_224.augreg_in21k", {}),
    ],
)
def test_names_and_literal_arguments(text, target, kwargs):
    name = parse_name(text)
    assert name.target == target and name.kwargs == kwargs


@pytest.mark.parametrize(
    "text, message",
    [
        ("torchvision:resnet18(num_classes=__import__('os').getpid())", "not a literal"),
        ("torchvision:resnet18(num_classes=2+2)", "not a literal"),
        ("torchvision:resnet18(7)", "key=value"),
        ("torchvision:resnet18(**{'a': 1})", "key=value"),
        ("torchvision:resnet18(num_classes=", "not closed"),
        ("torchvision:resnet18(num_classes=)", "cannot read"),
        ("torchvision:resnet18(x=" + "1," * 2000 + ")", "characters long"),
    ],
)
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
    proc = run_cli(
        "inspect",
        "factories:small_cnn",
        "--input-shape",
        "1,3,16,16",
        "--json",
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "tests")},
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "inspect", "torchvision.models:resnet18(num_classes=3)", "--input-shape", "1,3,64,64", "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 11_178_051


@pytest.mark.slow
def test_a_timm_model_by_name_grows_and_checks_without_an_input_shape(tmp_path):
    proc = run_cli(
        "mutate",
        "timm:resnet26d",
        "--pass",
        "add_residual",
        "--onnx",
        str(tmp_path / "m.onnx"),
        "--check",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["input_shape"] == [1, 3, 224, 224] and report["equivalence"]["passed"]
    assert (tmp_path / "resnet26d.grown.pt").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("os:system(command='touch {tmp}/pwned')", "standard library"),
        ("subprocess:run(args='touch {tmp}/pwned', shell=True)", "standard library"),
        ("builtins:open(file='{tmp}/pwned', mode='w')", "standard library"),
        ("shutil:copy(src='/etc/hostname', dst='{tmp}/pwned')", "standard library"),
        ("torch:load(f='{tmp}/evil.pt', weights_only=False)", "names a file, folder or URL"),
        (
            "torch:save(obj=1, f='pwned')",
            "torch's own save, not a model factory",
        ),  # a plain word, cwd = tmp: the allow-list
        ("torch.hub:download_url_to_file(url='http://x', dst='{tmp}/pwned')", "url='http://x' asks for stored weights"),
        ("numpy:save(file='{tmp}/pwned', arr=1)", "file='{tmp}/pwned' asks for stored weights"),
        ("factories:load_weights(f='{tmp}/evil.pt', weights_only=False)", "names a file"),
        (
            "factories:load_weights(f='pwned')",
            "torch's own load, not a model factory",
        ),  # re-exported by the user's module
        ("reexports:opener(file='pwned', mode='w')", "file='pwned' asks for stored weights"),
        ("reexports:opener(name='pwned', mode='w')", "open from Python's standard library"),  # the stdlib, re-exported
        ("reexports:writer(filename='pwned', mode='w')", "asks for stored weights"),
        ("reexports:writer", "click's own open_file"),
        ("click:echo(message='pwned')", "click's own echo, not a model factory"),
        ("click:File(mode='w')", "click's own File"),  # a library class that is not an nn.Module
        ("graphgrow:load_model", "graphgrow:load_model is in graphgrow, not a model factory"),
        ("graphgrow.io.factory:import_object(name='os:system')", "is in graphgrow"),
    ],
)
def test_names_of_loaders_and_the_standard_library_are_not_called(tmp_path, text, message, monkeypatch):
    import sys

    (tmp_path / "reexports.py").write_text(
        "from click import open_file as writer\nopener = open\n"
    )  # the user's module
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "reexports", raising=False)
    with pytest.raises(gg.LoadError) as e:
        gg.load_model(text.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(e.value)
    assert not (tmp_path / "pwned").exists()
    sys.modules.pop("reexports", None)


@pytest.mark.parametrize(
    "text",
    [
        "timm:resnet18(pretrained=True)",
        "timm:resnet18(checkpoint_path='w')",
        "timm:resnet18(pretrained_cfg={'num_classes': 3})",
        "timm:resnet18(pretrained_cfg_overlay={'file': 'w'})",
        "timm:resnet18(model_args={'pretrained': 1})",
        "torchvision:resnet18(weights='IMAGENET1K_V1')",
        "torchvision:fcn_resnet50(weights_backbone='DEFAULT')",
        "torchvision.models:resnet18(weights='DEFAULT')",
        "timm.models.resnet:resnet18(pretrained=True)",
        "factories:square_linear(n=4, ckpt=1)",
        "factories:square_linear(n=4, pretrainedPath='w')",
        "factories:square_linear(n=4, cache_dir='cache')",
        "factories:square_linear(n=4, hub='x')",
        "factories:square_linear(n=4, url='x')",
        "factories:square_linear(n=4, weights_only=False, weights=1)",
        "factories:square_linear(n=4, cfg={'checkpoint': 'x'})",
        "factories:square_linear(n=4, cfg=[{'state_dict': 'x'}])",
    ],
)
def test_arguments_asking_for_stored_weights_are_refused_whatever_the_name(text, monkeypatch):
    import torchvision

    monkeypatch.setattr(torchvision.models, "get_model", lambda *a, **k: pytest.fail("built anyway"))
    with pytest.raises(
        gg.LoadError, match="asks for stored weights or a file, and a model name builds random weights only"
    ):
        gg.load_model(text)


@pytest.mark.parametrize(
    "value",
    [
        "'/etc/hostname'",
        "'..'",
        "'~'",
        "'https://example.org/w.pth'",
        "'hf-hub:timm/resnet18'",
        "'C:\\\\w'",
        "'w.pth'",
        "'model.safetensors'",
        "['a', ('b', 'x/y')]",
        "{'k': 'x/y'}",
        "{'../k': 1}",
        "'present'",
    ],
)
def test_strings_that_name_files_are_refused_anywhere_in_the_arguments(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "present").write_text("an existing file, named without a path")
    with pytest.raises(gg.LoadError, match="names a file, folder or URL"):
        gg.load_model(f"factories:square_linear(n=4, extra={value})")


@pytest.mark.parametrize(
    "text",
    [
        "timm:resnet18(drop_path_rate=0.1, num_classes=3, pretrained=False, pretrained_cfg=None)",
        "torchvision:vgg11(init_weights=True, num_classes=3)",
        "torchvision:resnet18(weights=None, num_classes=3)",
        "torch.nn:Linear(in_features=4, out_features=3, device='cpu')",
    ],
)
def test_ordinary_arguments_are_not_mistaken_for_weights(text):
    assert isinstance(gg.load_model(text).module, torch.nn.Module)


@pytest.mark.parametrize(
    "spelling, zoo",
    [
        ("torchvision.models:resnet18", "torchvision:resnet18"),
        ("torchvision.models.resnet:resnet18", "torchvision:resnet18"),
        ("timm.models:resnet18", "timm:resnet18"),
        ("timm.models.resnet:resnet18", "timm:resnet18"),
    ],
)
def test_a_zoo_model_spelled_as_an_import_path_is_the_zoo_model(spelling, zoo):
    """The same random weights, input shape and refusals as the zoo's own name: it goes through the zoo's path."""
    a, b = gg.load_model(spelling), gg.load_model(zoo)
    assert a.input_shape == b.input_shape == [1, 3, 224, 224]
    assert all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values()))


@pytest.mark.parametrize(
    "text, message",
    [
        ("timm.models:create_model(model_name='resnet18')", "timm's own create_model, not a model factory"),
        ("timm:create_model(model_name='resnet18')", "timm has no model 'create_model'"),
        ("torchvision.models:get_model(name='resnet18')", "torchvision's own get_model, not a model factory"),
        ("torch.hub:load", "torch's own load"),
        ("torch.hub:list", "torch's own list"),
    ],
)
def test_a_zoos_generic_helpers_are_not_factories(text, message):
    with pytest.raises(gg.LoadError, match=message):
        gg.load_model(text)


def test_the_allow_list_holds_without_the_argument_check(tmp_path, monkeypatch):
    """Defence in depth: with the argument check switched off, a library's own function is still never called."""
    from graphgrow.io import zoo

    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    monkeypatch.setattr(zoo, "refuse_weight_arguments", lambda name: None)
    for text in (
        f"click:open_file(filename={str(keep)!r}, mode='w')",
        f"torch:save(obj=1, f={str(tmp_path / 'x')!r})",
        f"factories:load_weights(f={str(keep)!r}, weights_only=False)",
    ):
        with pytest.raises(gg.LoadError, match="not a model factory"):
            gg.load_model(text)
    assert keep.read_text() == "precious" and not (tmp_path / "x").exists()


def test_where_a_callable_is_defined_decides_not_where_it_is_imported_from(tmp_path):
    import sys
    import types

    import click

    from graphgrow.io.factory import library_of

    assert library_of(click.open_file) == "click" and library_of(torch.load) == "torch"
    assert library_of(torch.zeros) == "torch" and library_of(open) == "Python's standard library"
    import factories

    assert library_of(factories.small_cnn) is None and library_of(factories.load_weights) == "torch"
    mod = types.ModuleType("gone")  # a callable whose module is not loaded: cannot tell, so refused
    exec("def f(): pass", mod.__dict__)
    assert "unknown module" in (library_of(mod.__dict__["f"]) or "")
    assert "gone" not in sys.modules
    import functools

    assert library_of(functools.partial(factories.small_cnn)) == "Python's standard library"


def test_nn_module_classes_of_torch_are_factories():
    loaded = gg.load_model("torch.nn:Linear(in_features=4, out_features=3)")
    assert isinstance(loaded.module, torch.nn.Linear) and loaded.module.out_features == 3


def test_the_current_folder_is_importable_only_while_a_factory_is_built(tmp_path, monkeypatch):
    import importlib.util
    import sys

    (tmp_path / "mymodels.py").write_text("import helper\n\ndef build():\n    return helper.net()\n")
    (tmp_path / "helper.py").write_text(
        "import torch\n\ndef net():\n    import lazy_sibling\n    return lazy_sibling.NET\n"
    )
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


def test_a_model_too_large_to_hold_is_refused_before_anything_is_allocated():
    with pytest.raises(gg.LoadError, match="would hold 3,814,701.1 MiB of parameters and buffers"):
        gg.load_model("factories:square_linear(n=1000000)")  # 4 TB: a real build would not even get to fail cleanly
    with pytest.raises(gg.LoadError, match="limit 10.0 MiB"):
        gg.load_model("torchvision:resnet18", max_load=10 << 20)  # --max-load 10M
    assert gg.load_model("factories:square_linear(n=100)").module.weight.shape == (100, 100)
    assert gg.load_model("factories:needs_real_tensors").module.in_features == 3  # not pre-checkable: built as before


def test_no_argument_of_a_zoo_model_is_mistaken_for_weights():
    """Every argument of every timm and torchvision model (builders and nn.Module classes) is accepted by name,
    except those that really ask for stored weights."""
    import inspect
    import sys

    import timm
    import torchvision.models as tvm

    from graphgrow.io.zoo import asks_for_weights

    classes = {
        v
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith(("timm.", "torchvision.models"))
        for v in list(vars(m).values())
        if isinstance(v, type) and issubclass(v, torch.nn.Module)
    }
    builders = [tvm.get_model_builder(m) for m in tvm.list_models()] + [
        timm.models.model_entrypoint(m) for m in timm.list_models()
    ]
    refused = set()
    for obj in [*classes, *builders]:
        try:
            refused |= {p for p in inspect.signature(obj).parameters if asks_for_weights(p)}
        except (TypeError, ValueError):
            continue
    assert refused <= {
        "pretrained",
        "weights",
        "weights_backbone",
        "pretrained_backbone",
        "checkpoint_path",
        "pretrained_cfg",
        "pretrained_cfg_overlay",
        "pretrained_strict",
    }, refused
    assert not asks_for_weights("drop_path_rate") and not asks_for_weights("num_classes")


def test_the_caches_are_sealed_only_while_a_named_model_is_built(monkeypatch):
    import os

    import torch.hub

    from graphgrow.io import zoo

    monkeypatch.setenv("TORCH_HOME", "/nonexistent/torch-home")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = torch.hub.get_dir(), torch.hub.download_url_to_file
    seen = {}

    def spy():
        seen.update(
            hub=torch.hub.get_dir(),
            offline=os.environ.get("HF_HUB_OFFLINE"),
            files=os.listdir(torch.hub.get_dir()) if os.path.isdir(torch.hub.get_dir()) else [],
        )
        with pytest.raises(gg.LoadError, match="asked to download"):
            torch.hub.download_url_to_file("https://example.org/w.pth", "/dev/null")
        return torch.nn.Linear(2, 2)

    with zoo.sealed_caches():
        spy()
    assert seen["hub"] != before[0] and seen["offline"] == "1" and seen["files"] == []
    assert (torch.hub.get_dir(), torch.hub.download_url_to_file) == before
    assert os.environ["TORCH_HOME"] == "/nonexistent/torch-home" and "HF_HUB_OFFLINE" not in os.environ
