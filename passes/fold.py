"""fold: a deployment transform. Growth's linear structure folds back into plain layers.

Eval-mode semantics: BatchNorm uses its running statistics, dropout and drop-path are
off, gates are constants. The result computes what the model computes in eval mode
(verified: eval-mode preservation here, onnxruntime equivalence with --check); it is
not meant to be trained further.

Rules, applied until nothing changes:
- graphgrow's merges expand into `main + Σ (gate_i/n)·branch_i`; a zero gate drops its
  branch; scalar gates become constants; a gate behind a ReLU moves into the layer
  before it (a negative gate turns the add into a subtract);
- identities (nn.Identity, dropout and drop-path in eval mode, relu of a non-negative
  tensor) are removed, and nn.Sequential containers are inlined;
- every chain and sum of linear maps of one tensor — conv, Linear, BatchNorm, scalar
  multiples, average pooling with count_include_pad, the identity — becomes one conv
  (or Linear) when that costs no more multiply-adds and no more weights than what it
  replaces (a k×k conv after a k×k conv never becomes a larger kernel, and a branch
  with a larger kernel enlarges the main conv only with grow_kernels=true): BatchNorm
  into its conv, parallel branches into the main conv (smaller kernels centre-padded),
  a 1×1 adapter into the conv before or after it, a mode=adapter widening back into a
  conv of the original width;
- a 1×1 conv before global average pooling moves into the classifier Linear.
What stays (non-linear branches, real depth or width) is listed with the reason.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import annotate, arg, Pass, Rewrite
from graphgrow.rewrite import (
    AverageMerge, copy_graph_module, factory_kwargs, finish, graphgrow_modules, input_shape_of, set_module,
    tensor_shape, unique_attr,
)


SITE = "gg_fold_site"  # node meta: the growth structure an add came from (for the report)
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)
_SUB = (operator.sub, torch.sub)
_RELU_FN = (F.relu, torch.relu)
# dropout-like functions → the position of their `training` argument (torchvision's stochastic_depth has `mode` first)
_DROPOUT_FNS = {"dropout": 2, "dropout1d": 2, "dropout2d": 2, "dropout3d": 2, "alpha_dropout": 2,
                "feature_alpha_dropout": 2, "stochastic_depth": 3, "drop_path": 2}
_NONNEG_FNS = (F.relu, torch.relu, F.relu6, torch.sigmoid, F.sigmoid, F.softmax, torch.softmax, torch.exp, torch.abs,
               F.hardsigmoid)
_KEEP_SIGN_FNS = (F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, torch.flatten,
                  torch.cat, operator.getitem)
_KEEP_SIGN_METHODS = ("view", "reshape", "flatten", "permute", "transpose", "contiguous", "mean", "amax", "max")
_KEEP_SIGN_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten)
_NONNEG_MODULES = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Softmax, nn.Hardsigmoid)


# ----------------------------------------------------------------------------------------------
# Phase 1: specialise the graph to eval mode and expand graphgrow's own structure.


def _module(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    return gm.get_submodule(n.target) if n.op == "call_module" else None


def _substitute(node: fx.Node, value: Any) -> None:
    """Replace every use of `node` with a Python constant."""
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = fx.map_arg(user.kwargs, lambda a: value if a is node else a)


def _bypass(node: fx.Node, by: fx.Node) -> None:
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)


def _training_false(gm: fx.GraphModule) -> int:
    """Reads of `training` (kept as runtime switches by the tracer) become the constant False."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and str(n.target).split(".")[-1] == "training":
            _substitute(n, False)
            count += 1
    return count


def _inline_sequentials(gm: fx.GraphModule) -> int:
    count = 0
    changed = True
    while changed:
        changed = False
        for n in list(gm.graph.nodes):
            m = _module(gm, n)
            if type(m) is nn.Sequential and len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node):
                x = n.args[0]
                with gm.graph.inserting_before(n):
                    for name, _ in m.named_children():
                        x = gm.graph.call_module(f"{n.target}.{name}", (x,))
                        x.meta["gg_scope"] = n.meta.get("gg_scope")
                _bypass(n, x)
                changed = True
                count += 1
    return count


def _split_norm_subclasses(gm: fx.GraphModule) -> int:
    """A BatchNorm subclass with its own forward (timm's BatchNormAct2d) that computes a plain BatchNorm
    followed by its child modules — checked on a random input — becomes exactly that, so the BatchNorm can fold."""
    count = 0
    for n in list(gm.graph.nodes):
        m = _module(gm, n)
        if not isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).forward is nn.modules.batchnorm._BatchNorm.forward:
            continue
        shape = tensor_shape(n)
        if shape is None or len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node) or m.running_mean is None:
            continue
        plain_type = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(len(shape))
        if plain_type is None:
            continue
        plain = plain_type(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                           device=m.running_mean.device, dtype=m.running_mean.dtype).eval()
        plain.load_state_dict({k: v for k, v in m.state_dict().items() if k in plain.state_dict()})
        children = list(m.named_children())
        x = torch.randn((2, *shape[1:]), generator=torch.Generator().manual_seed(0)).to(m.running_mean)
        try:
            with torch.no_grad():
                want, got = m.eval()(x), plain(x)
                for _, c in children:
                    got = c.eval()(got)
        except Exception:
            continue
        if not isinstance(want, torch.Tensor) or want.shape != got.shape or not torch.allclose(want, got, rtol=1e-5, atol=1e-6):
            continue
        path = unique_attr(gm, str(n.target).replace(".", "_") + "_bn")
        gm.add_module(path, plain)
        with gm.graph.inserting_before(n):
            y = gm.graph.call_module(path, (n.args[0],))
            for name, c in children:  # moved out, so the subclass (and its BatchNorm tensors) can go
                y.meta["gg_scope"] = n.meta.get("gg_scope")
                child_path = unique_attr(gm, f"{n.target}_{name}".replace(".", "_"))
                gm.add_module(child_path, c)
                y = gm.graph.call_module(child_path, (y,))
            y.meta["gg_scope"] = n.meta.get("gg_scope")
        _bypass(n, y)
        count += 1
    return count


def _expand_merges(gm: fx.GraphModule, notes: list[str]) -> None:
    """AverageMerge → main + Σ (gate_i/n)·branch_i; branches with a zero gate are dropped."""
    for n in list(gm.graph.nodes):
        m = _module(gm, n)
        if not isinstance(m, AverageMerge):
            continue
        gates = [float(g) for g in m.gates.detach().double()]
        main, branches = n.args[0], n.args[1:]
        acc = main
        with gm.graph.inserting_before(n):
            for i, (b, g) in enumerate(zip(branches, gates)):
                if g == 0.0:
                    notes.append(f"merge '{n.target}': branch {i} has gate 0 and is dropped")
                    continue
                t = gm.graph.call_function(operator.mul, (b, g / len(branches)))
                acc = gm.graph.call_function(operator.add, (acc, t))
                t.meta["gg_scope"] = acc.meta["gg_scope"] = n.meta.get("gg_scope")
                acc.meta[SITE] = f"merge '{n.target}'"
        _bypass(n, acc)  # type: ignore[arg-type]


def _scalar_gates(gm: fx.GraphModule) -> None:
    """One-element parameters used only as multipliers (graphgrow's gates) become constants."""
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or not n.users:
            continue
        try:
            t = gm.get_parameter(n.target)
        except AttributeError:
            continue
        if t.dim() == 0 and all(u.op == "call_function" and u.target in _MUL for u in n.users):
            for u in n.users:
                for user in u.users:
                    if user.op == "call_function" and user.target in _ADD + _SUB:
                        user.meta[SITE] = f"gate '{n.target}'"
            _substitute(n, float(t.detach()))
            gm.graph.erase_node(n)


def _fn_training_arg(n: fx.Node, index: int) -> Any:
    """The `training` argument of a dropout-like function call (default True, as in torch)."""
    if "training" in n.kwargs:
        return n.kwargs["training"]
    return n.args[index] if len(n.args) > index else True


def _is_identity(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Ops that are the identity in eval mode."""
    if n.op == "call_module":
        m = _module(gm, n)
        if isinstance(m, (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                          nn.FeatureAlphaDropout)):
            return True
        return _returns_its_input(m, n)
    if n.op == "call_function" and getattr(n.target, "__name__", "") in _DROPOUT_FNS:
        return _fn_training_arg(n, _DROPOUT_FNS[n.target.__name__]) is False
    return False


def _returns_its_input(m: nn.Module | None, n: fx.Node) -> bool:
    """A parameter-free leaf (drop-path, say) that hands back its very input object in eval mode."""
    if m is None or next(m.parameters(), None) is not None or len(n.args) != 1 or n.kwargs:
        return False
    shape = tensor_shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None
    if shape is None or tensor_shape(n) != shape:
        return False
    x = torch.zeros((1, *shape[1:]), dtype=n.args[0].meta.get("gg_dtype") or torch.float32)
    try:
        with torch.no_grad():
            return m.eval()(x) is x
    except Exception:
        return False


def _remove_identities(gm: fx.GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if _is_identity(gm, n) and n.args and isinstance(n.args[0], fx.Node):
            _bypass(n, n.args[0])
            count += 1
    return count


def _scalar_operand(n: fx.Node) -> tuple[float, fx.Node] | None:
    """(c, x) for x·c or c·x with a Python number c."""
    a, b = (list(n.args) + [None, None])[:2]
    if isinstance(a, fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(b), a
    if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a), b
    return None


def _is_relu(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return type(_module(gm, n)) is nn.ReLU
    if n.op == "call_function":
        return n.target in _RELU_FN and len(n.args) == 1
    return n.op == "call_method" and n.target == "relu" and len(n.args) == 1


def _nonnegative(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose output can never be negative."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        inputs = [a for a in n.all_input_nodes if a.op != "get_attr"]
        keeps = bool(inputs) and all(a in out for a in inputs)
        if n.op == "call_module":
            m = _module(gm, n)
            if isinstance(m, _NONNEG_MODULES) or (isinstance(m, _KEEP_SIGN_MODULES) and keeps):
                out.add(n)
        elif n.op == "call_function":
            if n.target in _NONNEG_FNS or (n.target in _KEEP_SIGN_FNS and keeps):
                out.add(n)
            elif n.target in _ADD + _MUL and not n.kwargs and all(_nonneg_value(a, out) for a in n.args):
                out.add(n)  # sums and products of non-negative tensors and numbers (x − 1 is not one)
        elif n.op == "call_method" and (n.target in ("relu", "sigmoid", "exp", "abs") or (n.target in _KEEP_SIGN_METHODS and keeps)):
            out.add(n)
    return out


def _nonneg_value(a: Any, nonneg: set[fx.Node]) -> bool:
    if isinstance(a, fx.Node):
        return a in nonneg
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a >= 0


def _drop_idempotent_relus(gm: fx.GraphModule) -> int:
    """relu(x) for x ≥ 0 is x (a branch's leading ReLU on an already-rectified input)."""
    count = 0
    nonneg = _nonnegative(gm)
    for n in list(gm.graph.nodes):
        if _is_relu(gm, n) and n.args[0] in nonneg:
            _bypass(n, n.args[0])
            count += 1
    return count


def _gates_through_relus(gm: fx.GraphModule) -> int:
    """c·relu(z) = relu(|c|·z) for c > 0; for c < 0 the add that uses it becomes a subtract."""
    count = 0
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in _MUL:
            continue
        s = _scalar_operand(n)
        if s is None or s[0] == 0.0 or s[0] == 1.0 or not _is_relu(gm, s[1]) or len(s[1].users) != 1:
            continue
        c, r = s
        z = r.args[0]
        if not isinstance(z, fx.Node):
            continue
        if c < 0:
            users = list(n.users)
            if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _ADD + _SUB:
                continue
            user = users[0]
            if user.target in _ADD:
                other = user.args[1] if user.args[0] is n else user.args[0]
                user.target, user.args = operator.sub, (other, n)
            elif user.args[1] is n:
                user.target = operator.add
            else:
                continue
        with g.inserting_before(r):
            scaled = g.call_function(operator.mul, (z, abs(c)))
            scaled.meta["gg_scope"] = r.meta.get("gg_scope")
        r.args = (scaled,)
        _bypass(n, r)
        count += 1
    return count


def _drop_zero_terms(gm: fx.GraphModule) -> int:
    """a + 0·b → a and 1·x → x (shapes permitting)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in _MUL and (s := _scalar_operand(n)) and s[0] == 1.0:
            _bypass(n, s[1])
            count += 1
        elif n.target in _ADD + _SUB and len(n.args) == 2 and not n.kwargs:
            for i, a in enumerate(n.args):
                if isinstance(a, fx.Node) and a.op == "call_function" and a.target in _MUL and (s := _scalar_operand(a)) and s[0] == 0.0:
                    other = n.args[1 - i]
                    if isinstance(other, fx.Node) and tensor_shape(other) == tensor_shape(n) and (i == 1 or n.target in _ADD):
                        _bypass(n, other)
                        count += 1
                        break
    gm.graph.eliminate_dead_code()
    return count


# ----------------------------------------------------------------------------------------------
# Phase 2: linear forms. Every node that is a linear map of one tensor `src` gets a Form:
# a conv (weight in grouped layout) or a Linear, plus the set of nodes it would replace.


@dataclass
class Form:
    kind: str  # "conv" | "linear"
    src: fx.Node
    weight: torch.Tensor  # conv: (out, in/groups, kh, kw); linear: (out, in); float64
    bias: torch.Tensor | None
    groups: int = 1
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    nodes: set = field(default_factory=set)  # the nodes this form replaces
    macs: int = 0  # multiply-adds per example of the replaced nodes
    params: int = 0  # parameters of the replaced layers
    weighted: list = field(default_factory=list)  # module paths of the conv/Linear layers inside

    @property
    def pointwise(self) -> bool:
        return self.kind == "linear" or (self.weight.shape[2:] == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0))

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        return self.weight.shape[1] * self.groups

    def dense(self) -> torch.Tensor:
        """Weight with groups = 1."""
        if self.groups == 1:
            return self.weight
        return _regroup(self.weight, self.groups, 1)

    def size(self) -> int:
        """Parameters of this form as one layer."""
        return self.weight.numel() + (self.out_channels if self.bias is not None else 0)

    def cost(self, out_shape: tuple[int, ...]) -> int:
        """Multiply-adds per example of this form as one layer."""
        per_out = self.weight[0].numel()
        return _numel(out_shape) * per_out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if shape else 0


def _regroup(w: torch.Tensor, groups: int, to: int) -> torch.Tensor:
    """Re-lay a grouped conv weight from `groups` to `to` groups (`to` divides `groups`)."""
    out, in_g = w.shape[:2]
    cin = in_g * groups
    og, ig_new = out // groups, cin // to
    new = w.new_zeros((out, ig_new, *w.shape[2:]))
    per = groups // to
    for gi in range(groups):
        rows = slice(gi * og, (gi + 1) * og)
        col = (gi % per) * in_g
        new[rows, col:col + in_g] = w[rows]
    return new


def _to_groups(f: Form, g: int) -> torch.Tensor:
    return f.weight if f.groups == g else _regroup(f.weight, f.groups, g)


def _conv_form(m: nn.Conv2d, src: fx.Node, path: str, out_shape) -> Form | None:
    if type(m).forward is not nn.Conv2d.forward or m.padding_mode != "zeros":
        return None
    k = m.kernel_size
    pad: tuple[int, int]
    if isinstance(m.padding, str):
        if m.padding == "valid":
            pad = (0, 0)
        elif m.stride == (1, 1) and all(d * (kk - 1) % 2 == 0 for d, kk in zip(m.dilation, k)):
            pad = _pair([d * (kk - 1) // 2 for d, kk in zip(m.dilation, k)])
        else:
            return None
    else:
        pad = _pair(m.padding)
    w = m.weight.detach().double()
    if m.dilation != (1, 1):  # a dilated kernel is a larger kernel with holes
        dh, dw = m.dilation
        big = w.new_zeros((*w.shape[:2], dh * (k[0] - 1) + 1, dw * (k[1] - 1) + 1))
        big[:, :, ::dh, ::dw] = w
        w = big
    bias = m.bias.detach().double() if m.bias is not None else None
    macs = _numel(out_shape) * m.weight[0].numel()
    params = sum(p.numel() for p in m.parameters())
    return Form("conv", src, w, bias, m.groups, tuple(m.stride), pad, macs=macs, params=params, weighted=[path])


def _diag_form(kind: str, src: fx.Node, scale: torch.Tensor, shift: torch.Tensor | None) -> Form:
    c = scale.numel()
    w = scale.reshape(c, 1, 1, 1) if kind == "conv" else torch.diag(scale)
    return Form(kind, src, w, shift, groups=c if kind == "conv" else 1)


def _bn_affine(mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm as y = scale·x + shift per channel, in float64."""
    scale = 1.0 / torch.sqrt(var.detach().double() + eps)
    shift = -mean.detach().double() * scale
    if weight is not None:
        scale, shift = scale * weight.detach().double(), shift * weight.detach().double()
    if bias is not None:
        shift = shift + bias.detach().double()
    return scale, shift


def _bn_form(m: nn.Module, src: fx.Node, kind: str) -> Form | None:
    bn_type = nn.BatchNorm2d if kind == "conv" else nn.BatchNorm1d
    if not isinstance(m, bn_type) or type(m).forward is not bn_type.forward:  # a subclass with its own forward adds more
        return None
    if m.running_mean is None or m.running_var is None:
        return None
    return _diag_form(kind, src, *_bn_affine(m.running_mean, m.running_var, m.weight, m.bias, m.eps))


def _kind_of(n: fx.Node) -> str | None:
    s = tensor_shape(n)
    dt = n.meta.get("gg_dtype")
    if s is None or dt is None or not dt.is_floating_point:
        return None
    return "conv" if len(s) == 4 else ("linear" if len(s) in (2, 3) else None)


def _local_form(gm: fx.GraphModule, n: fx.Node) -> Form | None:
    """The form of `n` as a function of its own input, or None when it is not a linear map of one tensor."""
    kind = _kind_of(n)
    if kind is None:
        return None
    shape = tensor_shape(n)
    if n.op == "call_module":
        if len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node):
            return None
        src, m = n.args[0], _module(gm, n)
        if kind == "conv" and isinstance(m, nn.Conv2d):
            return _conv_form(m, src, str(n.target), shape)
        if kind == "linear" and type(m) is nn.Linear:
            w = m.weight.detach().double()
            b = m.bias.detach().double() if m.bias is not None else None
            return Form("linear", src, w, b, macs=_numel(shape) * m.in_features, params=sum(p.numel() for p in m.parameters()),
                        weighted=[str(n.target)])
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) and tensor_shape(src) == shape and (kind == "conv" or len(shape) == 2):
            f = _bn_form(m, src, kind)
            if f is not None:
                f.macs, f.params = _numel(shape), 2 * shape[1]
            return f
        if kind == "conv" and type(m) is nn.AvgPool2d and m.count_include_pad and not m.ceil_mode and m.divisor_override is None:
            k = _pair(m.kernel_size)
            c = shape[1]
            w = torch.full((c, 1, *k), 1.0 / (k[0] * k[1]), dtype=torch.float64)
            return Form("conv", src, w, None, c, _pair(m.stride or m.kernel_size), _pair(m.padding), macs=_numel(shape) * k[0] * k[1])
        return None
    if n.op == "call_function" and n.target is F.batch_norm:
        return _functional_bn_form(gm, n, kind, shape)
    scaled = _scalar_multiple(n, shape)
    if scaled is None:
        return None
    c, x = scaled
    f = _diag_form(kind, x, torch.full((shape[1] if kind == "conv" else shape[-1],), c, dtype=torch.float64), None)
    f.macs = _numel(shape)
    return f


def _scalar_multiple(n: fx.Node, shape) -> tuple[float, fx.Node] | None:
    """(c, x) when `n` computes c·x for a number c (x·c, c·x, x/c, −x) with x of the output's shape."""
    if n.op != "call_function" or n.kwargs:
        return None
    if n.target in (operator.neg, torch.neg) and isinstance(n.args[0], fx.Node):
        c, x = -1.0, n.args[0]
    elif n.target in _MUL + (operator.truediv, torch.div) and (s := _scalar_operand(n)) is not None:
        if n.target not in _MUL and n.args[0] is not s[1]:
            return None  # c / x is not linear
        c, x = (s[0] if n.target in _MUL else 1.0 / s[0]), s[1]
    else:
        return None
    return (c, x) if math.isfinite(c) and tensor_shape(x) == shape else None


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _functional_bn_form(gm: fx.GraphModule, n: fx.Node, kind: str, shape) -> Form | None:
    """F.batch_norm in eval mode (how BatchNorm subclasses with a fused activation call it) on stored tensors."""
    args = dict(zip(_BN_ARGS, n.args))
    args.update(n.kwargs)
    if args.get("training", False) is not False or not isinstance(args.get("input"), fx.Node):
        return None
    tensors = {}
    for key in ("running_mean", "running_var", "weight", "bias"):
        a = args.get(key)
        if a is None and key in ("weight", "bias"):
            continue
        if not isinstance(a, fx.Node) or a.op != "get_attr":
            return None
        tensors[key] = _attr(gm, str(a.target))
    src = args["input"]
    if tensor_shape(src) != shape or (kind == "linear" and len(shape) != 2):
        return None
    scale, shift = _bn_affine(tensors["running_mean"], tensors["running_var"], tensors.get("weight"), tensors.get("bias"),
                              float(args.get("eps", 1e-5)))
    f = _diag_form(kind, src, scale, shift)
    f.macs, f.params = _numel(shape), 2 * scale.numel()
    return f


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _identity(kind: str, x: fx.Node) -> Form | None:
    s = tensor_shape(x)
    if s is None or _kind_of(x) != kind:
        return None
    c = s[1] if kind == "conv" else s[-1]
    return _diag_form(kind, x, torch.ones(c, dtype=torch.float64), None)


def _compose(outer: Form, inner: Form) -> Form | None:
    """outer ∘ inner, when that is one layer of the same kind without a larger kernel."""
    if outer.kind != inner.kind or outer.in_channels != inner.out_channels:
        return None
    if outer.kind == "linear":
        w = outer.weight @ inner.weight
        b = _add_bias(outer.weight @ inner.bias if inner.bias is not None else None, outer.bias)
        return Form("linear", inner.src, w, b)
    if outer.pointwise:
        # out[o] = Σ_c P[o, c] · inner[c]: keep inner's geometry; a diagonal P keeps its groups
        diag = outer.groups == outer.out_channels == outer.in_channels
        if diag:
            scale = outer.weight.reshape(-1)
            w = inner.weight * scale.reshape(-1, 1, 1, 1)
            groups = inner.groups
        else:
            p = outer.dense()[:, :, 0, 0]
            w = torch.einsum("oc,cikl->oikl", p, inner.dense())
            groups = 1
            scale = None
        inner_b = inner.bias
        if inner_b is not None:
            inner_b = inner_b * scale if diag else outer.dense()[:, :, 0, 0] @ inner_b
        return Form("conv", inner.src, w, _add_bias(inner_b, outer.bias), groups, inner.stride, inner.padding)
    if inner.pointwise and (inner.bias is None or outer.padding == (0, 0)):
        # zero padding of outer would pad inner's output, not inner's input: only exact without inner's bias
        diag = inner.groups == inner.out_channels == inner.in_channels
        if diag:
            scale = inner.weight.reshape(-1)
            cin_g = outer.weight.shape[1]
            idx = torch.arange(outer.out_channels) // (outer.out_channels // outer.groups) * cin_g
            cols = idx.reshape(-1, 1) + torch.arange(cin_g).reshape(1, -1)
            w = outer.weight * scale[cols].reshape(*cols.shape, 1, 1)
            groups = outer.groups
        else:
            w = torch.einsum("ockl,ci->oikl", outer.dense(), inner.dense()[:, :, 0, 0])
            groups = 1
        b = outer.bias
        if inner.bias is not None:
            b = _add_bias(outer.dense().sum((2, 3)) @ inner.bias, b)
        return Form("conv", inner.src, w, b, groups, outer.stride, outer.padding)
    return None


def _add_bias(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def _sum(a: Form, b: Form, sign: float, out_shape) -> Form | None:
    """a + sign·b as one layer, when both read the same tensor with the same stride."""
    if a.kind != b.kind or a.src is not b.src or a.out_channels != b.out_channels or a.in_channels != b.in_channels:
        return None
    if a.kind == "linear":
        return Form("linear", a.src, a.weight + sign * b.weight, _add_bias(a.bias, None if b.bias is None else sign * b.bias))
    if a.stride != b.stride:
        return None
    # output o reads input rows o·s − p … o·s − p + k − 1: align the two windows
    (ka, kb), (pa, pb) = ((a.weight.shape[2], b.weight.shape[2]), (a.padding[0], b.padding[0]))
    (la, lb), (qa, qb) = ((a.weight.shape[3], b.weight.shape[3]), (a.padding[1], b.padding[1]))
    ph, pw = max(pa, pb), max(qa, qb)
    kh, kw = max(ka - pa, kb - pb) + ph, max(la - qa, lb - qb) + pw
    src_shape = tensor_shape(a.src)
    if src_shape is None:
        return None
    h = (src_shape[2] + 2 * ph - kh) // a.stride[0] + 1
    wd = (src_shape[3] + 2 * pw - kw) // a.stride[1] + 1
    if (h, wd) != tuple(out_shape[2:]) or kh > src_shape[2] + 2 * ph or kw > src_shape[3] + 2 * pw:
        return None
    groups = math.gcd(a.groups, b.groups)
    w = a.weight.new_zeros((a.out_channels, a.in_channels // groups, kh, kw))
    for f, s, p, q in ((a, 1.0, pa, qa), (b, sign, pb, qb)):
        fw = _to_groups(f, groups)
        oh, ow = ph - p, pw - q
        w[:, :, oh:oh + fw.shape[2], ow:ow + fw.shape[3]] += s * fw
    bias = _add_bias(a.bias, None if b.bias is None else sign * b.bias)
    return Form("conv", a.src, w, bias, groups, a.stride, (ph, pw))


def _is_sum(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _ADD + _SUB and len(n.args) == 2 and not n.kwargs
            and all(isinstance(a, fx.Node) for a in n.args) and tensor_shape(n.args[0]) == tensor_shape(n.args[1]) == tensor_shape(n))


def _terms(n: fx.Node, sign: float, out: list) -> None:
    """The signed terms of a tree of same-shape adds/subtracts whose inner nodes have one user."""
    for i, a in enumerate(n.args):
        s = sign * (-1.0 if i == 1 and n.target in _SUB else 1.0)
        if _is_sum(a) and len(a.users) == 1:
            _terms(a, s, out)
        else:
            out.append((a, s))


def _reassociate(gm: fx.GraphModule, analysis: "_Analysis") -> int:
    """Rebuild sums so that terms reading the same tensor are added first: (a + c) + b for a + b + c
    when a and c are maps of one tensor. The pairwise merge then folds them."""
    count = 0
    for n in list(gm.graph.nodes):
        if not _is_sum(n) or any(_is_sum(u) and len(n.users) == 1 for u in n.users):
            continue
        terms: list = []
        _terms(n, 1.0, terms)
        if len(terms) < 3:
            continue

        def key(t: fx.Node) -> fx.Node:
            return analysis.forms[t].src if t in analysis.forms and len(t.users) == 1 else t
        keys = [key(t) for t, _ in terms]
        sizes = {k: sum(1 for x in keys if x is k) for k in keys}
        order = sorted(range(len(terms)), key=lambda i: (-sizes[keys[i]], keys.index(keys[i]), terms[i][1] < 0, i))
        if order == list(range(len(terms))) or sizes[keys[order[0]]] < 2:
            continue
        ordered = [terms[i] for i in order]
        with gm.graph.inserting_before(n):
            acc, sign = ordered[0]
            if sign < 0:
                acc = gm.graph.call_function(operator.neg, (acc,))
            for t, s in ordered[1:]:
                acc = gm.graph.call_function(operator.add if s > 0 else operator.sub, (acc, t))
                acc.meta.update({k: v for k, v in n.meta.items() if k in ("gg_scope", SITE)})
        n.replace_all_uses_with(acc)
        count += 1
    return count


@dataclass
class _Analysis:
    forms: dict  # node → the form worth emitting
    why: dict  # add/sub node → why its operands stayed apart


def _analyse(gm: fx.GraphModule, grow_kernels: bool = False) -> _Analysis:
    """Forms of every node. `forms` holds those worth emitting (no more multiply-adds than the parts);
    `full` composes regardless of cost, because a costly chain can still disappear into a sum
    (an average-pool branch with a 1×1 adapter merges into a 3×3 main conv for free)."""
    forms: dict[fx.Node, Form] = {}
    full: dict[fx.Node, Form] = {}
    why: dict[fx.Node, str] = {}

    def absorbable(p: fx.Node, n: fx.Node) -> bool:
        return p in full and set(p.users) == {n}

    def combine(new: Form | None, parts: list[Form], own_macs: int, own: set) -> Form | None:
        if new is not None:
            new.macs = sum(p.macs for p in parts) + own_macs
            new.params = sum(p.params for p in parts)
            new.nodes = set().union(*(p.nodes for p in parts)) | own
            new.weighted = [w for p in parts for w in p.weighted]
        return new

    def cheap(f: Form | None, shape) -> bool:
        # no more multiply-adds, and no more weights (a 2×2 average pool after a 1×1 conv is a 2×2 conv:
        # the same multiply-adds, four times the weights)
        return f is not None and f.cost(shape) <= f.macs and f.size() <= max(f.params, 2 * f.out_channels)

    def options(x: fx.Node, n: fx.Node, kind: str) -> list[Form]:
        got = [f for f in (forms.get(x), full.get(x)) if f is not None] if absorbable(x, n) else []
        eye = _identity(kind, x)
        return list({id(f): f for f in got}.values()) + ([eye] if eye is not None else [])

    for n in gm.graph.nodes:
        shape = tensor_shape(n)
        if shape is None:
            continue
        if _is_sum(n):
            kind = _kind_of(n)
            if kind is None:
                continue
            a, b = n.args
            sign = -1.0 if n.target in _SUB else 1.0
            for fa in options(a, n, kind):
                for fb in options(b, n, kind):
                    if fa.src is not fb.src:
                        continue
                    got = combine(_sum(fa, fb, sign, shape), [fa, fb], _numel(shape), {n})
                    if got is None:
                        continue
                    if kind == "conv" and not grow_kernels and _grows_kernel(fa, got):
                        why[n] = (f"merging would grow the kernel of '{a.name}' from {_k(fa)} to {_k(got)} "
                                  "(fold(grow_kernels=true) does it: fewer multiply-adds than unfolded, more than before growth)")
                        continue
                    full.setdefault(n, got)
                    if cheap(got, shape):
                        forms[n] = got
                        break
                    why[n] = "merging its terms into one layer would cost more multiply-adds than it saves"
                if n in forms:
                    break
            if n not in full and n not in why:
                why[n] = _apart(gm, full, a, b, n)
            continue
        local = _local_form(gm, n)
        if local is None:
            continue
        local.nodes = {n}
        p = local.src
        forms[n] = full[n] = local
        if absorbable(p, n):
            own = dataclasses.replace(local)
            whole = combine(_compose(local, full[p]), [full[p], own], 0, set())
            if whole is not None:
                full[n] = whole
            inner = forms.get(p)
            got = whole if inner is full[p] else (combine(_compose(local, inner), [inner, own], 0, set()) if inner else None)
            if cheap(got, shape):
                forms[n] = got  # type: ignore[assignment]
    return _Analysis(forms, why)


def _k(f: Form) -> str:
    return f"{f.weight.shape[2]}×{f.weight.shape[3]}"


def _grows_kernel(main: Form, merged: Form) -> bool:
    """The merged kernel is larger than the first term's (the main path's) in some direction."""
    return merged.weight.shape[2] > main.weight.shape[2] or merged.weight.shape[3] > main.weight.shape[3]


def _apart(gm: fx.GraphModule, full: dict, a: fx.Node, b: fx.Node, n: fx.Node) -> str:
    def what(x: fx.Node) -> str:
        src = full[x].src if x in full and set(x.users) == {n} else x
        if src.op not in ("call_module", "call_function", "call_method"):
            return f"'{src.name}'"
        linear = _local_form(gm, src) is not None or _is_sum(src)
        return f"'{src.name}' ({_describe(src)}{'' if linear else ': not linear'})"
    return f"its terms read different tensors: {what(a)} and {what(b)}"


def _describe(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(n.graph.owning_module.get_submodule(n.target)).__name__} '{n.target}'"
    return getattr(n.target, "__name__", str(n.target))


# ----------------------------------------------------------------------------------------------
# Phase 3: emit one layer per maximal form.


def _emit(gm: fx.GraphModule, n: fx.Node, f: Form, src: fx.Node) -> fx.Node:
    """One layer computing `f` from `src` in place of `n`; returns the new node."""
    kw = factory_kwargs(gm, n)
    bias = f.bias is not None and bool(f.bias.abs().max() > 0) or any(
        getattr(gm.get_submodule(p), "bias", None) is not None for p in f.weighted)
    if f.kind == "conv":
        layer: nn.Module = nn.Conv2d(f.in_channels, f.out_channels, tuple(f.weight.shape[2:]), f.stride, f.padding,
                                     groups=f.groups, bias=bias, **kw)
    else:
        layer = nn.Linear(f.in_channels, f.out_channels, bias=bias, **kw)
    with torch.no_grad():
        layer.weight.copy_(f.weight)
        if layer.bias is not None:
            layer.bias.copy_(f.bias if f.bias is not None else torch.zeros(f.out_channels, dtype=torch.float64))
    layer.eval()
    # the merged layer takes the place of the model's own layer (not one growth added), the largest if several
    added = graphgrow_modules(gm)
    main = max(f.weighted, key=lambda p: (p.split(".")[0] not in added, gm.get_submodule(p).weight.numel()))
    users = [x for x in gm.graph.nodes if x.op == "call_module" and x.target == main]
    if users == [next(x for x in f.nodes if x.op == "call_module" and x.target == main)]:
        path = main
        set_module(gm, path, layer)
    else:
        path = unique_attr(gm, "folded_" + main.replace(".", "_"))
        gm.add_module(path, layer)
    with gm.graph.inserting_before(n):
        new = gm.graph.call_module(path, (src,))
    new.meta.update({k: v for k, v in n.meta.items() if k.startswith("gg_")})
    n.replace_all_uses_with(new)
    return new


def _fold_gap_adapters(gm: fx.GraphModule) -> list[str]:
    """Linear ∘ flatten ∘ global-average-pool ∘ 1×1 conv = Linear' ∘ flatten ∘ pool: the conv moves into the Linear."""
    done = []
    for lin in list(gm.graph.nodes):
        m = _module(gm, lin)
        if type(m) is not nn.Linear or not isinstance(lin.args[0], fx.Node):
            continue
        flat = lin.args[0]
        if not (len(flat.users) == 1 and _is_flatten(gm, flat) and isinstance(flat.args[0], fx.Node)):
            continue
        pool = flat.args[0]
        if not (len(pool.users) == 1 and _is_global_pool(gm, pool) and isinstance(pool.args[0], fx.Node)):
            continue
        conv_node = pool.args[0]
        conv = _module(gm, conv_node)
        shape = tensor_shape(conv_node)
        if not isinstance(conv, nn.Conv2d) or len(conv_node.users) != 1 or shape is None:
            continue
        f = _conv_form(conv, conv_node.args[0], str(conv_node.target), shape)
        if f is None or not f.pointwise:
            continue
        a = f.dense()[:, :, 0, 0]
        w = m.weight.detach().double() @ a
        b = m.bias.detach().double() if m.bias is not None else torch.zeros(m.out_features, dtype=torch.float64)
        if f.bias is not None:
            b = b + m.weight.detach().double() @ f.bias
        new = nn.Linear(a.shape[1], m.out_features, bias=True, dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            new.weight.copy_(w)
            new.bias.copy_(b)
        set_module(gm, str(lin.target), new.train(m.training))
        pool.args = (conv_node.args[0], *pool.args[1:])
        gm.graph.erase_node(conv_node)
        done.append(f"{conv_node.target} (1×1 conv before global pooling) → {lin.target}")
    return done


def _fold_select_adapters(gm: fx.GraphModule) -> list[str]:
    """Linear ∘ token select ∘ Linear (per token) = Linear' ∘ select: a per-token layer commutes with picking
    tokens (x[:, 0] before a ViT head), so it moves into the Linear after the select."""
    done = []
    for lin in list(gm.graph.nodes):
        m = _module(gm, lin)
        sel = lin.args[0] if lin.args else None
        if type(m) is not nn.Linear or not isinstance(sel, fx.Node) or len(sel.users) != 1:
            continue
        if not (sel.op == "call_function" and sel.target is operator.getitem and isinstance(sel.args[0], fx.Node)):
            continue
        ad_node, index = sel.args[0], sel.args[1]
        shape = tensor_shape(ad_node)
        ad = _module(gm, ad_node)
        if type(ad) is not nn.Linear or len(ad_node.users) != 1 or shape is None or len(shape) != 3:
            continue
        # the index may pick tokens and the batch, never features: at most two entries, no Ellipsis
        entries = index if isinstance(index, tuple) else (index,)
        if len(entries) > 2 or any(e is Ellipsis or isinstance(e, fx.Node) for e in entries):
            continue
        w = m.weight.detach().double() @ ad.weight.detach().double()
        b = m.bias.detach().double() if m.bias is not None else torch.zeros(m.out_features, dtype=torch.float64)
        if ad.bias is not None:
            b = b + m.weight.detach().double() @ ad.bias.detach().double()
        new = nn.Linear(ad.in_features, m.out_features, bias=True, dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            new.weight.copy_(w)
            new.bias.copy_(b)
        set_module(gm, str(lin.target), new.train(m.training))
        sel.args = (ad_node.args[0], index)
        gm.graph.erase_node(ad_node)
        done.append(f"{ad_node.target} (per-token Linear before a token select) → {lin.target}")
    return done


_NON_LINEAR = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Sigmoid, nn.Tanh, nn.MaxPool2d)


def _kept_modules(gm: fx.GraphModule, reported: set[str]) -> dict[str, str]:
    """Modules growth added (the log's modules_added) that are still called after folding and not already
    reported through their merge or gate: real depth or a non-linear branch, or a linear layer with nothing
    next to it that it merges into without adding multiply-adds."""
    added = graphgrow_modules(gm)
    kinds: dict[str, list[nn.Module]] = {}
    for n in gm.graph.nodes:
        top = str(n.target).split(".")[0] if n.op == "call_module" else ""
        if top in added and not any(top in r for r in reported):
            kinds.setdefault(top, []).append(_module(gm, n))
    kept = {}
    for top, modules in kinds.items():
        non_linear = [type(m).__name__ for m in modules if isinstance(m, _NON_LINEAR)]
        kept[f"module '{top}'"] = (f"real depth or a non-linear branch ({non_linear[0]})" if non_linear else
                                   f"a {type(modules[0]).__name__} with no conv/Linear next to it that it merges into "
                                   "without adding multiply-adds")
    return kept


def _is_flatten(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return type(_module(gm, n)) is nn.Flatten
    return (n.op == "call_function" and n.target is torch.flatten) or (n.op == "call_method" and n.target == "flatten")


def _is_global_pool(gm: fx.GraphModule, n: fx.Node) -> bool:
    s = tensor_shape(n)
    if s is None or len(s) != 4 or s[2:] != (1, 1):
        return False
    if n.op == "call_module":
        return type(_module(gm, n)) is nn.AdaptiveAvgPool2d
    return n.op == "call_function" and n.target is F.adaptive_avg_pool2d


# ----------------------------------------------------------------------------------------------


def _describe_form(gm: fx.GraphModule, f: Form) -> str:
    k = f"{f.weight.shape[2]}×{f.weight.shape[3]} conv" if f.kind == "conv" else "Linear"
    g = f", groups {f.groups}" if f.kind == "conv" and f.groups > 1 else ""
    parts = ", ".join(sorted(_node_label(gm, x) for x in f.nodes))
    return f"{parts} → one {k}{g}"


def _node_label(gm: fx.GraphModule, n: fx.Node) -> str:
    return str(n.target) if n.op == "call_module" else n.name


def _refresh(gm: fx.GraphModule, input_shape) -> None:
    """Drop dead nodes, recompile and record shapes again after an edit."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    annotate(gm, input_shape)


def fold(gm: fx.GraphModule, grow_kernels: bool = False, generator: torch.Generator | None = None) -> Rewrite:
    """Fold linear structure into plain layers, in eval-mode semantics (see the module docstring).
    `grow_kernels`: a branch with a larger kernel than the main conv's may enlarge it (more FLOPs than
    before growth, fewer than unfolded); off by default."""

    code_before = gm.code
    gm = copy_graph_module(gm)
    gm.eval()
    input_shape = input_shape_of(gm)
    notes: list[str] = ["eval-mode semantics: BatchNorm uses running statistics; dropout and drop-path are off"]
    _training_false(gm)
    _inline_sequentials(gm)
    _split_norm_subclasses(gm)
    _expand_merges(gm, notes)
    _scalar_gates(gm)
    folded: list[str] = []
    for _ in range(50):  # every round that changes something removes nodes or orders a sum; 50 is far beyond real models
        _refresh(gm, input_shape)
        changes = _remove_identities(gm) + _drop_idempotent_relus(gm) + _gates_through_relus(gm) + _drop_zero_terms(gm)
        if changes:
            _refresh(gm, input_shape)
        moved = _fold_gap_adapters(gm) + _fold_select_adapters(gm)
        folded += moved
        analysis = _analyse(gm, grow_kernels)
        if _reassociate(gm, analysis):
            _refresh(gm, input_shape)
            analysis = _analyse(gm, grow_kernels)
        absorbed = set().union(*(f.nodes - {n} for n, f in analysis.forms.items())) if analysis.forms else set()
        replaced: dict[fx.Node, fx.Node] = {}  # a form's source may itself be emitted earlier in this round
        for n, f in list(analysis.forms.items()):
            if n in absorbed or len(f.nodes) < 2 or not f.weighted:
                continue
            folded.append(_describe_form(gm, f))
            replaced[n] = _emit(gm, n, f, replaced.get(f.src, f.src))
            changes += 1
        if not changes and not moved:
            break
    finish(gm)
    annotate(gm, input_shape)
    analysis = _analyse(gm, grow_kernels)
    kept: dict[str, str] = {}
    for n in gm.graph.nodes:
        if SITE in n.meta and _is_sum(n):
            kept.setdefault(n.meta[SITE], analysis.why.get(n, "it stays an add"))
    kept.update(_kept_modules(gm, set(kept)))
    targets: dict[str, Any] = {"folded": folded or "nothing to fold"}
    if kept:
        targets["kept"] = [f"{k}: {v}" for k, v in kept.items()]
    return Rewrite(gm, targets, notes, changed=gm.code != code_before, exact=True, eval_only=True)


@dataclass(frozen=True)
class Fold(Pass):
    """Fold growth's linear structure (BatchNorm, gates, parallel branches, adapters) into plain layers; eval mode."""

    name: ClassVar[str] = "fold"
    grows: ClassVar[bool] = False
    function = fold
    grow_kernels: bool = arg(False, "let a larger-kernel branch enlarge the main conv (fewer FLOPs than unfolded, more than before growth)")
