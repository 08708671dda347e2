"""deepen on a video's feature maps (N, C, T, H, W): a Conv3d + BatchNorm3d + ReLU block behind a zero gate, as on
an image's maps with Conv2d (issue 39: torchvision r3d_18, mc3_18 and r2plus1d_18 deepen were refused, 'linear_relu
needs (N, F) or (N, T, F) features'). Three spellings of a video net: 3-D convs as modules (R3D), factorised
(2+1)-D convs (R(2+1)D), and functional F.conv3d on parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import plain_spec

SHAPE = [2, 3, 4, 8, 8]


class R3D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8), nn.ReLU())
        self.layer = nn.Sequential(nn.Conv3d(8, 8, 3, stride=(1, 2, 2), padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.pool(self.layer(self.stem(x))).flatten(1))


class R2Plus1D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spatial = nn.Conv3d(3, 6, (1, 3, 3), padding=(0, 1, 1))
        self.temporal = nn.Conv3d(6, 8, (3, 1, 1), padding=(1, 0, 0))
        self.bn = nn.BatchNorm3d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.temporal(F.relu(self.spatial(x)))))
        return self.fc(x.mean(dim=(2, 3, 4)))


class Functional3D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3, 3) * 0.2)
        self.b1 = nn.Parameter(torch.zeros(8))
        self.w2 = nn.Parameter(torch.randn(8, 8, 1, 3, 3) * 0.2)
        self.head = nn.Parameter(torch.randn(5, 8) * 0.2)

    def forward(self, x):
        x = torch.relu(F.conv3d(x, self.w1, self.b1, padding=1))
        x = torch.relu(F.conv3d(x, self.w2, None, padding=(0, 1, 1)))
        return F.adaptive_avg_pool3d(x, 1).flatten(1) @ self.head.t()


# functional convs hold no conv modules, so no stage ends are found (the default place would be the logits): named
@pytest.mark.parametrize("make, after", [(R3D, None), (R2Plus1D, None), (Functional3D, "relu_1")])
def test_deepen_puts_a_3d_conv_block_on_a_videos_feature_map(make, after):
    torch.manual_seed(0)
    model = make().eval()
    gm = gg.trace(model, input_shape=plain_spec(SHAPE))
    result = gg.get_pass("deepen")(after=after)(gm)
    grown = result.gm
    convs = [m for n, m in grown.named_modules() if "deepen" in n and isinstance(m, nn.Conv3d)]
    norms = [m for n, m in grown.named_modules() if "deepen" in n and isinstance(m, nn.BatchNorm3d)]
    assert len(convs) == 1 and len(norms) == 1 and convs[0].kernel_size == (3, 3, 3)
    assert "conv_bn_relu" in result.targets["block"]
    x = torch.randn(*SHAPE)
    for mode in (False, True):  # the gate is zero: the same function in both modes
        model.train(mode), grown.train(mode)
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(grown(x), expected, rtol=1e-5, atol=1e-6)
