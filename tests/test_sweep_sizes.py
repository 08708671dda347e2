"""The timm sweep's input size (tools/sweep_models._timm_size): a model that takes sizes other than its own gets the
first of TIMM_SIZES it runs at on the meta device (issue 39: deepseek_vit_412m asserted its patch size 14 divides
the height at 64×64 and haloregnetz_b's halo attention asserted at 64×64, on every pass)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sweep_models  # noqa: E402


class _Patches(nn.Module):
    """A patch embedding that asserts its patch size divides the input (timm's PatchEmbed spelling)."""

    def __init__(self, patch: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv2d(3, 8, patch, stride=patch)

    def forward(self, x):
        assert x.shape[-1] % self.patch == 0, f"Input height ({x.shape[-1]}) should be divisible by {self.patch}"
        return self.proj(x).flatten(1)


class _Blocks(nn.Module):
    """A map cut into blocks with torch._assert (halo attention's spelling): 7 blocks after 16× downsampling."""

    def forward(self, x):
        torch._assert((x.shape[-1] // 16) % 7 == 0, "blocks")
        return x.mean((2, 3))


class _MetaFails(nn.Module):
    def forward(self, x):
        return x * x.sum().item()  # the meta device cannot run it at any size


@pytest.mark.parametrize(
    "make, size",
    [
        (lambda: nn.Conv2d(3, 4, 3), "64,64"),
        (lambda: _Patches(14), "112,112"),
        (lambda: _Patches(32), "64,64"),
        (lambda: _Patches(48), "96,96"),
        (_Blocks, "112,112"),
        (lambda: _Patches(224), "224,224"),
        (_MetaFails, "64,64"),
    ],
)
def test_the_first_size_a_model_runs_at(monkeypatch, make, size):
    built = []
    monkeypatch.setattr(timm, "create_model", lambda name: built.append(make()) or built[-1])
    assert sweep_models._timm_size("stand-in", 3) == size
    assert all(p.is_meta for m in built for p in m.parameters())  # built on the meta device: nothing allocated


def test_a_count_the_config_leaves_none_is_filled_only_where_the_model_needs_it(monkeypatch):
    """Dots1's config leaves n_shared_experts None and its MoE layer multiplies by it: the smallest count, 1, is
    filled where the model does not build without it (a stand-in Auto class reading it as Dots1 does); a model that
    reads None as 'none' builds and is left as shrunk; token ids are never counts."""
    from dataclasses import dataclass

    import transformers

    @dataclass
    class Cfg:
        hidden_size: int = 64
        num_hidden_layers: int = 2
        moe_intermediate_size: int = 32
        n_shared_experts: int | None = None
        pad_token_id: int | None = None

    class Multiplies:
        @staticmethod
        def from_config(config):
            return config.moe_intermediate_size * config.n_shared_experts + (config.pad_token_id or 0)

    class ReadsNoneAsNone:
        @staticmethod
        def from_config(config):
            return config.moe_intermediate_size * (config.n_shared_experts or 0)

    monkeypatch.setattr(transformers, "StandInMultiplies", Multiplies, raising=False)
    monkeypatch.setattr(transformers, "StandInNone", ReadsNoneAsNone, raising=False)
    kw: dict = {}
    sweep_models._ordinary_values(Cfg, "StandInMultiplies", kw)
    assert kw == {"n_shared_experts": 1}
    kw = {}
    sweep_models._ordinary_values(Cfg, "StandInNone", kw)
    assert kw == {}


class _FixedTable(nn.Module):
    """A ViT's position table: built for `img_size`, and the input must match it (timm's strict PatchEmbed)."""

    def __init__(self, img_size: int = 224, patch: int = 16):
        super().__init__()
        self.img_size, self.patch = img_size, patch
        self.pos = nn.Parameter(torch.zeros(1, (img_size // patch) ** 2, 8))
        self.proj = nn.Conv2d(3, 8, patch, stride=patch)

    def forward(self, x):
        assert x.shape[-1] == self.img_size, f"Input width ({x.shape[-1]}) doesn't match model ({self.img_size})"
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class _NoImgSize(_FixedTable):
    def __init__(self):  # takes no img_size: stays at its own size
        super().__init__()


@pytest.mark.parametrize(
    "make, size",
    [
        (lambda **kw: _FixedTable(**kw), 64),
        (lambda **kw: _FixedTable(patch=14 * 8, **kw), 112),  # 64 and 96 are smaller than one patch
        (lambda **kw: _NoImgSize(**kw), None),
    ],
)
def test_a_fixed_size_model_is_built_for_the_smallest_img_size_it_takes(monkeypatch, make, size):
    """A model fixed to its size (a ViT's position table, issue 39: beitv2_base at 224 took minutes per pass) gets
    the smallest of TIMM_SIZES it builds with as `img_size` and runs at; none when it takes no img_size."""
    built = []
    monkeypatch.setattr(timm, "create_model", lambda name, **kw: built.append(make(**kw)) or built[-1])
    assert sweep_models._timm_fixed_size("stand-in", 3, 224) == size
    assert all(p.is_meta for m in built for p in m.parameters())


class _Unfolds(nn.Module):
    """MobileViTv2's last stage: a map downsampled `down`× then cut into 2 × 2 patches by F.unfold (none at 1 × 1)."""

    def __init__(self, down: int, spelling: str):
        super().__init__()
        self.conv, self.spelling = nn.Conv2d(3, 4, down, stride=down), spelling
        self.bn = nn.BatchNorm2d(4)

    def forward(self, pixel_values):
        x = self.bn(self.conv(pixel_values))  # a 1 × 1 map at batch 1 would fail in train mode: checked in eval
        if self.spelling == "F.unfold":
            return nn.functional.unfold(x, kernel_size=2, stride=2)
        if self.spelling == "Tensor.unfold":
            return x.unfold(2, 2, 2).unfold(3, 2, 2)  # raises too at 1 × 1
        b, c, h, w = x.shape  # windows of 7 (Swin's view)
        return x.view(b, c, h // 7, 7, w // 7, 7)


@pytest.mark.parametrize(
    "down, spelling, size",
    [
        (32, "F.unfold", 64),  # 32 × 32 → 1 × 1: no 2 × 2 block
        (16, "F.unfold", 32),  # 2 × 2 at 32: runs as shrunk
        (32, "Tensor.unfold", 64),
        (4, "windows of 7", 224),  # 8 × 8 … 40 × 40 are no multiples of 7; 56 × 56 is
    ],
)
def test_an_image_model_gets_the_first_size_it_runs_at(monkeypatch, down, spelling, size):
    """hf image models are shrunk to 32 × 32 images; one that does not run there gets the first of HF_SIZES it runs
    at, built and run on the meta device (issue 39: hf mobilevitv2 'node unfold_2 fails ... (0, 0)' on every pass)."""
    from dataclasses import dataclass

    import transformers

    @dataclass
    class Cfg:
        image_size: int = 224
        num_channels: int = 3

    built: list[nn.Module] = []

    class StandIn:
        @staticmethod
        def from_config(config):
            built.append(_Unfolds(down, spelling))
            built[-1].config = config
            return built[-1]

    monkeypatch.setattr(transformers, "StandInImages", StandIn, raising=False)
    kw = {"image_size": sweep_models.IMAGE}
    sweep_models._image_size_that_runs(Cfg, "StandInImages", kw)
    assert kw == {"image_size": size}
    assert all(p.is_meta for m in built for p in m.parameters())  # nothing allocated


class _Windows(nn.Module):
    """Swin's windows of config.window_size over a map downsampled 4×, then a relative-position table made for
    the window's size and added to each window's scores (transformers' Swin: a window clamped to a smaller map no
    longer matches its table, so windows of 7 run only where every map is a multiple of 7)."""

    def __init__(self, window: int):
        super().__init__()
        self.conv, self.window = nn.Conv2d(3, 4, 4, stride=4), window
        self.table = nn.Parameter(torch.zeros(window * window, window * window))

    def forward(self, pixel_values):
        x = self.conv(pixel_values)
        b, c, h, w = x.shape
        ws = self.window
        win = x.view(b, c, h // ws, ws, w // ws, ws).permute(0, 2, 4, 3, 5, 1).reshape(-1, ws * ws, c)
        return (win @ win.transpose(1, 2)) + self.table


@pytest.mark.parametrize(
    "own, expected",
    [(7, {"image_size": 32, "window_size": 4}), (3, {"image_size": 32, "window_size": 2}), (2, {"image_size": 32})],
)
def test_a_windowed_image_model_gets_smaller_windows_before_larger_images(monkeypatch, own, expected):
    """transformers' Swin with its windows of 7 runs only at 224 (past 300 CPU s for deepen, issue 39); with
    windows of 4 it runs at 32. Only smaller windows are tried (3: 2; 2 runs as shrunk)."""
    from dataclasses import dataclass

    import transformers

    @dataclass
    class Cfg:
        image_size: int = 224
        num_channels: int = 3
        window_size: int = own

    built: list[nn.Module] = []

    class StandIn:
        @staticmethod
        def from_config(config):
            built.append(_Windows(config.window_size))
            built[-1].config = config
            return built[-1]

    monkeypatch.setattr(transformers, "StandInWindows", StandIn, raising=False)
    kw = {"image_size": sweep_models.IMAGE}
    sweep_models._image_size_that_runs(Cfg, "StandInWindows", kw)
    assert kw == expected
