"""A DARTS evaluation network written the way published NAS code writes it (issue 37), for tests.

examples/darts_net.py is the project's own, tidy DARTS network. Research code that users bring looks
different, and the tracer must not depend on the tidy spelling. This network is written in that other
style (by us, from the description of the DARTS evaluation network; not copied): operations as modules
that wrap an `nn.Sequential` in `self.op`, a home-made `Identity`, a module-level
`drop_path(x, drop_prob)` that draws its mask with a legacy typed constructor or an older tensor idiom,
wraps it in `Variable`, and scales and masks the input *in place*; the training loop sets
`model.drop_path_prob` (no default in `__init__`) and `forward` hands it to every cell; an optional
auxiliary head exists only in train mode.

`drop_path` is the published form (a CUDA mask); `DROP_PATHS` holds it and variants whose masks are spelled
as other code bases spell them, in place or not (the `idiom` argument of `network()`). All draw one
Bernoulli(keep_prob) number per sample from the global generator of the input's device; `cuda_typed` (and
`cuda_typed_bare`)
needs CUDA in eager mode (tests that run it on CPU patch `torch.cuda.FloatTensor` to the CPU class).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.autograd import Variable

# A common spelling in older code: pick the typed class once, at import.
Tensor = torch.cuda.FloatTensor if torch.cuda.is_available() else torch.FloatTensor


# --- the masks, one spelling each -----------------------------------------------------------------------------


def _cuda_typed_bare(x, keep_prob):
    return torch.cuda.FloatTensor(x.size(0), 1, 1, 1).bernoulli_(keep_prob)


def _cpu_typed(x, keep_prob):
    return Variable(torch.FloatTensor(x.size(0), 1, 1, 1).bernoulli_(keep_prob))


def _alias_typed(x, keep_prob):
    return Variable(Tensor(x.size(0), 1, 1, 1).bernoulli_(keep_prob))


def _new(x, keep_prob):
    return x.new(x.size(0), 1, 1, 1).bernoulli_(keep_prob)


def _new_empty(x, keep_prob):
    return Variable(x.new_empty((x.size(0), 1, 1, 1)).bernoulli_(keep_prob))


def _new_zeros_uniform(x, keep_prob):
    noise = x.new_zeros(x.size(0), 1, 1, 1).uniform_()
    return (noise < keep_prob).to(x.dtype)


def _new_full(x, keep_prob):
    return torch.bernoulli(x.new_full((x.size(0), 1, 1, 1), keep_prob))


def _empty_device(x, keep_prob):
    return torch.empty(x.size(0), 1, 1, 1, device=x.device).bernoulli_(keep_prob)


def _bernoulli_full(x, keep_prob):
    return torch.bernoulli(torch.full((x.size(0), 1, 1, 1), keep_prob, device=x.device, dtype=x.dtype))


def _rand_less(x, keep_prob):
    return (torch.rand(x.size(0), 1, 1, 1, device=x.device) < keep_prob).float()


def _ones_bernoulli(x, keep_prob):
    return Variable(torch.ones(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device) * keep_prob).bernoulli()


def drop_path(x, drop_prob):
    """The published form: a CUDA mask wrapped in Variable, the input scaled and masked in place."""
    if drop_prob > 0.0:
        keep_prob = 1.0 - drop_prob
        mask = Variable(torch.cuda.FloatTensor(x.size(0), 1, 1, 1).bernoulli_(keep_prob))
        x.div_(keep_prob)
        x.mul_(mask)
    return x


def _in_place(mask_of):
    def drop_path(x, drop_prob):
        if drop_prob > 0.0:
            keep_prob = 1.0 - drop_prob
            mask = mask_of(x, keep_prob)
            x.div_(keep_prob)
            x.mul_(mask)
        return x

    return drop_path


def _out_of_place(mask_of):
    def drop_path(x, drop_prob):
        if drop_prob > 0.0:
            keep_prob = 1.0 - drop_prob
            x = x / keep_prob * mask_of(x, keep_prob)
        return x

    return drop_path


# idiom → drop_path(x, drop_prob)
DROP_PATHS: dict[str, Callable] = {
    "cuda_typed": drop_path,
    "cuda_typed_bare": _in_place(_cuda_typed_bare),
    "cpu_typed": _in_place(_cpu_typed),
    "alias_typed": _in_place(_alias_typed),
    "cpu_typed_out_of_place": _out_of_place(_cpu_typed),
    "new": _out_of_place(_new),
    "new_empty": _in_place(_new_empty),
    "new_zeros_uniform": _out_of_place(_new_zeros_uniform),
    "new_full": _out_of_place(_new_full),
    "empty_device": _in_place(_empty_device),
    "empty_device_out_of_place": _out_of_place(_empty_device),
    "bernoulli_full": _out_of_place(_bernoulli_full),
    "rand_less": _in_place(_rand_less),
    "ones_bernoulli": _out_of_place(_ones_bernoulli),
}


# --- operations -------------------------------------------------------------------------------------------------


class ReLUConvBN(nn.Module):
    def __init__(self, C_in, C_out, kernel_size, stride, padding, affine=True):
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(C_in, C_out, kernel_size, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(C_out, affine=affine),
        )

    def forward(self, x):
        return self.op(x)


class DilConv(nn.Module):
    def __init__(self, C_in, C_out, kernel_size, stride, padding, dilation, affine=True):
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(C_in, C_in, kernel_size, stride, padding, dilation=dilation, groups=C_in, bias=False),
            nn.Conv2d(C_in, C_out, kernel_size=1, padding=0, bias=False),
            nn.BatchNorm2d(C_out, affine=affine),
        )

    def forward(self, x):
        return self.op(x)


class SepConv(nn.Module):
    def __init__(self, C_in, C_out, kernel_size, stride, padding, affine=True):
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(inplace=False),
            nn.Conv2d(C_in, C_in, kernel_size, stride, padding, groups=C_in, bias=False),
            nn.Conv2d(C_in, C_in, kernel_size=1, padding=0, bias=False),
            nn.BatchNorm2d(C_in, affine=affine),
            nn.ReLU(inplace=False),
            nn.Conv2d(C_in, C_in, kernel_size, 1, padding, groups=C_in, bias=False),
            nn.Conv2d(C_in, C_out, kernel_size=1, padding=0, bias=False),
            nn.BatchNorm2d(C_out, affine=affine),
        )

    def forward(self, x):
        return self.op(x)


class Identity(nn.Module):
    def forward(self, x):
        return x


class FactorizedReduce(nn.Module):
    def __init__(self, C_in, C_out, affine=True):
        super().__init__()
        assert C_out % 2 == 0
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, padding=0, bias=False)
        self.conv_2 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, padding=0, bias=False)
        self.bn = nn.BatchNorm2d(C_out, affine=affine)

    def forward(self, x):
        x = self.relu(x)
        out = torch.cat([self.conv_1(x), self.conv_2(x[:, :, 1:, 1:])], dim=1)
        return self.bn(out)


OPS = {
    "max_pool_3x3": lambda C, stride: nn.MaxPool2d(3, stride=stride, padding=1),
    "avg_pool_3x3": lambda C, stride: nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False),
    "skip_connect": lambda C, stride: Identity() if stride == 1 else FactorizedReduce(C, C),
    "sep_conv_3x3": lambda C, stride: SepConv(C, C, 3, stride, 1),
    "sep_conv_5x5": lambda C, stride: SepConv(C, C, 5, stride, 2),
    "dil_conv_3x3": lambda C, stride: DilConv(C, C, 3, stride, 2, 2),
}

# Our cell: (op, input) pairs, two per intermediate node; inputs 0 and 1 are the cell's inputs.
NORMAL = [
    ("sep_conv_3x3", 0),
    ("skip_connect", 1),
    ("dil_conv_3x3", 1),
    ("sep_conv_3x3", 2),
    ("skip_connect", 0),
    ("avg_pool_3x3", 3),
]
REDUCE = [
    ("max_pool_3x3", 0),
    ("sep_conv_5x5", 1),
    ("skip_connect", 2),
    ("skip_connect", 0),
    ("dil_conv_3x3", 2),
    ("max_pool_3x3", 1),
]
CONCAT = [2, 3, 4]


# --- cells and the network --------------------------------------------------------------------------------------


class Cell(nn.Module):
    def __init__(self, C_prev_prev, C_prev, C, reduction, reduction_prev, idiom):
        super().__init__()
        if reduction_prev:
            self.preprocess0 = FactorizedReduce(C_prev_prev, C)
        else:
            self.preprocess0 = ReLUConvBN(C_prev_prev, C, 1, 1, 0)
        self.preprocess1 = ReLUConvBN(C_prev, C, 1, 1, 0)
        ops = REDUCE if reduction else NORMAL
        self._steps = len(ops) // 2
        self._concat = CONCAT
        self.multiplier = len(CONCAT)
        self.reduction = reduction
        self._idiom = idiom
        self._ops = nn.ModuleList()
        for name, index in ops:
            stride = 2 if reduction and index < 2 else 1
            self._ops += [OPS[name](C, stride)]
        self._indices = [index for _, index in ops]

    def forward(self, s0, s1, drop_prob):
        s0 = self.preprocess0(s0)
        s1 = self.preprocess1(s1)
        states = [s0, s1]
        for i in range(self._steps):
            h1 = states[self._indices[2 * i]]
            h2 = states[self._indices[2 * i + 1]]
            op1 = self._ops[2 * i]
            op2 = self._ops[2 * i + 1]
            h1 = op1(h1)
            h2 = op2(h2)
            if self.training and drop_prob > 0.0:
                if not isinstance(op1, Identity):
                    h1 = DROP_PATHS[self._idiom](h1, drop_prob)
                if not isinstance(op2, Identity):
                    h2 = DROP_PATHS[self._idiom](h2, drop_prob)
            s = h1 + h2
            states += [s]
        return torch.cat([states[i] for i in self._concat], dim=1)


class AuxiliaryHead(nn.Module):
    def __init__(self, C, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.ReLU(inplace=True),
            nn.AvgPool2d(3, stride=2, padding=0, count_include_pad=False),
            nn.Conv2d(C, 64, 1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = torch.mean(x, dim=(2, 3))
        return self.classifier(x)


class Network(nn.Module):
    def __init__(self, C, num_classes, layers, auxiliary, idiom="cuda_typed"):
        super().__init__()
        self._layers = layers
        self._auxiliary = auxiliary
        stem_multiplier = 3
        C_curr = stem_multiplier * C
        self.stem = nn.Sequential(nn.Conv2d(3, C_curr, 3, padding=1, bias=False), nn.BatchNorm2d(C_curr))
        C_prev_prev, C_prev, C_curr = C_curr, C_curr, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            if i in [layers // 3, 2 * layers // 3]:
                C_curr *= 2
                reduction = True
            else:
                reduction = False
            cell = Cell(C_prev_prev, C_prev, C_curr, reduction, reduction_prev, idiom)
            reduction_prev = reduction
            self.cells += [cell]
            C_prev_prev, C_prev = C_prev, cell.multiplier * C_curr
            if i == 2 * layers // 3:
                C_to_auxiliary = C_prev
        if auxiliary:
            self.auxiliary_head = AuxiliaryHead(C_to_auxiliary, num_classes)
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(C_prev, num_classes)

    def forward(self, input):
        logits_aux = None
        s0 = s1 = self.stem(input)
        for i, cell in enumerate(self.cells):
            s0, s1 = s1, cell(s0, s1, self.drop_path_prob)
            if i == 2 * self._layers // 3:
                if self._auxiliary and self.training:
                    logits_aux = self.auxiliary_head(s1)
        out = self.global_pooling(s1)
        logits = self.classifier(out.view(out.size(0), -1))
        return logits, logits_aux


def network(
    idiom: str = "cuda_typed",
    auxiliary: bool = False,
    layers: int = 4,
    C: int = 6,
    seed: int = 0,
    drop_path_prob: float = 0.2,
) -> Network:
    """A small network (4 cells, reductions at cells 1 and 2; a 2×3×16×16 batch runs in milliseconds on CPU),
    weights from `seed` without touching the caller's generator, `drop_path_prob` set as a training loop would."""
    if idiom not in DROP_PATHS:
        raise ValueError(f"unknown mask idiom {idiom!r}; known: {', '.join(DROP_PATHS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Network(C, 10, layers, auxiliary, idiom)
    model.drop_path_prob = drop_path_prob
    return model
