"""deepen's block=transformer: where it goes (the residual stream's places, the candidates), what the model tells
(its norm, heads and MLP width, from the analyses grow_hidden and grow_heads trust), whether its attention must be
causal (probed), and the block itself, written into the graph as torch layers and functions (passes/deepen/__init__.py
has the whole story).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Rewrite
from graphgrow.rewrite import (
    Stream,
    add_module,
    conv_dims,
    example_input,
    factory_kwargs,
    find_attentions,
    find_stream,
    finish,
    input_spec_of,
    inserting_after,
    is_float_tensor,
    param_count,
    pick_within_budget,
    place,
    replace_uses,
    set_scope,
    stages,
    tensor_or_feature_end,
    tensor_shape,
)


def is_token_stream(node: fx.Node) -> bool:
    """A float (N, T, C) tensor with its channels last."""
    shape = tensor_shape(node)
    return is_float_tensor(node) and shape is not None and len(shape) == 3 and conv_dims(node) is None


def _is_residual_add(node: fx.Node) -> bool:
    """A sum of two tensors of the stream's shape: a block's output on the residual stream."""
    is_add = (node.op == "call_function" and node.target in (operator.add, torch.add)) or (
        node.op == "call_method" and node.target == "add"
    )
    ins = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    return is_add and len(ins) == 2 and all(tensor_shape(a) == tensor_shape(node) for a in ins)


def stream_places(gm: fx.GraphModule) -> list[fx.Node]:
    """Residual-stream places of the backbone's token stages (each block's output), the last first; the stage
    ends when the stream has no residual sums."""
    streams = [n for s in stages(gm) for n in s.nodes if is_token_stream(n)]
    adds = [n for n in streams if _is_residual_add(n)]
    return list(reversed(adds or streams[-1:]))


def transformer_place(gm: fx.GraphModule, after: str | None) -> bool:
    """Where block=auto inserts a transformer block: on a token stream (N, T, C) of a model whose stream is built of
    residual sums (a transformer), at the given place or, by default, anywhere."""
    places = stream_places(gm)
    if not any(_is_residual_add(n) for n in places):
        return False
    if after is None:
        return True
    try:
        node, _ = tensor_or_feature_end(gm, after)
    except NotApplicable:
        return False
    return is_token_stream(node)


def transformer_params(node: fx.Node, gm: fx.GraphModule | None = None, widths: dict[int, int] | None = None) -> int:
    """Parameters the block adds after `node` (LayerNorm form: norms, q/v/proj with bias, k without, MLP C → F → C
    with F the model's MLP width, 4·C without `gm`); `widths` caches F per C (one stream analysis per width)."""
    shape = tensor_shape(node) or ()
    if len(shape) != 3:
        return 0
    c = shape[-1]
    widths = {} if widths is None else widths
    if c not in widths:
        widths[c] = _mlp_width(gm, c, _stream_of(gm, c)) if gm is not None else 4 * c
    f = widths[c]
    return 4 * c + 4 * c * c + 3 * c + 2 * c * f + f + c


def default_place(gm: fx.GraphModule) -> tuple[fx.Node, str]:
    places = stream_places(gm)
    if not places:
        raise NotApplicable(
            "the model has no token stream (N, T, C) on its main path",
            "name a (N, T, C) tensor with after=, or use block=conv_bn_relu / linear_relu",
        )
    total = max(param_count(gm), 1)
    widths: dict[int, int] = {}
    node, over = pick_within_budget(places, lambda n: transformer_params(n, gm, widths), total)
    which = (
        "the last block's output on the token stream"
        if node is places[0]
        else "the latest block output within the budget"
    )
    return node, f"{which}{over}"


def candidates(gm: fx.GraphModule) -> list[Candidate]:
    places = stream_places(gm)
    if not places:
        return []
    default, _ = default_place(gm)
    widths: dict[int, int] = {}
    return [
        Candidate(
            {"after": n.name},
            f"token stream {list(tensor_shape(n) or ())}, a residual sum in {place(gm, n)}",
            transformer_params(n, gm, widths),
            n is default,
        )
        for n in places
    ]


# --- what the model tells: norms, heads, MLP width ------------------------------------------------------
# From the analyses growth passes trust (analysis.stream, analysis.heads): deepen sees the model as grow_hidden and
# grow_heads do. Where an analysis does not answer, the model's own modules and query shapes are read as before: the
# stream analysis refuses what it could not *grow* (a stream that is the model's input or output, BART's position
# embedding), and deepen grows no stream, so refusing there would take away blocks these models get today.


def _stream_of(gm: fx.GraphModule, c: int) -> Stream | None:
    """The model's residual stream when the analysis finds one of width C, else None."""
    try:
        stream = find_stream(gm)
    except NotApplicable:
        return None
    return stream if stream.width == c else None


def _in_graph_order(gm: fx.GraphModule, items: list) -> list:
    """Analysis records (each naming its `.node`) in the graph's order: "the first" is the model's first."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(items, key=lambda x: order.get(x.node, len(order)))


def _stream_norm(gm: fx.GraphModule, c: int, stream: Stream | None) -> tuple[type, float, bool]:
    """(class, eps, bias) of the stream's first norm (module or F.layer_norm / F.rms_norm), else of the model's first
    norm module of width C; LayerNorm(eps=1e-5) when it has none. RMSNorm's eps=None is float32's eps."""
    if stream is not None and stream.norms:
        norm = _in_graph_order(gm, stream.norms)[0]
        rms, eps = norm.rms, norm.eps
    else:
        m = next(
            (
                m
                for m in gm.modules()
                if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and tuple(m.normalized_shape) == (c,)
            ),
            None,
        )
        rms, eps = isinstance(m, nn.RMSNorm), (1e-5 if m is None else m.eps)
    if eps is not None and not isinstance(eps, (int, float)):  # an eps computed in the graph (a node): not a number
        eps = next((m.eps for m in gm.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm) and _number(m.eps)), 1e-5)
    return (nn.RMSNorm if rms else nn.LayerNorm), float(torch.finfo(torch.float32).eps if eps is None else eps), not rms


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _heads(gm: fx.GraphModule, c: int) -> tuple[int, str]:
    """The heads of the model's first attention over width C (analysis.heads; the first query shape (N, H, T, C/H)
    when the analysis cannot follow an attention), else a default."""
    try:
        found = [(a.heads, a.head_dim) for a in _in_graph_order(gm, find_attentions(gm, set()))]
    except NotApplicable:
        found = [
            (q[1], q[3])
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target is F.scaled_dot_product_attention and isinstance(n.args[0], fx.Node)
            for q in [tensor_shape(n.args[0])]
            if q is not None and len(q) == 4
        ]
    for h, d in found:
        if h * d == c:
            return h, "the model's own attention"
    h = max(d for d in range(1, max(c // 64, 1) + 1) if c % d == 0)
    return h, "default: the largest divisor of C at most C // 64"


def _mlp_width(gm: fx.GraphModule, c: int, stream: Stream | None) -> int:
    """F of the stream's MLP: a reader C → F whose F is the input of a Linear writer F → C (without a stream: a Linear
    module pair C → F → C); else 4·C."""
    if stream is None:
        linears = [(m.in_features, m.out_features) for m in gm.modules() if isinstance(m, nn.Linear)]
    else:
        params = dict(gm.named_parameters(remove_duplicate=False))

        def across(path: str, dim: int) -> int:  # a 2-D weight's size across the stream (0: none)
            w = params.get(path)
            return int(w.shape[1 - dim]) if w is not None and w.dim() == 2 and dim in (0, 1) else 0

        linears = [(c, across(*r.params[0])) for r in _in_graph_order(gm, stream.readers) if r.params]
        linears += [(across(*w.params[0]), c) for w in stream.writers if w.what == "linear" and w.params]
    back = {i for i, o in linears if o == c}
    ups = [o for i, o in linears if i == c and o not in (c, 0) and o in back]
    return ups[0] if ups else 4 * c


# --- causality -------------------------------------------------------------------------------------------


def _stream_value(gm: fx.GraphModule, node: fx.Node, inputs) -> torch.Tensor:
    """The value at `node`, the graph run only up to it: the head after it may need what the probe's changed input
    no longer has (an end-of-sequence token at the last position, where T5's classifier pools)."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.args_iter = iter(inputs.values() if isinstance(inputs, dict) else (inputs,))
    for n in gm.graph.nodes:
        interp.env[n] = interp.run_node(n)
        if n is node:
            break
    return interp.env[node]


def _changed_last(inputs, t: int):
    """The inputs with their last sequence position changed, for each input aligned with T; None when none is."""
    items = inputs if isinstance(inputs, dict) else {"x": inputs}
    out, any_changed = {}, False
    for name, x in items.items():
        if x.dim() >= 2 and x.shape[1] == t and not name.endswith("mask") and name != "token_type_ids":
            x = x.clone()
            x[:, -1] = x[:, -1] + 1 if x.is_floating_point() else (x[:, -1] + 1) % max(int(x.max()) + 1, 2)
            any_changed = True
        out[name] = x
    if not any_changed:
        return None
    return out if isinstance(inputs, dict) else out["x"]


def probe_causal(gm: fx.GraphModule, node: fx.Node) -> tuple[bool | None, str]:
    """Whether the stream at `node` is causal (no position reads a later one): True, False, or None (unknown)."""
    t = (tensor_shape(node) or (0, 0))[1]
    if any(p.is_meta for p in gm.parameters()):
        return True, "not probed: the model is on the meta device (sized before it runs; same parameters either way)"
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            x = example_input(gm, input_spec_of(gm), seed=0)
            changed = _changed_last(x, t)
            if changed is not None and t > 1:
                a, b = _stream_value(gm, node, x), _stream_value(gm, node, changed)
                if torch.equal(a[:, -1], b[:, -1]):
                    return None, "changing the last token does not change the stream there"
                causal = torch.allclose(a[:, :-1], b[:, :-1], rtol=1e-6, atol=1e-7)
                return causal, (
                    "probed: earlier positions do not see a later token"
                    if causal
                    else "probed: earlier positions see a later token"
                )
            return _own_attention(gm, x)
    finally:
        gm.train(was)


def _own_attention(gm: fx.GraphModule, x) -> tuple[bool | None, str]:
    """Causality from the masks the model's own scaled_dot_product_attention calls get at run time."""
    attn = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]
    if not attn:
        return (
            None,
            "no input is aligned with the tokens to probe, and the model has no scaled_dot_product_attention to read",
        )
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.run(*(x.values() if isinstance(x, dict) else (x,)))
    kinds = {_mask_kind(interp.env, n) for n in attn}
    if len(kinds) == 1 and kinds != {None}:
        causal = kinds == {True}
        return (
            causal,
            f"read from the model's own attention: {'causal' if causal else 'no'} mask "
            "(no input is aligned with the tokens)",
        )
    return (
        None,
        "no input is aligned with the tokens to probe, and the model's attention masks are neither all causal "
        "nor all open",
    )


def _mask_kind(env: dict, n: fx.Node) -> bool | None:
    """True: a causal attention call; False: every position sees every other; None: another mask."""

    def value(i: int, key: str, default):
        a = n.args[i] if len(n.args) > i else n.kwargs.get(key, default)
        return env[a] if isinstance(a, fx.Node) else a

    mask, is_causal = value(3, "attn_mask", None), value(5, "is_causal", False)
    if mask is None:
        return bool(is_causal)
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    t = allowed.shape[-1]
    if allowed.shape[-2] != t:
        return None
    if bool(allowed.all()):
        return bool(is_causal)
    tril = torch.ones(t, t, dtype=torch.bool, device=allowed.device).tril()
    return True if bool((allowed == tril).all()) else None


# --- the block ------------------------------------------------------------------------------------------


def _linear(c_in: int, c_out: int, bias: bool, generator: torch.Generator, kw: dict, zero: bool = False) -> nn.Linear:
    lin = nn.Linear(c_in, c_out, bias=bias, **kw)
    with torch.no_grad():
        bound = 1 / math.sqrt(c_in)  # nn.Linear's own init, drawn from the pass's generator
        lin.weight.copy_(torch.empty_like(lin.weight, device="cpu").uniform_(-bound, bound, generator=generator))
        if zero:
            lin.weight.zero_()
        if lin.bias is not None:
            lin.bias.zero_()
    return lin


def insert_block(
    gm: fx.GraphModule, node: fx.Node, chosen: str, attention: str, generator: torch.Generator
) -> tuple[Rewrite, str]:
    """A transformer block after `node`: the rewrite and the block's module path."""
    if not is_token_stream(node):
        raise NotApplicable(
            f"block=transformer needs a token stream (N, T, C) with channels last; '{node.name}' is "
            f"{list(tensor_shape(node) or [])}" + (" with its channels at dim 1" if is_float_tensor(node) else ""),
            "pick a tensor between two transformer blocks, or use block=conv_bn_relu / linear_relu",
        )
    c = tensor_shape(node)[-1]  # type: ignore[index]
    why = "given"
    if attention == "auto":
        causal, why = probe_causal(gm, node)
        if causal is None:
            raise NotApplicable(
                f"cannot tell whether attention at '{node.name}' must be causal: {why}",
                "say it: attention=causal (a language model) or attention=bidirectional",
            )
        attention = "causal" if causal else "bidirectional"
    stream = _stream_of(gm, c)
    norm_cls, eps, bias = _stream_norm(gm, c, stream)
    heads, heads_why = _heads(gm, c)
    f = _mlp_width(gm, c, stream)
    kw = factory_kwargs(gm, node)
    block = nn.Module()
    for name in ("norm1", "norm2"):
        block.add_module(name, norm_cls(c, eps=eps, **kw))
    for name, (i, o, b, zero) in {
        "q": (c, c, bias, False),
        "k": (c, c, False, False),
        "v": (c, c, bias, False),
        "proj": (c, c, bias, True),
        "fc1": (c, f, bias, False),
        "fc2": (f, c, bias, True),
    }.items():
        block.add_module(name, _linear(i, o, b, generator, kw, zero))
    block.add_module("act", nn.GELU())
    root = add_module(gm, "deepen_transformer", block)
    new = _wire(gm, node, root, heads, attention == "causal")
    set_scope(new, node)
    targets = {
        "after": f"{node.name} {list(tensor_shape(node) or [])}",
        "chosen": chosen,
        "block": (
            f"transformer ({root}): {norm_cls.__name__}(eps={eps:g}), {heads} heads ({heads_why}), MLP {c}→{f}→{c}, "
            f"{attention} attention ({why}); proj and fc2 = 0"
        ),
    }
    return Rewrite(finish(gm), targets), root


def _wire(gm: fx.GraphModule, x: fx.Node, root: str, heads: int, causal: bool) -> list[fx.Node]:
    graph = gm.graph
    made: list[fx.Node] = []

    def mod(name: str, arg: fx.Node) -> fx.Node:
        made.append(graph.call_module(f"{root}.{name}", (arg,)))
        return made[-1]

    def meth(name: str, *args) -> fx.Node:
        made.append(graph.call_method(name, args))
        return made[-1]

    def split_heads(t: fx.Node) -> fx.Node:  # (N, T, C) → (N, H, T, C/H)
        return meth("transpose", meth("unflatten", t, -1, (heads, -1)), 1, 2)

    with inserting_after(x):
        h1 = mod("norm1", x)
        q, k, v = (split_heads(mod(p, h1)) for p in ("q", "k", "v"))
        made.append(graph.call_function(F.scaled_dot_product_attention, (q, k, v), {"is_causal": causal}))
        att = mod("proj", meth("flatten", meth("transpose", made[-1], 1, 2), 2))
        made.append(graph.call_function(operator.add, (x, att)))
        h = made[-1]
        mlp = mod("fc2", mod("act", mod("fc1", mod("norm2", h))))
        made.append(graph.call_function(operator.add, (h, mlp)))
    replace_uses(x, made[-1], keep=made)
    return made
