"""Activation memory estimated on the meta device, before anything real runs (budget.py's measure).

Every node's output is sized on empty meta tensors: common layers by shape rules (a meta kernel costs about a
millisecond a node), the rest by running them on the meta device; a leaf that branches on its data is run both
ways and the larger output counts. NoEstimate names the node the meta device cannot run (budget.py refuses then).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..core.errors import first_line
from ..graph import ops
from ..graph.inputs import DTYPES, InputSpec, batch_of
from ..graph.shapes import _target_name, shape_of
from ..io.mode_switch import ModeSwitch

VERIFY_BATCH = 3


_SAME_SHAPE = (
    nn.modules.batchnorm._NormBase,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
    nn.LayerNorm,
    nn.GroupNorm,
)
# the binary ops whose output shape is the broadcast of their inputs' (division left out: its meta kernel is used)
_ELEMENTWISE = ops.ADD_FUNCTIONS | ops.PRODUCT_FUNCTIONS


def _fast_shape(gm: fx.GraphModule, n: fx.Node, args: tuple) -> torch.Tensor | None:
    """The output of common layers as an empty meta tensor, from shape rules instead of the meta kernels
    (which cost about a millisecond a node); None where no rule applies."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if n.op == "call_module" and x is not None and len(args) == 1 and not n.kwargs:
        m = gm.get_submodule(n.target)  # type: ignore[arg-type]
        if isinstance(m, _SAME_SHAPE) and type(m).__module__.startswith(
            "torch.nn.modules."
        ):  # torch's own, not a subclass
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if type(m) is nn.Conv2d and x.dim() == 4 and isinstance(m.padding, tuple):
            h, w = (
                (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for size, pad, dil, k, stride in zip(x.shape[2:], m.padding, m.dilation, m.kernel_size, m.stride)
            )
            return torch.empty((x.shape[0], m.out_channels, h, w), dtype=x.dtype, device="meta")
        if type(m) is nn.Linear:
            return torch.empty((*x.shape[:-1], m.out_features), dtype=x.dtype, device="meta")
    if n.op == "call_function" and n.target in _ELEMENTWISE and not n.kwargs and len(args) == 2:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(isinstance(a, (torch.Tensor, int, float)) for a in args):
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            return torch.empty(shape, dtype=tensors[0].dtype, device="meta")
    return None


def estimate_batch(input_shape: InputSpec) -> int:
    """The largest batch a command runs the model at: verification's, or the example's own when larger."""
    return max(VERIFY_BATCH, batch_of(input_shape))


class NoEstimate(Exception):
    """The meta device could not run a node, so no size could be estimated."""

    def __init__(self, node: fx.Node, shapes: list, error: BaseException):
        self.message = (
            f"node '{node.name[:80]}' ({node.op} {_target_name(node)[:80]}) fails on inputs of shapes {shapes} "
            f"on the meta device: {type(error).__name__}: {first_line(error, 200)}"
        )
        super().__init__(self.message)
        self.node, self.error = node.name, error

    def __str__(self) -> str:  # fx's Interpreter appends the graph to args[0] on the way out
        return self.message


def activation_bytes(gm: fx.GraphModule, input_shape: InputSpec, batch: int | None = None) -> int:
    """Sum of every node's output size on the meta device (an upper bound of what a forward keeps), at `batch`
    (default: estimate_batch). NoEstimate names the node the meta device cannot run."""
    b = estimate_batch(input_shape) if batch is None else batch
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    specs = [(list(t.shape), DTYPES[t.dtype]) for t in input_shape]
    inputs = [
        torch.empty([b] + s[1:], device="meta", dtype=dtype if d in (None, torch.float32) else d) for s, d in specs
    ]
    # Tensors a leaf creates without naming a device are made on the meta device too.
    with torch.no_grad(), torch.device("meta"):
        return _node_bytes(gm, inputs)


def _node_bytes(gm: fx.GraphModule, inputs: Sequence, body: bool = False) -> int:
    """activation_bytes on meta `inputs`. A mode switch's bodies are graphs of their own, read from the file as data
    (a hostile one can hold any temporary): each is counted node by node and the largest adds to the switch's
    output (`body`: counting one, whose inputs and output are already counted outside)."""
    total = 0

    class Count(fx.Interpreter):
        def run_node(self, n):
            nonlocal total
            try:
                out = None
                if n.op in ("call_module", "call_function"):
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    out = (
                        _fast_shape(gm, n, args)
                        if all(not isinstance(a, torch.Tensor) or a.is_meta for a in args)
                        else None
                    )
                if out is None:
                    out = super().run_node(n)
            except NoEstimate:
                raise
            except Exception as e:
                out = self.both_ways(n) if n.op == "call_module" else None
                if out is None:
                    raise NoEstimate(n, [shape_of(self.env.get(a)) for a in n.all_input_nodes], e) from e
            if not (body and n.op in ("placeholder", "output")):
                total += _bytes(out)
            if n.op == "call_module" and isinstance(switch := gm.get_submodule(n.target), ModeSwitch):  # type: ignore[arg-type]
                values = self.fetch_args_kwargs_from_env(n)[0][switch.conditions :]
                total += max(_node_bytes(b, values, body=True) for b in switch.bodies())
            return out

        def call_function(self, target, args, kwargs):
            return super().call_function(target, *_on_meta(args, kwargs))

        def call_method(self, target, args, kwargs):
            return super().call_method(target, *_on_meta(args, kwargs))

        def both_ways(self, n):
            """A leaf that branches on its data (`if x.sum() > 0:`, which fx cannot trace): run it with every such
            test answered True, then False, and keep the larger output. None when it fails for another reason
            (a number read from data, `.item()` or `int(t)`, could size anything: that stays unsized)."""
            outs = []
            for answer in (True, False):
                with _AnswerTests(answer) as mode:
                    try:
                        outs.append(super().run_node(n))
                    except Exception:
                        return None
                if not mode.asked:
                    return None
            return max(outs, key=_bytes)

    Count(gm).run(*inputs)
    return total


def _on_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with every device it names made the meta device: a graph captured by torch.export holds
    the device it ran on as a constant (`x.to(device(type='cpu'))`, `arange(..., device=cpu)`), which would
    put that tensor back on the real device and stop the next op that meets a meta one."""

    def meta(a):
        return torch.device("meta") if isinstance(a, torch.device) and a.type != "meta" else a

    # tree_map, not fx's map_aggregate: that rebuilds topk's (values, indices) as a plain tuple, and `.indices` fails
    args = tuple(tree_map(meta, args))
    kwargs = {k: meta(torch.device(v) if k == "device" and isinstance(v, str) else v) for k, v in kwargs.items()}
    return args, kwargs


def _bytes(out) -> int:
    return sum(
        t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
    )


class _AnswerTests(TorchDispatchMode):
    """Answers `bool(meta tensor)` (a branch on data) with `answer`; every other read of a value still fails."""

    def __init__(self, answer: bool):
        super().__init__()
        self.answer, self.asked = answer, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta and args[0].dtype is torch.bool:
            self.asked = True
            return self.answer
        return func(*args, **(kwargs or {}))


def meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every parameter, buffer and plain tensor attribute (fx's `_tensor_constant`s) on the meta
    device, without copying their bytes."""
    memo: dict = {}
    for m in gm.modules():
        for p in m.parameters(recurse=False):
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in m.buffers(recurse=False):
            memo[id(b)] = torch.empty_like(b, device="meta")
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
    out = copy.deepcopy(gm, memo)
    out.meta = copy.deepcopy(gm.meta)  # the pass reads graphgrow's bookkeeping (input shape, log) from it
    return out
