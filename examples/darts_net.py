"""A DARTS-style evaluation network for CIFAR, written from the paper's description.

DARTS (Liu, Simonyan & Yang, "DARTS: Differentiable Architecture Search", ICLR 2019) searches
for a *cell* and then trains a larger network built by stacking copies of it. This module is
that evaluation network, written from the paper (section 3 and appendix A) rather than copied
from the published code, because it is the kind of network graphgrow was born to grow: a
multi-branch cell whose forward applies drop-path only `if self.training`, a training loop that
changes `model.drop_path_prob` every epoch, and an auxiliary head that exists only in train mode.
Tests import it as `from darts_net import ...` with examples/ on sys.path; it needs only torch.

The pieces
----------
* Operations (`OPS`, keyed by the names in `PRIMITIVES`): separable convs 3×3/5×5 (ReLU →
  depthwise → pointwise → BN, the whole stacked twice, only the first depthwise strided),
  dilated convs 3×3/5×5 (ReLU → depthwise, dilation 2 → pointwise → BN), max/avg pooling 3×3
  (average pooling excludes the padding), skip_connect (the identity, or `FactorizedReduce` when
  the edge halves the resolution) and none (a zero, strided when the edge reduces).
* `Genotype(normal, normal_concat, reduce, reduce_concat)`: each cell list holds two
  `(op, input)` pairs per intermediate node; input 0 and 1 are the cell's two inputs (the outputs
  of the cell two back and of the previous cell), input k ≥ 2 is intermediate node k - 2.
  `DARTS_V2` is the cell the paper reports (second-order search, appendix figure);
  `ALL_OPS` is ours and uses every operation at least once; `LOOSE_ENDS_3` is another member of
  the family with three intermediate nodes and, as in NASNet/ENAS, concatenates only the nodes
  no other node consumes (an architecture the tracer was not tuned on).
* `Cell`: preprocesses its two inputs to C channels (a `FactorizedReduce` for the older one when
  the previous cell halved the resolution, else ReLU-1×1 conv-BN), computes each intermediate
  node as the sum of two operations on earlier states, applies drop-path to every operation
  output except the identity while training, and concatenates the `concat` states (channels).
* `NetworkCIFAR`: 3×3 stem conv with 3·C channels + BN, `layers` cells with reduction cells
  (stride 2, channels doubled) at layers//3 and 2·layers//3, the auxiliary head after the
  second reduction cell, global average pooling and a linear classifier. The training loop sets
  `model.drop_path_prob` (a plain float, 0.0 by default) every epoch; forward hands it to
  every cell.
* `small_darts()`: a 5-cell, C=8 network that runs a 2×3×32×32 batch in milliseconds on CPU.

Outputs, and why two forms
--------------------------
`NetworkCIFAR(return_aux=True)` (the default) returns `(logits, logits_aux)` exactly as the
paper's training code expects: `logits_aux` is the auxiliary head's output in train mode and
`None` in eval mode or without the head. This is the faithful scenario a growth library has to
cope with: an output whose structure differs between modes, and a train-only head that must
never be a default place to grow.

`NetworkCIFAR(auxiliary=False, return_aux=False)` returns the logits tensor alone in both modes:
the simplest trace target of the family (one output, no top-level mode branch — the cells still
branch on `self.training` for drop-path). `return_aux=False` with `auxiliary=True` is refused,
since the head's logits would be computed and thrown away. A training loop that works with
either form uses `split_output()` and `darts_loss()`, so a grown model that returns a different
form (a tracer might drop the `None`) trains with the same code.

Details kept on purpose, because they are what made real DARTS networks hard to grow
-------------------------------------------------------------------------------------
* `drop_path` works in place (`x.div_(keep_prob); x.mul_(mask)`), as DARTS does, and draws a
  per-sample Bernoulli mask from the global RNG; the cell skips it for the identity, whose output
  *is* an earlier state that the in-place ops must not touch. `drop_path_outofplace` is the
  same function without mutation, for comparison. Masks are built with `torch.empty(...)
  .bernoulli_()` on x's device rather than a CUDA-only tensor type, so the network runs on CPU.
* The cell-op ReLUs are not in place: a cell input feeds several operations.
* The auxiliary head's first ReLU *is* in place, as in the reference implementation, so in train
  mode it rectifies the second reduction cell's output before the next cells read it; every
  consumer of that tensor begins with a ReLU, so the values do not change — but a tool that adds a
  consumer there has to notice.
* The top-level forward reads `self.training` (auxiliary head) and `self.drop_path_prob`; each
  cell reads `self.training` and the `drop_prob` argument.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = [
    "PRIMITIVES",
    "OPS",
    "Genotype",
    "DARTS_V2",
    "ALL_OPS",
    "LOOSE_ENDS_3",
    "GENOTYPES",
    "ReLUConvBN",
    "SepConv",
    "DilConv",
    "FactorizedReduce",
    "Zero",
    "Identity",
    "drop_path",
    "drop_path_outofplace",
    "Cell",
    "AuxiliaryHeadCIFAR",
    "NetworkCIFAR",
    "small_darts",
    "split_output",
    "darts_loss",
    "count_parameters",
]

# ---------------------------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------------------------

PRIMITIVES = [
    "none",
    "max_pool_3x3",
    "avg_pool_3x3",
    "skip_connect",
    "sep_conv_3x3",
    "sep_conv_5x5",
    "dil_conv_3x3",
    "dil_conv_5x5",
]

Identity = nn.Identity  # the cell tests `isinstance(op, Identity)` to spare the identity drop-path


class ReLUConvBN(nn.Sequential):
    """ReLU → conv → BN: the cells' 1×1 preprocessing of their inputs."""

    def __init__(self, C_in: int, C_out: int, kernel_size: int, stride: int, padding: int):
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(C_in, C_out, kernel_size, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(C_out),
        )


class DilConv(nn.Sequential):
    """ReLU → depthwise conv (dilated) → pointwise 1×1 conv → BN."""

    def __init__(self, C_in: int, C_out: int, kernel_size: int, stride: int, padding: int, dilation: int):
        super().__init__(
            nn.ReLU(inplace=False),
            nn.Conv2d(
                C_in, C_in, kernel_size, stride=stride, padding=padding, dilation=dilation, groups=C_in, bias=False
            ),
            nn.Conv2d(C_in, C_out, 1, bias=False),
            nn.BatchNorm2d(C_out),
        )


class SepConv(nn.Sequential):
    """Two separable convolutions in a row; only the first one is strided, and the channel
    change happens in the second pointwise conv (the first block keeps C_in channels)."""

    def __init__(self, C_in: int, C_out: int, kernel_size: int, stride: int, padding: int):
        super().__init__(
            DilConv(C_in, C_in, kernel_size, stride, padding, dilation=1),
            DilConv(C_in, C_out, kernel_size, 1, padding, dilation=1),
        )


class FactorizedReduce(nn.Module):
    """Halve the resolution without discarding three pixels in four: two 1×1 stride-2 convs, the
    second on the input shifted by one pixel, each giving half the output channels, then BN."""

    def __init__(self, C_in: int, C_out: int):
        super().__init__()
        if C_out % 2:
            raise ValueError(f"FactorizedReduce needs an even number of output channels, got {C_out}")
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(C_in, C_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(C_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(x[:, :, 1:, 1:])], dim=1))


class Zero(nn.Module):
    """The `none` operation: zeros of the output's shape (strided when the edge reduces). Written
    as a multiplication by zero so that the output keeps the input's dtype, device and graph."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return x.mul(0.0)
        return x[:, :, :: self.stride, :: self.stride].mul(0.0)


# name → factory(C, stride). Cell operations keep the channel count C; stride 2 only on the
# edges from a reduction cell's two inputs.
OPS: dict[str, Callable[[int, int], nn.Module]] = {
    "none": lambda C, stride: Zero(stride),
    "max_pool_3x3": lambda C, stride: nn.MaxPool2d(3, stride=stride, padding=1),
    "avg_pool_3x3": lambda C, stride: nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False),
    "skip_connect": lambda C, stride: Identity() if stride == 1 else FactorizedReduce(C, C),
    "sep_conv_3x3": lambda C, stride: SepConv(C, C, 3, stride, 1),
    "sep_conv_5x5": lambda C, stride: SepConv(C, C, 5, stride, 2),
    "dil_conv_3x3": lambda C, stride: DilConv(C, C, 3, stride, 2, dilation=2),
    "dil_conv_5x5": lambda C, stride: DilConv(C, C, 5, stride, 4, dilation=2),
}


# ---------------------------------------------------------------------------------------------
# Drop-path
# ---------------------------------------------------------------------------------------------


def _keep_mask(x: torch.Tensor, keep_prob: float) -> torch.Tensor:
    # One Bernoulli draw per sample from the global RNG, on x's device and dtype (no CUDA-only types).
    return torch.empty(x.size(0), 1, 1, 1, dtype=x.dtype, device=x.device).bernoulli_(keep_prob)


def drop_path(x: torch.Tensor, drop_prob: float) -> torch.Tensor:
    """DARTS-style drop-path, *in place*: zero whole samples with probability `drop_prob` and scale
    the survivors by 1/keep_prob. Mutates and returns `x` — callers must not pass a tensor that
    someone else still reads (the cell never passes an identity's output)."""
    keep_prob = 1.0 - drop_prob
    mask = _keep_mask(x, keep_prob)
    x.div_(keep_prob)
    x.mul_(mask)
    return x


def drop_path_outofplace(x: torch.Tensor, drop_prob: float) -> torch.Tensor:
    """The same draw and arithmetic as `drop_path`, returning a new tensor (x untouched).
    With the same RNG state it gives the same values as `drop_path`."""
    keep_prob = 1.0 - drop_prob
    mask = _keep_mask(x, keep_prob)
    return x.div(keep_prob).mul(mask)


# ---------------------------------------------------------------------------------------------
# Genotypes
# ---------------------------------------------------------------------------------------------

Genotype = namedtuple("Genotype", "normal normal_concat reduce reduce_concat")

# The cell DARTS found with its second-order search (the paper's appendix figure, CIFAR-10).
DARTS_V2 = Genotype(
    normal=[
        ("sep_conv_3x3", 0),
        ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 0),
        ("sep_conv_3x3", 1),
        ("sep_conv_3x3", 1),
        ("skip_connect", 0),
        ("skip_connect", 0),
        ("dil_conv_3x3", 2),
    ],
    normal_concat=list(range(2, 6)),
    reduce=[
        ("max_pool_3x3", 0),
        ("max_pool_3x3", 1),
        ("skip_connect", 2),
        ("max_pool_3x3", 1),
        ("max_pool_3x3", 0),
        ("skip_connect", 2),
        ("skip_connect", 2),
        ("max_pool_3x3", 1),
    ],
    reduce_concat=list(range(2, 6)),
)

# Ours: every primitive at least once across the two cells, on both strided (inputs 0/1 of the
# reduction cell) and unstrided edges — a strided zero, a FactorizedReduce skip and strided
# 5×5 separable and dilated convs in the reduction cell; an identity, a zero and average pooling
# on intermediate nodes in the normal cell.
ALL_OPS = Genotype(
    normal=[
        ("sep_conv_5x5", 0),
        ("dil_conv_5x5", 1),
        ("avg_pool_3x3", 1),
        ("skip_connect", 2),
        ("none", 2),
        ("sep_conv_3x3", 3),
        ("dil_conv_3x3", 0),
        ("max_pool_3x3", 4),
    ],
    normal_concat=list(range(2, 6)),
    reduce=[
        ("sep_conv_5x5", 0),
        ("skip_connect", 1),
        ("dil_conv_5x5", 1),
        ("none", 0),
        ("avg_pool_3x3", 0),
        ("sep_conv_3x3", 3),
        ("max_pool_3x3", 1),
        ("dil_conv_3x3", 2),
    ],
    reduce_concat=list(range(2, 6)),
)

# Another member of the family: three intermediate nodes, and only the "loose ends" (nodes that
# no other node consumes) concatenated, as NASNet and ENAS cells do — so the cell width is
# 2·C, not 4·C, and concat is not a range. Normal: nodes 2 and 3 feed node 4, output = cat(4).
# Reduce: node 2 feeds node 4, output = cat(3, 4).
LOOSE_ENDS_3 = Genotype(
    normal=[
        ("sep_conv_3x3", 1),
        ("skip_connect", 0),
        ("dil_conv_3x3", 0),
        ("avg_pool_3x3", 1),
        ("sep_conv_5x5", 2),
        ("skip_connect", 3),
    ],
    normal_concat=[4],
    reduce=[
        ("max_pool_3x3", 0),
        ("sep_conv_3x3", 1),
        ("skip_connect", 1),
        ("dil_conv_5x5", 0),
        ("sep_conv_3x3", 2),
        ("avg_pool_3x3", 0),
    ],
    reduce_concat=[3, 4],
)

GENOTYPES = {"DARTS_V2": DARTS_V2, "ALL_OPS": ALL_OPS, "LOOSE_ENDS_3": LOOSE_ENDS_3}


def _check_genotype_half(ops: Sequence[tuple[str, int]], concat: Sequence[int], what: str) -> int:
    """Validate one cell description and return its number of intermediate nodes."""
    if len(ops) == 0 or len(ops) % 2:
        raise ValueError(f"{what}: needs two (op, input) pairs per intermediate node, got {len(ops)} pairs")
    steps = len(ops) // 2
    for k, (name, index) in enumerate(ops):
        if name not in OPS:
            raise ValueError(f"{what}: unknown operation {name!r}; known: {', '.join(PRIMITIVES)}")
        node = 2 + k // 2
        if not 0 <= index < node:
            raise ValueError(f"{what}: node {node} reads state {index}, which is not an earlier state")
    if not concat or any(not 0 <= i < 2 + steps for i in concat):
        raise ValueError(f"{what}: concat {list(concat)} must name states 0..{1 + steps}")
    return steps


# ---------------------------------------------------------------------------------------------
# Cells and network
# ---------------------------------------------------------------------------------------------


class Cell(nn.Module):
    """One DARTS cell. Inputs: s0 (output of the cell two back) and s1 (previous cell);
    output: the concatenation of the genotype's concat states, `multiplier`·C channels."""

    def __init__(
        self, genotype: Genotype, C_prev_prev: int, C_prev: int, C: int, reduction: bool, reduction_prev: bool
    ):
        super().__init__()
        self.reduction = reduction
        # s0 is at twice s1's resolution when the previous cell reduced: bring it down losslessly.
        self.preprocess0 = FactorizedReduce(C_prev_prev, C) if reduction_prev else ReLUConvBN(C_prev_prev, C, 1, 1, 0)
        self.preprocess1 = ReLUConvBN(C_prev, C, 1, 1, 0)
        ops, concat = (
            (genotype.reduce, genotype.reduce_concat) if reduction else (genotype.normal, genotype.normal_concat)
        )
        self._steps = _check_genotype_half(ops, concat, "reduce" if reduction else "normal")
        self._concat = list(concat)
        self.multiplier = len(self._concat)
        self._indices = [index for _, index in ops]
        # In a reduction cell only the edges from the two inputs are strided; intermediate nodes
        # are already at the reduced resolution.
        self._ops = nn.ModuleList(OPS[name](C, 2 if reduction and index < 2 else 1) for name, index in ops)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor, drop_prob: float) -> torch.Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]
        for i in range(self._steps):
            op1, op2 = self._ops[2 * i], self._ops[2 * i + 1]
            h1 = op1(states[self._indices[2 * i]])
            h2 = op2(states[self._indices[2 * i + 1]])
            if self.training and drop_prob > 0.0:
                # The identity's output is an earlier state: the in-place drop-path would corrupt it.
                if not isinstance(op1, Identity):
                    h1 = drop_path(h1, drop_prob)
                if not isinstance(op2, Identity):
                    h2 = drop_path(h2, drop_prob)
            states.append(h1 + h2)
        return torch.cat([states[i] for i in self._concat], dim=1)


class AuxiliaryHeadCIFAR(nn.Module):
    """Auxiliary classifier on the 8×8 feature map after the second reduction cell (train only).
    8×8 → average pool 5, stride 3 → 2×2 → 1×1 conv to 128 → 2×2 conv to 768 → 1×1 → linear."""

    def __init__(self, C: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.ReLU(inplace=True),  # in place on the cell output, as the reference does (see module docstring)
            nn.AvgPool2d(5, stride=3, padding=0, count_include_pad=False),
            nn.Conv2d(C, 128, 1, bias=False),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.Conv2d(128, 768, 2, bias=False),
            nn.BatchNorm2d(768),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(x.view(x.size(0), -1))


class NetworkCIFAR(nn.Module):
    """The DARTS evaluation network for 32×32 inputs (see the module docstring).

    forward(x) → `(logits, logits_aux)` with `return_aux=True` (logits_aux is None in eval mode or
    without the head), or the logits alone with `return_aux=False` (needs auxiliary=False).
    Set `model.drop_path_prob` (float) from the training loop; it is read at every forward.
    """

    def __init__(
        self,
        C: int = 16,
        num_classes: int = 10,
        layers: int = 8,
        auxiliary: bool = True,
        genotype: Genotype = DARTS_V2,
        stem_multiplier: int = 3,
        return_aux: bool = True,
    ):
        super().__init__()
        if layers < 3:
            raise ValueError(f"layers must be at least 3 (two reduction cells and a normal one), got {layers}")
        if auxiliary and not return_aux:
            raise ValueError("return_aux=False drops the auxiliary logits: pass auxiliary=False as well")
        self._layers = layers
        self._auxiliary = auxiliary
        self._return_aux = return_aux
        self._aux_after = 2 * layers // 3  # the auxiliary head reads the second reduction cell's output
        self.drop_path_prob = 0.0  # set by the training loop, typically  max_prob * epoch / epochs

        C_curr = stem_multiplier * C
        self.stem = nn.Sequential(nn.Conv2d(3, C_curr, 3, padding=1, bias=False), nn.BatchNorm2d(C_curr))

        C_prev_prev, C_prev, C_curr = C_curr, C_curr, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        C_to_auxiliary = C_prev
        for i in range(layers):
            reduction = i in (layers // 3, 2 * layers // 3)
            if reduction:
                C_curr *= 2
            cell = Cell(genotype, C_prev_prev, C_prev, C_curr, reduction, reduction_prev)
            self.cells.append(cell)
            reduction_prev = reduction
            C_prev_prev, C_prev = C_prev, cell.multiplier * C_curr
            if i == self._aux_after:
                C_to_auxiliary = C_prev
        if auxiliary:
            self.auxiliary_head = AuxiliaryHeadCIFAR(C_to_auxiliary, num_classes)
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(C_prev, num_classes)

    def forward(self, x: torch.Tensor):
        logits_aux = None
        s0 = s1 = self.stem(x)
        for i, cell in enumerate(self.cells):
            s0, s1 = s1, cell(s0, s1, self.drop_path_prob)
            if i == self._aux_after and self._auxiliary and self.training:
                logits_aux = self.auxiliary_head(s1)
        out = self.global_pooling(s1)
        logits = self.classifier(out.view(out.size(0), -1))
        if not self._return_aux:
            return logits
        return logits, logits_aux


def small_darts(
    layers: int = 5,
    C: int = 8,
    genotype: Genotype = DARTS_V2,
    auxiliary: bool = True,
    seed: int = 0,
    num_classes: int = 10,
    return_aux: bool | None = None,
) -> NetworkCIFAR:
    """A small NetworkCIFAR for fast tests: 5 cells (reductions at cells 1 and 3, auxiliary head
    after cell 3), C=8; a 2×3×32×32 batch runs in milliseconds on CPU. Weights come from `seed`
    without disturbing the caller's global RNG. `return_aux` defaults to `auxiliary` (the paper's
    tuple with the head, the logits alone without it)."""
    if return_aux is None:
        return_aux = auxiliary
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return NetworkCIFAR(
            C=C, num_classes=num_classes, layers=layers, auxiliary=auxiliary, genotype=genotype, return_aux=return_aux
        )


# ---------------------------------------------------------------------------------------------
# Training helpers that accept either output form (an original or a grown model)
# ---------------------------------------------------------------------------------------------


def split_output(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, logits_aux or None) from a tensor, a 1-tuple or a (logits, aux) pair."""
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, (tuple, list)) and 1 <= len(output) <= 2:
        return output[0], (output[1] if len(output) == 2 else None)
    raise TypeError(f"expected logits or (logits, logits_aux), got {type(output).__name__}")


def darts_loss(output, target: torch.Tensor, auxiliary_weight: float = 0.4) -> torch.Tensor:
    """Cross-entropy of the logits plus `auxiliary_weight` times that of the auxiliary logits when
    the model produced them (train mode with the head), as in the paper's training recipe."""
    logits, logits_aux = split_output(output)
    loss = nn.functional.cross_entropy(logits, target)
    if logits_aux is not None:
        loss = loss + auxiliary_weight * nn.functional.cross_entropy(logits_aux, target)
    return loss


def count_parameters(model: nn.Module, include_auxiliary: bool = False) -> int:
    """Trainable parameters; the auxiliary head is left out by default, as the paper reports sizes."""
    return sum(
        p.numel() for name, p in model.named_parameters() if include_auxiliary or not name.startswith("auxiliary_head.")
    )
