"""What the residual-stream analysis (stream.py) finds: the stream's tensors and hidden axes, its writers, readers
and norms, the fill of each tensor's new coordinates — what grow_hidden's rewrite (rewrite/stream.py) changes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph.fx_edit import tensor_shape
from .stream_norms import Norm


@dataclass
class Writer:
    node: str
    what: str  # linear | conv | embedding | tensor | scale (a per-channel factor: any new entries on zeros)
    params: list[tuple[str, int]]  # (parameter path, dimension along the stream)
    out: str  # the stream tensor it writes
    via: tuple[str, ...] | None = None  # a per-channel factor's reads between its parameter and the product


@dataclass
class Reader:
    node: str
    params: list[tuple[str, int]]  # (weight path, its input dimension)
    input: str
    blocks: int = 1  # its input is this many stream tensors concatenated along the hidden axis (DINOv2's head)
    rms: bool = False  # its result is multiplied by rsqrt of a mean square over its input (stream_blocks)


@dataclass
class Stream:
    width: int
    axes: dict[str, int]  # stream tensor (node name) → its hidden axis
    writers: list[Writer] = field(default_factory=list)
    readers: list[Reader] = field(default_factory=list)
    norms: list[Norm] = field(default_factory=list)
    views: list[str] = field(default_factory=list)  # reshape/view/expand nodes on the stream
    grouped: list[str] = field(default_factory=list)  # functional depthwise convs: their `groups` is the width
    eps: list[tuple[str, int]] = field(default_factory=list)  # (node, arg index): a mean square's eps (stream_blocks)
    read_views: list[tuple[str, int]] = field(
        default_factory=list
    )  # views of a parameter read as a weight: (node, axis)
    fill: dict[str, str] = field(default_factory=dict)  # stream tensor → mean | zero (empty when conflict)
    conflict: str | None = None  # why no per-tensor fill is exact (a post-norm stream)

    def summary(self) -> str:
        kinds = Counter(w.what for w in self.writers)
        return (
            f"{len(self.axes)} stream tensors, writers {dict(kinds)}, {len(self.readers)} readers, "
            f"{len(self.norms)} norms ({'RMSNorm' if any(n.rms for n in self.norms) else 'LayerNorm'})"
        )


def refuse(n: fx.Node, why: str) -> NotApplicable:
    return NotApplicable(
        f"the residual stream reaches '{n.name}' ({what(n)}), which {why}",
        "grow_hidden grows a stream it fully understands; grow the layers around it with grow_width",
    )


def what(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module {n.target}"
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def linear_reader(u: fx.Node, x: fx.Node, axis: int) -> Reader:
    """`u`, a Linear (module or F.linear on a parameter), reading stream tensor `x` along its hidden axis `axis`."""
    if axis != len(tensor_shape(x) or ()) - 1:
        raise refuse(u, "reads the stream along another axis than the hidden one")
    if u.op == "call_module":
        return Reader(u.name, [(f"{u.target}.weight", 1)], x.name)
    w = u.args[1] if len(u.args) > 1 else u.kwargs.get("weight")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise refuse(u, "takes its weight from a computed tensor")
    return Reader(u.name, [(str(w.target), 1)], x.name)


def recurrent_reader(gm: fx.GraphModule, u: fx.Node, x: fx.Node, axis: int) -> Reader | None:
    """`u`, an nn.LSTM / GRU / RNN module reading stream tensor `x` as its input features (the last axis, batch first
    or not; Sequencer's LSTMs over the rows and columns of a map): its first layer's input-to-hidden weights, in each
    direction, read the stream through their columns, as a Linear's do (new columns: nothing else reads the input).
    None when `u` is no such call; refused when it reads the stream along another axis or is given a state."""
    if u.op != "call_module" or not isinstance(m := gm.get_submodule(str(u.target)), nn.RNNBase):
        return None
    if u.args[:1] != (x,) or len(u.args) > 1 or u.kwargs:
        raise refuse(u, "reads the stream beside a given state, or as its state")
    if axis != len(tensor_shape(x) or ()) - 1:
        raise refuse(u, "reads the stream along another axis than its input features")
    directions = ("", "_reverse") if m.bidirectional else ("",)
    return Reader(u.name, [(f"{u.target}.weight_ih_l0{d}", 1) for d in directions], x.name)


def kept_whole(gm: fx.GraphModule, n: fx.Node) -> NotApplicable | None:
    """The refusal for a module the capture kept whole (a leaf: a model's own class, or a torch container of layers)
    that the stream reaches, else None: what it computes from the stream is not in the graph, so no rule can apply."""
    if n.op != "call_module":
        return None
    m = gm.get_submodule(str(n.target))
    if type(m).__module__.startswith("torch.nn") and not any(True for _ in m.children()):
        return None
    return NotApplicable(
        f"the residual stream reaches '{n.name}' (module {n.target}), which the capture kept whole "
        f"({type(m).__name__}, a leaf): what it computes from the stream is not in the graph, so how it reads or "
        "writes the hidden size cannot be seen",
        "capture the model with torch.export (--capture export) so that the module is traced through, or grow the "
        "layers around it with grow_width",
    )
