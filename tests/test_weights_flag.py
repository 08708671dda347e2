"""--weights FILE.safetensors: trained weights for a model built by name, loaded strictly before tracing
(io/weights.py). Tiny models only: a two-layer MLP factory of the test's own module."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import run_cli
from safetensors.torch import save_file

import graphgrow as gg
from graphgrow.cli import main

FACTORY = "tinynet:mlp"
SOURCE = (
    "import torch\n"
    "def mlp(hidden=16):\n"
    "    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))\n"
    "def tied():\n"
    "    emb, head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)\n"
    "    head.weight = emb.weight\n"
    "    return torch.nn.Sequential(emb, head)\n"
)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The factory module in a fresh current folder; trained weights (drawn with another seed than the factory's)
    saved beside it; the model those weights make."""
    (tmp_path / "tinynet.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "tinynet", raising=False)
    torch.manual_seed(123)
    trained = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    save_file(trained.state_dict(), str(tmp_path / "w.safetensors"))
    yield tmp_path, trained
    sys.modules.pop("tinynet", None)


def test_a_named_model_takes_the_weights_and_grows_from_them(here):
    folder, trained = here
    loaded = gg.load_model(FACTORY, weights="w.safetensors")
    for k, v in trained.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[k], v), k
    out = folder / "grown.pt"
    result = CliRunner().invoke(
        main,
        [
            "mutate",
            FACTORY,
            "--weights",
            "w.safetensors",
            "--input-shape",
            "2,8",
            "--pass",
            "grow_width",
            "-o",
            str(out),
            "--json",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    grown = gg.load_model(out).module.eval()
    assert sum(p.numel() for p in grown.parameters()) > sum(p.numel() for p in trained.parameters())
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(grown(x), trained(x), rtol=1e-5, atol=1e-6)  # the trained function, not the seed's
        assert not torch.allclose(gg.load_model(FACTORY).module(x), trained(x))  # without --weights: random init


def test_weights_that_do_not_fit_the_model_name_their_keys(here):
    folder, trained = here
    state = trained.state_dict()
    wrong = {
        "0.weight": torch.zeros(32, 8),
        "0.bias": state["0.bias"],
        "2.weight": state["2.weight"],
        "extra": state["2.bias"],
    }
    save_file(wrong, str(folder / "wrong.safetensors"))
    with pytest.raises(gg.LoadError) as e:
        gg.load_model(FACTORY, weights="wrong.safetensors")
    message = str(e.value)
    assert "1 missing: 2.bias" in message
    assert "1 unexpected: extra" in message
    assert "0.weight [32, 8] (the model's: [16, 8])" in message
    with pytest.raises(gg.LoadError, match="no such file"):
        gg.load_model(FACTORY, weights="absent.safetensors")


def test_a_lying_header_or_one_over_max_load_is_refused_before_reading(here):
    folder, _ = here
    header = json.dumps({"0.weight": {"dtype": "F32", "shape": [100000, 1000], "data_offsets": [0, 400000000]}})
    raw = header.encode()
    (folder / "lying.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    with pytest.raises(gg.LoadError, match="header lies"):
        gg.load_model(FACTORY, weights="lying.safetensors")
    with pytest.raises(gg.LoadError, match=r"nothing was read"):
        gg.load_model(FACTORY, weights="lying.safetensors", max_load=1 << 20)
    (folder / "short.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(gg.LoadError, match="not a safetensors file"):
        gg.load_model(FACTORY, weights="short.safetensors")


def test_weights_go_with_a_model_name_and_safetensors_only(here):
    folder, trained = here
    torch.save(trained.state_dict(), folder / "w.pt")
    torch.save(trained, folder / "model.pt")
    with pytest.raises(gg.SpecError, match="safetensors files only"):
        gg.load_model(FACTORY, weights="w.pt")
    with pytest.raises(gg.SpecError, match="carries its own weights"):
        gg.load_model(str(folder / "model.pt"), weights="w.safetensors")
    with pytest.raises(gg.SpecError, match="carries its own weights"):
        gg.load_model(str(folder), weights="w.safetensors")  # a folder (Hugging Face or not)
    # as a user sees it: one line, exit 2
    done = run_cli("inspect", "model.pt", "--weights", "w.bin", cwd=folder)
    assert done.returncode == 2, done.stderr
    assert "carries its own weights" in done.stderr and "Traceback" not in done.stderr


def test_tied_weights_saved_once_load_into_both_names(here):
    """safetensors.torch.save_model keeps one name of a tied tensor (an LM head sharing the embedding)."""
    from safetensors.torch import save_model

    folder, _ = here
    torch.manual_seed(7)
    trained = gg.load_model("tinynet:tied").module
    torch.nn.init.normal_(trained[0].weight)
    save_model(trained, str(folder / "tied.safetensors"))
    loaded = gg.load_model("tinynet:tied", weights="tied.safetensors").module
    assert torch.equal(loaded[1].weight, trained[0].weight)
    assert loaded[1].weight is loaded[0].weight  # still tied


def test_an_export_of_a_model_with_weights_checks_against_the_same_name_and_weights(here):
    """The ONNX file records no factory seed (no value came from it); check rebuilds the reference with --weights."""
    folder, _ = here
    assert gg.load_model(FACTORY, weights="w.safetensors").factory_seed is None
    runner = CliRunner()
    common = ["--weights", "w.safetensors", "--input-shape", "2,8"]
    done = runner.invoke(main, ["export", FACTORY, "-o", "m.onnx", *common], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    done = runner.invoke(main, ["check", "m.onnx", FACTORY, *common, "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    done = runner.invoke(main, ["check", "m.onnx", FACTORY, "--input-shape", "2,8"], catch_exceptions=False)
    assert done.exit_code == 2 and "does not record how its weights were made" in done.output
