"""Tiny model factories for tests that name a model as `module:factory` (random weights, like torchvision's)."""
from torch import nn


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()


class ModeGate(nn.Module):
    """Branches on self.training: graphgrow keeps it whole as a leaf, so a file holding it needs --trust."""

    def forward(self, x):
        return x * 0.5 if self.training else x


def cnn_with_custom_leaf() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), ModeGate(), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
