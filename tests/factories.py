"""Tiny model factories for tests that name a model as `module:factory` (random weights, like torchvision's)."""

import torch
from torch import nn

load_weights = torch.load  # a re-exported loader: naming it as a factory must be refused


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    ).eval()


class ModeGate(nn.Module):
    """Train-only work that calls a submodule: graphgrow cannot merge its two modes and keeps it whole as a
    leaf, so a file holding it needs --trust."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Hardtanh(0.0, 0.5)

    def forward(self, x):
        return self.scale(x) if self.training else x


def cnn_with_custom_leaf() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        ModeGate(),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    ).eval()


def exits() -> nn.Module:
    """A factory that raises SystemExit: graphgrow reports it in one line (exit 2) instead of exiting."""
    raise SystemExit(3)


def fails() -> nn.Module:
    raise ValueError("no model today")


def square_linear(n: int = 4) -> nn.Module:
    return nn.Linear(n, n)


def needs_real_tensors() -> nn.Module:
    """Computes a size from a real tensor (.item() has no value on the meta device)."""
    return nn.Linear(int(torch.ones(3).sum().item()), 2)


class TokenClassifier(nn.Module):
    """Token ids → embedding → a plain nn.TransformerEncoder → per-token logits: a model whose input is not a float
    image."""

    def __init__(self, vocab: int = 50, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 5)

    def forward(self, input_ids):
        return self.head(self.encoder(self.embed(input_ids)))


def token_classifier() -> nn.Module:
    return TokenClassifier().eval()


def audio_cnn() -> nn.Module:
    """A 1-D conv net over a raw waveform [N, 1, samples]: strided Conv1d + BatchNorm stack, pooled, classified."""

    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv1d(cin, cout, 9, stride=stride, padding=4), nn.BatchNorm1d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(1, 8, 4), *block(8, 16, 4), *block(16, 16, 2), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 6)
    ).eval()


class _ClippedLinear(nn.Module):
    """A Linear whose input is clamped to bounds kept in buffers, ±inf until calibrated (Gemma 4's encoders)."""

    def __init__(self, n: int, broken: bool):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("input_min", torch.tensor(float("nan") if broken else float("-inf")))
        self.register_buffer("input_max", torch.tensor(float("inf")))

    def forward(self, x):
        return self.lin(torch.clamp(x, self.input_min, self.input_max))


def clipped_mlp(broken: bool = False) -> nn.Module:
    return nn.Sequential(_ClippedLinear(8, broken), nn.ReLU(), nn.Linear(8, 4)).eval()
