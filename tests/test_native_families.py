"""Issue 40's Done-when, cheaply: Hugging Face families grown in their own dtype come back as their own class.

Each family (11 decoders, 4 encoders, ViT; tiny configs from benchmarks/native_matrix.py, whose full matrix of
families × passes × dtypes is in docs/native.md) is captured in bfloat16, grown by one pass (the passes rotate over
the families), verified in float32 on its stored values (verify/low_precision.py), turned back into its class and
compared with the original: logits bit-equal on a padded batch, and for decoders the same greedy tokens with the KV
cache. Two run in float32 too (test_native.py and test_deepen_copy.py cover float32 per family). Then what bfloat16
growth means where it cannot be exact (grow_hidden by a size that is not a multiple: a rescaled norm weight rounds),
the exact shares, a convolutional model in float16, one folder through the CLI, and a timm model whose own norm
layers are resized.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import graphgrow as gg

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import native_matrix as nm  # noqa: E402

from graphgrow.io.hf_zoo import default_spec  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

# family → the pass it grows by here (each pass on ≥ 3 families; the matrix runs them all). Encoders grow by width:
# their classes derive the head size as hidden size / heads, so grow_hidden or grow_heads alone is refused by
# as_native (the matrix: together they hold), and their tied MLM decoder keeps grow_hidden from replicating
BF16 = {
    "llama": "grow_hidden",
    "mistral": "deepen",
    "qwen2": "grow_heads",
    "qwen3": "grow_width",
    "gemma": "deepen",
    "phi3": "grow_width",
    "olmo": "grow_hidden",
    "granite": "grow_heads",
    "gpt_neox": "grow_width",
    "opt": "deepen",
    "gpt2": "grow_width",
    "bert": "grow_width",
    "roberta": "grow_width",
    "electra": "grow_width",
    "distilbert": "grow_width",
    "vit": "grow_heads",
}
FLOAT32 = {"gpt2": "deepen", "vit": "grow_hidden"}  # float32 per family: tests/test_native.py, test_deepen_copy.py
CASES = [(f, p, torch.bfloat16) for f, p in BF16.items()] + [(f, p, torch.float32) for f, p in FLOAT32.items()]


def _grow(family: str, pass_name: str, dtype: torch.dtype):
    model = nm.FAMILIES[family].build(dtype)
    gm = gg.trace(model, input_shape=default_spec(model.config, type(model)))
    return model, gm, gg.Pipeline.from_spec(nm.pass_specs(pass_name, model)).run(gm)


@pytest.mark.parametrize(("family", "pass_name", "dtype"), CASES, ids=[f"{f}-{p}-{str(d)[6:]}" for f, p, d in CASES])
def test_a_family_grows_in_its_dtype_and_comes_back_as_its_class(family, pass_name, dtype):
    model, gm, result = _grow(family, pass_name, dtype)
    norms = {id(m.weight) for m in result.gm.modules() if isinstance(m, torch.nn.RMSNorm)}
    # grown in its own dtype, no float32 copy kept (a stand-in for Gemma's 1 + w norm keeps that sum in float32)
    assert {p.dtype for p in result.gm.parameters() if id(p) not in norms} == {dtype}
    if dtype == torch.bfloat16:
        assert any("compared in float32 on the stored values: exact" in n for n in result.results[-1].notes)
    native = gg.as_native(result.gm, model)
    assert type(native) is type(model) and native.dtype == dtype
    assert sum(p.numel() for p in native.parameters()) > sum(p.numel() for p in model.parameters())
    status, rel = nm.compare(nm.FAMILIES[family], model, native, dtype)
    assert status == "exact", (status, rel)


def test_bfloat16_growth_that_must_round_is_measured_against_the_dtype():
    """grow_hidden by a size that is not a multiple rescales the norms' γ by sqrt(d/d'): bfloat16 rounds it. The
    report gives the error (float32 on the stored values) and the tolerance (one ulp, 2^-7, or the original's own
    bfloat16 arithmetic, whichever is larger); the native model is within it, with the same greedy tokens here."""
    model = nm.FAMILIES["llama"].build(torch.bfloat16)
    gm = gg.trace(model, input_shape=default_spec(model.config, type(model)))
    result = gg.Pipeline.from_spec(["grow_hidden(by=16)"]).run(gm)
    low = result.results[-1].to_json()["preservation"]["low_precision"]
    assert low["dtype"] == "bfloat16" and low["exact"] is False and low["ulp"] == 2**-7
    report = result.results[-1].preservation
    assert 1e-5 < report.eval.rel_err <= low["tolerance"] and low["tolerance"] >= max(2**-7, low["own_rel_err"])
    assert any(
        "from rounding the grown values to bfloat16, within its tolerance" in n for n in result.results[-1].notes
    )
    status, rel = nm.compare(nm.FAMILIES["llama"], model, gg.as_native(result.gm, model), torch.bfloat16)
    assert status.startswith("close") and rel <= 2**-7, status
    # a multiple of the size replicates the stream instead: nothing is rescaled, and the result is exact
    exact = gg.Pipeline.from_spec(["grow_hidden(by=32)"]).run(gm).results[-1]
    assert exact.to_json()["preservation"]["low_precision"]["exact"] is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shares_of_a_half_precision_column_sum_to_it_exactly(dtype):
    from graphgrow.rewrite.channel_fill import _exact_shares

    g = torch.Generator().manual_seed(0)
    column = (torch.randn(4096, generator=g) * torch.logspace(-3, 3, 4096)).to(dtype)
    for count in (2, 3, 5):
        pieces = _exact_shares(column, count, g)
        assert all(p.dtype == dtype for p in pieces)
        assert torch.equal(sum(p.double() for p in pieces), column.double())  # exactly, in real arithmetic
        assert not torch.equal(pieces[0], pieces[1])  # unequal shares: the replicas are not symmetric


def test_a_half_precision_conv_net_grows_in_its_dtype():
    """Not only transformers: a float16 CNN with BatchNorm grows by add_residual and grow_width, verified in float32
    on its stored values, and stays float16 (this was refused, 'grow a float32 copy')."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    ).half()
    gm = gg.trace(net, (1, 3, 16, 16))
    result = gg.Pipeline.from_spec(["add_residual", "grow_width"]).run(gm)
    assert {p.dtype for p in result.gm.parameters()} == {torch.float16}
    assert all(r.to_json()["preservation"]["low_precision"]["dtype"] == "float16" for r in result.results)


def test_a_bfloat16_folder_through_the_cli_comes_back_bit_equal(runner, tmp_path):
    from graphgrow.cli.commands import main

    fam = nm.FAMILIES["llama"]
    folder, out = tmp_path / "llama", tmp_path / "llama-grown"
    fam.build(torch.bfloat16).save_pretrained(folder)
    result = runner.invoke(
        main,
        [
            "mutate",
            str(folder),
            "--pass",
            "grow_hidden(by=32)",
            "--pass",
            "deepen(block=copy)",
            "-o",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["native"]["dtype"] == "bfloat16" and report["native"]["config"]["hidden_size"] == [32, 64]
    assert all(p["preservation"]["low_precision"]["exact"] for p in report["passes"])
    original = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    grown = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert grown.config.num_hidden_layers == 3
    assert nm.compare(fam, original, grown, torch.bfloat16)[0] == "exact"


def test_a_timm_model_with_its_own_norm_layers_comes_back_as_its_class():
    """timm's BatchNormAct2d (a BatchNorm2d subclass with its activation) is resized by grow_width like the torch.nn
    layer it is, and swapped back into the copy (it was refused as 'not a torch.nn layer');
    benchmarks/native_vision.py runs 14 timm and torchvision classifiers."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", num_classes=5).eval()
    grown = gg.Pipeline.from_spec(["grow_width"]).run(gg.trace(model, input_shape=(1, 3, 32, 32))).gm
    native = gg.as_native(grown, model)
    assert type(native) is type(model)
    assert any(type(m).__name__ == "BatchNormAct2d" for m in native.modules())
    x = torch.randn(2, 3, 32, 32)
    native.eval()
    with torch.no_grad():
        assert torch.allclose(native(x), model(x), atol=1e-5)
        assert native.forward_head(native.forward_features(x)).shape == (2, 5)
