"""deepen(block=transformer): a whole pre-norm transformer block inserted on a token stream as the identity (issue 23,
item 4). GPT-2 and LLaMA (causal, found by probing the stream), BERT (post-norm, bidirectional), a plain
nn.TransformerEncoder and a timm ViT: exact in eval and train mode at two batch sizes and two sequence lengths, every
new parameter learning, the graphgrow file and the ONNX export on onnxruntime; refusals with their reasons."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf_pass_matrix import _same_function, build
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec, spec_inputs

ARCHS = {
    "gpt2": "causal",
    "llama": "causal",
    "bert": "bidirectional",
    "token_encoder": "bidirectional",
    "timm_vit": "bidirectional",
}
_GROWN: dict[str, tuple] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _build(arch: str) -> tuple[nn.Module, str]:
    if arch != "timm_vit":
        return build(arch)
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=32,
        num_heads=2,
        num_classes=3,
    )
    return model, "x:1x3x32x32"


def grown(arch: str):
    """(model, spec, traced graph, PassResult of deepen(block=transformer)), once per architecture."""
    if arch not in _GROWN:
        model, spec = _build(arch)
        gm = gg.trace(model, input_shape=parse_spec(spec))
        _GROWN[arch] = (model, spec, gm, gg.get_pass("deepen")(block="transformer")(gm))
    return _GROWN[arch]


def _at_length(spec: str, length: int) -> str:
    return spec.replace("1x8:", f"1x{length}:")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_in_both_modes(arch):
    model, spec, gm, result = grown(arch)
    assert f"{ARCHS[arch]} attention" in result.targets["block"]
    assert result.preservation.eval.ok and result.preservation.train.ok
    lengths = (8, 5) if "1x8:" in spec else (None,)  # an image's token count is fixed
    for length in lengths:
        s = parse_spec(_at_length(spec, length) if length else spec)
        for batch in (2, 3):
            inputs = spec_inputs(model, s, seed=batch, batch=batch)
            for train in (False, True):
                assert _same_function(gm, result.gm, inputs, train) <= 1e-6, (arch, length, batch, train)


def test_block_matches_the_model_and_learns():
    _, _, _, result = grown("llama")
    block = result.gm.deepen_transformer
    assert isinstance(block.norm1, nn.RMSNorm) and block.norm1.eps == 1e-6 and block.q.bias is None
    assert block.fc1.out_features == 32  # the model's MLP width (intermediate_size)
    assert "4 heads (the model's own attention)" in result.targets["block"]
    assert not block.proj.weight.any() and not block.fc2.weight.any()
    learns = result.preservation.trainable
    assert set(learns) == {f"deepen_transformer.{n}" for n, _ in block.named_parameters()}
    assert learns["deepen_transformer.proj.weight"] == 0 and learns["deepen_transformer.fc2.weight"] == 0
    assert max(learns.values()) == 1 and not result.preservation.dead


def test_causal_block_stays_causal_once_it_learns():
    _, spec, _, result = grown("gpt2")
    gm = result.gm
    with torch.no_grad():
        gm.deepen_transformer.proj.weight.normal_()
        gm.deepen_transformer.fc2.weight.normal_()
    gm.eval()
    ids = spec_inputs(gm, parse_spec(spec), seed=1, batch=2)["input_ids"]
    later = ids.clone()
    later[:, -1] = (later[:, -1] + 1) % 50
    a, b = gm(input_ids=ids)["logits"], gm(input_ids=later)["logits"]
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) and not torch.allclose(a[:, -1], b[:, -1])


def test_any_depth_and_onnx_and_file(tmp_path):
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session
    from graphgrow.verify.equivalence import check_equivalence

    _, spec, gm, _ = grown("bert")
    first = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("embeddings.LayerNorm"))
    result = gg.get_pass("deepen")(block="transformer", after=first)(gm)  # before the first encoder layer
    assert result.targets["after"].startswith(first) and result.preservation.eval.ok
    path = gg.save_model(result.gm, tmp_path / "bert_deeper.pt")
    loaded = gg.load_model(path).module
    inputs = spec_inputs(gm, parse_spec(spec), seed=4, batch=2)
    assert _same_function(result.gm, loaded, inputs, train=False) == 0.0 and "deepen_transformer.q" in dict(
        loaded.named_modules()
    )
    export_onnx(result.gm, parse_spec(spec), tmp_path / "bert_deeper.onnx", max_ir_version=max_ir_version())
    report = check_equivalence(
        result.gm, open_session(tmp_path / "bert_deeper.onnx", "cpu"), parse_spec(spec), raise_on_failure=True
    )
    assert report.passed


class Unaligned(nn.Module):
    """Tokens made by reshaping a flat input: no input is aligned with them, and no attention to read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(F.relu(self.fc(x.reshape(x.shape[0], 4, 8))).mean(1))


def test_refusals_say_why():
    gm = gg.trace(Unaligned(), input_shape=(2, 32))
    after = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc")
    with pytest.raises(gg.NotApplicable, match="cannot tell whether attention .* must be causal.*attention=causal"):
        gg.get_pass("deepen")(block="transformer", after=after)(gm)
    ok = gg.get_pass("deepen")(block="transformer", after=after, attention="bidirectional")(gm)
    assert "bidirectional attention (given)" in ok.targets["block"] and ok.preservation.eval.ok
    conv = gg.trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), input_shape=(1, 3, 8, 8))
    with pytest.raises(gg.NotApplicable, match=r"needs a token stream \(N, T, C\)"):
        gg.get_pass("deepen")(block="transformer", after="0")(conv)
