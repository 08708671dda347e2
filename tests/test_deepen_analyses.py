"""deepen(block=transformer) reads the model from the analyses growth passes trust (issue 41, item 6): the norm type
and eps from the residual stream's norms (analysis.stream, also F.rms_norm / F.layer_norm calls that no module
shows), the MLP width from the stream's readers and writers (also F.linear on parameters), the head count from the
attention analysis (analysis.heads, whatever the attention module calls its head count). Models written three ways:
a hand-written functional pre-norm block, and nn.TransformerEncoderLayer(norm_first=True) captured by torch.export
(whose modules show the same: the analyses agree with them), and timm's ViT. The scan of norm and Linear modules
deepen did before gave the functional block LayerNorm(eps=1e-5) and MLP 4·C, and the ViT eps=1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.rewrite import find_stream

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C, HEADS, MLP = 32, 4, 48  # 4 heads where the default would be 1 (C // 64), MLP 48 where the default is 4·C = 128
IN = 16  # input features: embedded to the stream (a stream that starts at the model's input is not analysed)


class FunctionalBlock(nn.Module):
    """Pre-norm block written with functions only: F.rms_norm(eps=1e-3), F.linear on parameters, and its head count
    kept under a name no convention knows (`groups`). No norm or Linear module shows the model's choices."""

    def __init__(self):
        super().__init__()
        self.groups = HEADS
        self.n1, self.n2 = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(C, C) / C**0.5) for _ in range(4))
        self.up, self.down = nn.Parameter(torch.randn(MLP, C) / C**0.5), nn.Parameter(torch.randn(C, MLP) / MLP**0.5)

    def forward(self, x):
        n, t, _ = x.shape
        h = F.rms_norm(x, (C,), self.n1, eps=1e-3)
        q, k, v = (
            F.linear(h, w).view(n, t, self.groups, C // self.groups).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, C)
        x = x + F.linear(a, self.wo)
        return x + F.linear(F.gelu(F.linear(F.rms_norm(x, (C,), self.n2, eps=1e-3), self.up)), self.down)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(C, IN) / IN**0.5)
        self.blocks = nn.Sequential(FunctionalBlock(), FunctionalBlock())
        self.head = nn.Parameter(torch.randn(3, C) / C**0.5)

    def forward(self, x):
        return F.linear(F.rms_norm(self.blocks(F.linear(x, self.embed)), (C,), eps=1e-3), self.head)


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer(norm_first=True) with eps=1e-3 and a feed-forward width of 48."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            C, HEADS, dim_feedforward=MLP, dropout=0.0, layer_norm_eps=1e-3, norm_first=True, batch_first=True
        )
        self.embed = nn.Linear(IN, C)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


# the encoder through torch.export: its nn.MultiheadAttention decomposed into scaled_dot_product_attention
@pytest.mark.parametrize("make, norm, capture", [(Functional, "RMSNorm", "fx"), (Encoder, "LayerNorm", "export")])
def test_block_is_read_from_the_stream_and_heads_analyses(make, norm, capture):
    torch.manual_seed(0)
    gm = gg.trace(make().eval(), input_shape=(2, 8, IN), capture=capture)
    result = gg.get_pass("deepen")(block="transformer", attention="bidirectional")(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    block = result.targets["block"]
    assert (
        f"{norm}(eps=0.001)" in block
        and f"{HEADS} heads (the model's own attention)" in block
        and f"MLP {C}→{MLP}→{C}" in block
    )
    root = next(
        name for name, m in result.gm.named_modules() if name.startswith("deepen_transformer") and hasattr(m, "fc1")
    )
    new = result.gm.get_submodule(root)
    assert type(new.norm1) is getattr(nn, norm) and new.norm1.eps == 1e-3 and new.fc1.out_features == MLP
    assert (new.q.bias is None) == (norm == "RMSNorm")  # biases as the model's norms have them (LLaMA: none)


def test_timm_vit_norm_eps_comes_from_its_stream():
    """timm's LayerNorm subclass is traced into F.layer_norm calls, so no nn.LayerNorm module shows its eps (1e-6):
    the stream's norms do (a scan of the modules found none and fell back to LayerNorm(eps=1e-5))."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=1,
        embed_dim=32,
        num_heads=2,
        num_classes=3,
    )
    gm = gg.trace(model.eval(), input_shape=(1, 3, 32, 32))
    assert not any(isinstance(m, nn.LayerNorm) for m in gm.modules())
    result = gg.get_pass("deepen")(block="transformer")(gm)
    assert "LayerNorm(eps=1e-06), 2 heads (the model's own attention), MLP 32→128→32" in result.targets["block"]
    assert result.preservation.eval.ok and result.preservation.train.ok


def test_a_stream_from_the_models_input_still_gets_a_block():
    """The stream analysis refuses a stream that starts at the model's input or is its output (their widths are the
    caller's: it cannot grow); deepen does not grow it, so it reads the model's modules instead and still inserts the
    block. The heads analysis answers there as everywhere."""
    torch.manual_seed(0)
    gm = gg.trace(nn.Sequential(FunctionalBlock(), FunctionalBlock()).eval(), input_shape=(2, 8, C))
    result = gg.get_pass("deepen")(block="transformer", attention="bidirectional")(gm)
    with pytest.raises(gg.NotApplicable, match="the model's input|a model output"):
        find_stream(result.gm)
    assert f"{HEADS} heads (the model's own attention)" in result.targets["block"]
    assert result.preservation.eval.ok and result.preservation.train.ok
