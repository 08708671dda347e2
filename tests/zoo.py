"""A sample of timm architectures (random weights, small variants and inputs) covering the structures
graphgrow must handle: drop-path, squeeze-excitation, depthwise-separable and grouped convs, channels-last
LayerNorm blocks, hybrid conv-transformers, pure ViTs, TF-"same" padding, batch-folding attention and
forwards that branch on self.training. No weights are downloaded (pretrained=False). ResNet and ConvNeXt keep one
block per stage and the two ViTs two blocks (timm's depth arguments): the same block types and stage transitions in
a fraction of the graph, since the zoo's time is mostly torch.onnx.export, which grows with the node count (LeViT
kept its depth: one block per stage measured no faster)."""

from __future__ import annotations

import torch

# name → (timm kwargs, input shape, what it covers)
ZOO: dict[str, tuple[dict, tuple[int, ...], str]] = {
    "convnext_atto": (
        {"drop_path_rate": 0.1, "depths": (1, 1, 1, 1)},
        (1, 3, 64, 64),
        "channels-last blocks, LayerNorm2d, drop-path, layer scale",
    ),
    "efficientnet_b0": (
        {"drop_path_rate": 0.2, "drop_rate": 0.2},
        (1, 3, 64, 64),
        "squeeze-excitation, depthwise-separable, BatchNormAct2d, drop-path, head dropout on self.training",
    ),
    "mobilenetv3_small_050": ({}, (1, 3, 64, 64), "hard-swish, squeeze-excitation, depthwise convs"),
    "tf_mobilenetv3_small_minimal_100": ({}, (1, 3, 64, 64), "TF-'same' padding (data-dependent pad)"),
    "regnetx_002": ({}, (1, 3, 64, 64), "grouped convs"),
    "resnet18": ({"drop_path_rate": 0.1, "layers": (1, 1, 1, 1)}, (1, 3, 64, 64), "residual stages with drop-path"),
    "ghostnet_050": ({}, (1, 3, 64, 64), "ghost modules (cat of cheap features), squeeze-excitation"),
    "vit_tiny_patch16_224": (
        {"img_size": 32, "drop_path_rate": 0.1, "depth": 2},
        (1, 3, 32, 32),
        "pure vision transformer, attention folds the batch (3, B, heads, N, d)",
    ),
    "deit_tiny_distilled_patch16_224": (
        {"img_size": 32, "depth": 2},
        (1, 3, 32, 32),
        "distillation head: the top-level forward branches on self.training",
    ),
    "mobilevit_xxs": ({}, (1, 3, 64, 64), "hybrid conv-transformer, patches folded into the batch"),
    "levit_128s": ({"img_size": 64}, (1, 3, 64, 64), "attention that caches biases when not training (self.training)"),
    "poolformer_s12": ({}, (1, 3, 64, 64), "GroupNorm(1) channel mixing, pooling token mixer, layer scale"),
}


def build(name: str) -> torch.nn.Module:
    import timm

    kwargs, _, _ = ZOO[name]
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **kwargs)


def _factory(name: str):
    def make() -> torch.nn.Module:
        return build(name)

    make.__name__ = name
    return make


# `zoo:NAME` works as a graphgrow model name (package.module:factory) with tests/ on sys.path.
globals().update({name: _factory(name) for name in ZOO})
