"""Models that cannot be captured whole (neither torch.fx nor torch.export) around a part that can: the growth inside
a captured part (graphgrow/capture/parts.py) is tested on them (tests/test_parts.py). Each factory is named as
`tests.part_models:NAME` in the tests, as a user's own code would be.

Spellings of what detection models do after a capturable backbone: a forward that loops over the images of a batch
as a list, boolean-mask filtering whose count is branched on, nonzero and `.item()` sizes, and dict/list outputs.
"""

from __future__ import annotations

import torch
from torch import nn


def _backbone(width: int = 8) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width * 2, 3, stride=2, padding=1),
        nn.BatchNorm2d(width * 2),
        nn.ReLU(),
        nn.Conv2d(width * 2, width * 2, 3, padding=1),
        nn.BatchNorm2d(width * 2),
        nn.ReLU(),
    )


class LoopedImages(nn.Module):
    """A list of images, one at a time through the backbone's features and a per-image filter (each image's
    boxes above a threshold: a boolean mask, a branch on its count); a list of dicts out."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _backbone()
        self.score = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        features = self.backbone(x)
        images = list(features.unbind(0))  # the batch as a list of images
        out = []
        for f in images:
            s = self.score(f.unsqueeze(0)).flatten()
            keep = s > 0.0
            if keep.sum() == 0:  # a branch on a count read from the data
                out.append({"scores": s[:0], "index": torch.zeros(0, dtype=torch.long)})
                continue
            out.append({"scores": s[keep], "index": keep.nonzero().flatten()})
        return out


class NonzeroTopk(nn.Module):
    """A backbone, then a size read from the data with .item() (as many detections as scores over a bound), topk of
    that many; a tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.features = _backbone(6)
        self.head = nn.Conv2d(12, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head(self.features(x))
        scores = h[:, 0].flatten(1)
        n = int((scores > 0).sum().item()) + 1
        top, idx = scores.flatten().topk(min(n, scores.numel()))
        return top, idx


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TokensFiltered(nn.Module):
    """Patch tokens through a transformer-style stack (the part), then tokens kept by a boolean mask per image of a
    batch held as a list; a dict of lists out."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d, 4, stride=4)
        self.encoder = nn.Sequential(Block(d), Block(d), Block(d))
        self.keep = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = self.encoder(tokens)
        kept = []
        for t in tokens:  # iterating the batch
            mask = self.keep(t).squeeze(-1) > 0
            kept.append(t[mask] if bool(mask.any()) else t[:1])
        return {"tokens": kept}


class LargerUncapturable(nn.Module):
    """A larger submodule that cannot be captured (its own forward filters by a mask and branches on the count)
    beside a smaller backbone that can: the part is the backbone, and the larger one is named as passed over."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _backbone(4)
        self.post = Filtering(8)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        kept = self.post(self.backbone(x))
        if kept[0].shape[0] > 3:  # a branch at the top level on a size that follows the data
            return [kept[0][:3]]
        return kept


class Filtering(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.proj = nn.Linear(c, 96)  # each child smaller than the backbone, the two together larger
        self.out = nn.Linear(96, 4)

    def forward(self, f: torch.Tensor) -> list[torch.Tensor]:
        tokens = self.out(torch.relu(self.proj(f.flatten(2).transpose(1, 2))))
        keep = tokens[..., 0] > 0
        if keep.sum() == 0:
            return [tokens[:, :0]]
        return [tokens[keep]]


class HeadLarger(nn.Module):
    """An MLP head larger than the conv backbone, both capturable, then a filter by a mask branched on its count:
    add_branch (conv branches) does not apply to the head and goes to the backbone."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _backbone(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.head(self.backbone(x))
        keep = s > 0
        if keep.sum() == 0:
            return s[:0]
        return s[keep]


class HeadLargerScaled(HeadLarger):
    """HeadLarger with a parameter of its own (a gain at the top level): no part holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 1.0) * self.gain[0]


class SharedHead(nn.Module):
    """A backbone called once, then one head applied to two feature levels (as a detector's head is to each level of
    its pyramid), then a filter by a mask: the head is no part (called twice), but it can be asked whether a pass
    has a place in it."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _backbone(4)
        self.head = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        f = self.backbone(x)
        levels = [self.head(f), self.head(nn.functional.avg_pool2d(f, 2))]
        out = []
        for s in levels:
            keep = s.flatten() > 0
            out.append(s.flatten()[keep] if keep.sum() > 0 else s.flatten()[:0])
        return out


class NoPart(nn.Module):
    """Nothing capturable holds parameters: the one layer is called once per image (and takes a list elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for img in x.unbind(0):
            y = self.conv(img.unsqueeze(0)).flatten()
            keep = y > 0
            out.append(y[keep] if keep.sum() > 0 else y[:0])
        for img in x.unbind(0):
            out.append(self.conv(img.unsqueeze(0)).mean().reshape(1))
        return out


def looped_images() -> nn.Module:
    torch.manual_seed(0)
    return LoopedImages()


def nonzero_topk() -> nn.Module:
    torch.manual_seed(0)
    return NonzeroTopk()


def tokens_filtered() -> nn.Module:
    torch.manual_seed(0)
    return TokensFiltered()


def larger_uncapturable() -> nn.Module:
    torch.manual_seed(0)
    return LargerUncapturable()


def no_part() -> nn.Module:
    torch.manual_seed(0)
    return NoPart()


def head_larger() -> nn.Module:
    torch.manual_seed(0)
    return HeadLarger()


def head_larger_scaled() -> nn.Module:
    torch.manual_seed(0)
    return HeadLargerScaled()


def shared_head() -> nn.Module:
    torch.manual_seed(0)
    return SharedHead()
