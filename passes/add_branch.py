"""add_branch / remove_branch: parallel branches merged by a gated average.

    out = main + mean_i(gate_i · branch_i(x))      (graphgrow.layers.AverageMerge)

`at` names the span the branch runs beside: a node name (the branch takes that
node's input and merges at its output), a module path (the module's input →
output), or START:END. Every gate starts at 0, so adding a branch is exact in eval
and train mode; the gate gets a gradient at once and the branch's layers after one
step. Branch weights are random, so no two branches start (or stay) identical.
Adding at a span that already ends in a merge adds one more input to that merge.
init=gradmax: the branch's first conv is aimed from a batch (`data`) so the gradient on its zero gate is
largest (graphgrow.rewrite.gradmax_gate); one branch at a time (aimed twins would stay identical).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    DEFAULT_BUDGET,
    REMOVES_PARAMETERS,
    AverageMerge,
    GatedBlock,
    Requirement,
    add_module,
    aim_gates,
    begin,
    check_aimable,
    conv2d_facts,
    copy_graph_module,
    dead_places,
    deployed_nodes,
    factory_kwargs,
    finish,
    graphgrow_modules,
    inline_containers,
    inserting_after,
    is_float_tensor,
    is_graphgrow_node,
    kaiming_,
    keep_heard,
    load_data,
    param_count,
    pass_function,
    pick_within_budget,
    place,
    replace_uses,
    resolve_tensor,
    set_scope,
    stages,
    tensor_shape,
    train_only_note,
)

Op = Literal["conv3x3", "conv5x5", "sepconv3x3", "sepconv5x5", "dilconv3x3", "avgpool3x3", "maxpool3x3", "identity"]
OPS: tuple[str, ...] = get_args(Op)


def branch_params(op: str, cin: int, cout: int, count: int = 1) -> int:
    """Parameters `count` branches of `op` add (build_branch's layers, BatchNorm included)."""
    adapter = cin * cout + 2 * cout if cin != cout else 0
    k = {"conv3x3": 3, "conv5x5": 5, "sepconv3x3": 3, "sepconv5x5": 5, "dilconv3x3": 3}.get(op, 0)
    one = {
        "conv": cin * cout * k * k + 2 * cout,
        "sepc": cin * k * k + cin * cout + 2 * cout,
        "dilc": cin * k * k + cin * cout + 2 * cout,
    }.get(op[:4], adapter)
    return count * one + count  # and a gate each


def branch_sites(gm: fx.GraphModule, op: str, count: int) -> list[tuple[bool, bool, int, fx.Node, int]]:
    """Backbone convs a person would put a branch beside: on a feature map larger than 1×1 (not a
    squeeze-excitation or head conv) that an integer stride reaches from its input, reading a tensor other
    than the raw input, not one graphgrow added,
    run by the deployed function (not a train-only auxiliary head).
    Each as (within the parameter budget, foldable again: dense with a kernel at least the branch's,
    graph position, node, parameters the branches add)."""
    added = graphgrow_modules(gm)
    deployed = deployed_nodes(gm)
    backbone_nodes = {n for s in stages(gm) for n in s.nodes}
    last = max((i for i, n in enumerate(gm.graph.nodes) if n in backbone_nodes), default=None)
    total = max(param_count(gm), 1)
    kernel = {"conv3x3": 3, "conv5x5": 5, "sepconv3x3": 3, "sepconv5x5": 5, "dilconv3x3": 5}.get(
        op, 1
    )  # dilated 3×3 spans 5×5
    sites = []
    for i, n in enumerate(gm.graph.nodes):
        m = conv2d_facts(gm, n)  # a Conv2d, or a layer that computes one (a weight-standardised conv)
        if m is None or not is_float_tensor(n):
            continue
        shape, src = tensor_shape(n), n.args[0]
        if (
            last is not None
            and i > last
            or n not in deployed
            or is_graphgrow_node(gm, n, added)
            or not isinstance(src, fx.Node)
            or not is_float_tensor(src)
            or shape[2:] == (1, 1)
            or src.op == "placeholder"
        ):
            continue
        src_shape = tensor_shape(src)
        if len(src_shape) != 4 or any(a < b or a % b for a, b in zip(src_shape[2:], shape[2:])):
            continue  # a branch needs an integer stride (factorized reduce's 15×15 → 8×8 conv has none)
        cost = branch_params(op, m.in_channels, m.out_channels, count)
        sites.append((cost <= DEFAULT_BUDGET * total, bool(m.groups == 1 and min(m.kernel_size) >= kernel), i, n, cost))
    return sites


def default_conv(gm: fx.GraphModule, op: str, count: int) -> tuple[fx.Node, str]:
    """The last of `branch_sites` within the budget, preferring foldable ones (else the one where the branch
    adds the fewest parameters); with why in words."""
    sites = branch_sites(gm, op, count)
    if not sites:
        convs = [
            n.target if n.op == "call_module" else n.name for n in gm.graph.nodes if conv2d_facts(gm, n) is not None
        ]
        if not convs:
            others = sorted({type(m).__name__ for m in gm.modules() if isinstance(m, nn.modules.conv._ConvNd)})
            what = f"its convs are {', '.join(others)}" if others else "it has no conv layers"
            raise NotApplicable(
                f"add_branch runs 2-D conv branches beside a Conv2d on (N, C, H, W) feature maps; this model "
                f"has none ({what})",
                "grow it with deepen, insert_adapter, add_residual or grow_width instead",
            )
        why = (
            f": its Conv2d layers ({', '.join(map(str, convs[:3]))}{', …' if len(convs) > 3 else ''}) "
            "read the raw input "
            "(a patch embedding), work on 1×1 maps or lie outside the backbone"
        )
        raise NotApplicable(
            f"the model has no Conv2d on a feature map to run a branch beside{why}",
            f"give at={convs[0]} (or at=START:END) to put a branch there anyway"
            + train_only_note(gm, "name a conv there with at="),
        )
    dead = dead_places(gm, [site[3] for site in sites])  # a zero factor after them: the new gate would never train
    if len(dead) == len(sites):
        # every place is silent at initialisation: those the model's own zero weights silence (a zero-initialised
        # head blocks them all) learn once training's first step moves those weights, as verification trains them
        dead = dead_places(gm, [site[3] for site in sites], zeros_moved=True)
    if len(dead) == len(sites):
        name, why = next(iter(dead.items()))
        raise NotApplicable(
            f"every conv a branch could run beside is dead for it ({len(dead)}; e.g. '{name}': {why}), also once "
            "the model's zero weights have moved",
            "give at=START:END where a gradient reaches",
        )
    sites = [site for site in sites if site[3].name not in dead]
    live = keep_heard(gm, sites, lambda s: s[3], fed=True)  # fed only zeros, or unheard: a branch there never learns
    unfed = len(sites) - len(live)
    sites = live
    total = max(param_count(gm), 1)
    (_, _, _, n, cost), over = pick_within_budget(
        sorted(sites, key=lambda c: (c[1], c[2]), reverse=True), lambda c: c[4], total
    )
    what = "the main-path conv where it adds the fewest parameters" if over else "the last main-path conv"
    skipped = (
        (
            f"; skipped {len(dead)} conv(s) where a branch would be dead (e.g. '{next(iter(dead))}': "
            f"{next(iter(dead.values()))})"
        )
        if dead
        else ""
    ) + (
        f"; skipped {unfed} conv(s) whose input is zero or whose output no gradient reaches on the check inputs"
        if unfed
        else ""
    )
    return (
        n,
        f"beside {what} {place(gm, n)}; adds {cost:,} parameters "
        f"({100 * cost / total:.1f}% of the model){over}{skipped}",
    )


def resolve_span(
    gm: fx.GraphModule, at: str | None, op: str = "conv3x3", count: int = 1
) -> tuple[fx.Node, fx.Node, str]:
    """(input tensor, output tensor, how chosen) of the span a branch runs beside."""
    if at is None:
        n, why = default_conv(gm, op, count)
        src = n.args[0]
        assert isinstance(src, fx.Node)  # default_conv only picks convs reading a tensor node
        return src, n, why
    if ":" in at:
        a, b = at.split(":", 1)
        return resolve_tensor(gm, a, "in"), resolve_tensor(gm, b, "out"), "given span"
    node = next((n for n in gm.graph.nodes if n.name == at), None)
    if node is not None:
        inputs = [a for a in node.all_input_nodes if is_float_tensor(a)]
        if not inputs:
            raise NotApplicable(f"node '{at}' has no tensor input to branch from", "give at=START:END")
        return inputs[0], node, "beside the node"
    return resolve_tensor(gm, at, "in"), resolve_tensor(gm, at, "out"), "beside the module"


def existing_merge(gm: fx.GraphModule, end: fx.Node) -> fx.Node | None:
    """The AverageMerge whose main input is `end`, or `end` itself when it is one."""
    if end.op == "call_module" and isinstance(gm.get_submodule(end.target), AverageMerge):
        return end
    for u in end.users:
        if u.op == "call_module" and isinstance(gm.get_submodule(u.target), AverageMerge) and u.args[0] is end:
            return u
    return None


def branch_input(merge: fx.Node) -> fx.Node:
    """The tensor every branch of `merge` reads: the latest node that the main input and each branch all derive
    from (a branch is its layers' nodes once inlined, or the input itself for an identity branch)."""
    order = {n: i for i, n in enumerate(merge.graph.nodes)}

    def upstream(n: fx.Node) -> set[fx.Node]:
        seen, todo = {n}, [n]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        return seen

    common = set.intersection(*(upstream(a) for a in merge.args if isinstance(a, fx.Node)))
    return max(common, key=order.__getitem__)


def build_branch(
    op: Op, cin: int, cout: int, stride: tuple[int, int], like: torch.Tensor, g: torch.Generator
) -> nn.Module:
    """A branch module for 4-D features: cin×H×W → cout×(H/stride)×(W/stride)."""
    kw = {"device": like.device, "dtype": like.dtype}

    def conv(ci, co, k, s=1, d=1, groups=1):
        c = nn.Conv2d(ci, co, k, stride=s, padding=d * (k // 2), dilation=d, groups=groups, bias=False, **kw)
        kaiming_(c.weight, g)
        return c

    def bn(c):
        return nn.BatchNorm2d(c, **kw)

    def adapt(layers):  # a learnable 1×1 adapter when channels differ (never zero padding)
        return layers + ([conv(cin, cout, 1), bn(cout)] if cin != cout else [])

    if op in ("conv3x3", "conv5x5"):
        k = int(op[4])
        return nn.Sequential(nn.ReLU(), conv(cin, cout, k, stride), bn(cout))
    if op in ("sepconv3x3", "sepconv5x5"):
        k = int(op[7])
        return nn.Sequential(nn.ReLU(), conv(cin, cin, k, stride, groups=cin), conv(cin, cout, 1), bn(cout))
    if op == "dilconv3x3":
        return nn.Sequential(nn.ReLU(), conv(cin, cin, 3, stride, d=2, groups=cin), conv(cin, cout, 1), bn(cout))
    if op == "avgpool3x3":
        return nn.Sequential(*adapt([nn.AvgPool2d(3, stride, 1, count_include_pad=True)]))
    if op == "maxpool3x3":
        return nn.Sequential(*adapt([nn.MaxPool2d(3, stride, 1)]))
    if stride != (1, 1) or cin != cout:  # identity that must change size: a strided 1×1 conv + BN
        return nn.Sequential(conv(cin, cout, 1, stride), bn(cout))
    return nn.Identity()


MAX_BRANCHES = 16  # each branch is a full conv beside the span; more is a typo, not a design


@pass_function  # the arguments' defaults and allowed values: AddBranch's declaration
def add_branch(
    gm: fx.GraphModule,
    at: str | None,
    op: Op,
    count: int,
    init: Literal["zero", "gradmax"],
    data,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Add `count` branches of `op` beside the span `at`, merged by a gated average (gates start at 0).
    init=gradmax: `data` is a callable (or `package.module:function`) returning (inputs, loss_fn)."""
    _check_init(init, data)
    gm, generator = begin(gm, generator)
    start, end, chosen = resolve_span(gm, at, op, count)
    merge = existing_merge(gm, end)
    if merge is not None:
        start = branch_input(merge)  # every branch of a merge reads the same input
        end = merge.args[0]  # type: ignore[assignment]
    if at is not None and (dead := dead_places(gm, [end])):  # the default place skips these already
        raise NotApplicable(
            f"a branch at '{at}' would be dead: '{end.name}': {dead[end.name]}; its zero gate would "
            "never get a gradient",
            "put it where a gradient reaches (add_branch's default place skips "
            "such convs), or train the model first so that the zero factor moves",
        )
    s, e = tensor_shape(start), tensor_shape(end)
    if s is None or e is None or len(s) != 4 or len(e) != 4:
        raise NotApplicable(
            f"add_branch needs 4-D feature maps; '{start.name}' is {list(s or [])} and '{end.name}' {list(e or [])}",
            "pick a span of conv layers (graphgrow inspect shows shapes)",
        )
    if e[2] > s[2] or e[3] > s[3] or s[2] % e[2] or s[3] % e[3]:
        raise NotApplicable(
            f"the span '{start.name}' {list(s)} → '{end.name}' {list(e)} does not downsample by an integer stride",
            "pick a span whose output size divides its input size",
        )
    stride = (s[2] // e[2], s[3] // e[3])
    like = torch.zeros((), **factory_kwargs(gm, end))
    graph = gm.graph
    names, branch_nodes = [], []
    anchor = merge.args[-1] if merge is not None else end
    with inserting_after(anchor):
        for _ in range(count):
            name = add_module(gm, f"branch_{op}", build_branch(op, s[1], e[1], stride, like, generator))
            b = graph.call_module(name, (start,))
            names.append(name)
            branch_nodes.append(b)
        if merge is None:
            merge_name = add_module(gm, "merge", AverageMerge(count, device=like.device, dtype=like.dtype))
            merge = graph.call_module(merge_name, (end, *branch_nodes))
            replace_uses(end, merge, keep=[merge])
            new_nodes = branch_nodes + [merge]
            merged = f"new merge '{merge_name}' of {count} branch(es)"
        else:
            module = gm.get_submodule(merge.target)
            n = module.branches
            with torch.no_grad():
                gates = torch.cat(
                    [
                        torch.as_tensor(module.gates * (n + count) / n),
                        torch.zeros(count, dtype=like.dtype, device=like.device),
                    ]
                )
            module.gates = nn.Parameter(gates)
            merge.args = (*merge.args, *branch_nodes)
            new_nodes = branch_nodes
            merged = f"added to merge '{merge.target}' ({n} → {n + count} branches; gates rescaled by {n + count}/{n})"
    set_scope(new_nodes, end)
    finish(gm)
    targets: dict[str, object] = {
        "span": f"{start.name} {list(s)} → {end.name} {list(e)}",
        "chosen": chosen,
        "branches": f"{count}× {op} ({', '.join(names)})",
        "merge": merged,
    }
    if init == "gradmax":
        last = gm.get_parameter(f"{merge.target}.gates").numel() - 1  # the new branch's gate
        block = GatedBlock(names[0], f"{merge.target}.gates", last, check_aimable(gm, names[0], f"{op} branch"))
        aimed = aim_gates(gm, [block], data, "add_branch")
        if aimed is not None:
            targets["gradmax"], targets["gain"] = aimed.describe(), float(f"{aimed.gain:.4g}")
    if inline_containers(gm, names):  # after the aim, which hooks the branch module: its layers as graph nodes
        finish(gm)
    return Rewrite(gm, targets)


def _check_init(init: str, data) -> None:
    """init=gradmax needs data: refused before any work otherwise (one branch at a time: AddBranch.conflict)."""
    if init == "gradmax" and data is None:
        load_data(None, "add_branch")


def _merges(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), AverageMerge)]


def _node(gm: fx.GraphModule, name: str) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.name == name), None)


@pass_function  # the arguments' defaults: RemoveBranch's declaration
def remove_branch(
    gm: fx.GraphModule, at: str | None, index: int, allow_change: bool, generator: torch.Generator | None = None
) -> Rewrite:
    """Drop branch `index` from the merge at `at`; exact when its gate is 0, else only with allow_change."""
    gm = copy_graph_module(gm)
    merges = _merges(gm)  # at least one: RemoveBranch.requires
    merge: fx.Node | None
    if at is None:
        merge = merges[-1]
    else:
        node = _node(gm, at) or next((n for n in merges if n.target == at), None)
        merge = node if node in merges else (existing_merge(gm, node) if node is not None else None)
        if merge is None:
            raise NotApplicable(f"no branch merge at '{at}'", f"merges: {', '.join(n.name for n in merges)}")
    module = gm.get_submodule(merge.target)
    n = module.branches
    if not -n <= index < n:
        raise NotApplicable(
            f"merge '{merge.name}' has {n} branches; there is no branch {index}", f"use an index from 0 to {n - 1}"
        )
    i = index % n
    gate = module.gates[i].item()
    if gate != 0.0 and not allow_change:
        raise NotApplicable(
            f"branch {i} of merge '{merge.name}' contributes (gate {gate:.3g}); removing it changes the function",
            "pass allow_change=true to remove it anyway; the report then says how far the output moved",
        )
    branch = merge.args[1 + i]
    if n == 1:
        replace_uses(merge, merge.args[0])
        gm.graph.erase_node(merge)
    else:
        keep = [j for j in range(n) if j != i]
        with torch.no_grad():
            module.gates = nn.Parameter(module.gates[keep] * (n - 1) / n)
        merge.args = (merge.args[0], *(merge.args[1 + j] for j in keep))
    gm.graph.eliminate_dead_code()
    finish(gm)
    targets = {
        "merge": merge.name,
        "removed": f"branch {i} "
        f"({str(branch.target).split('.')[0] if branch.op == 'call_module' else branch.name}), gate {gate:.3g}",
        "left": f"{n - 1} branch(es)" if n > 1 else "merge removed",
    }
    return Rewrite(gm, targets, exact=gate == 0.0)


@dataclass(frozen=True)
class AddBranch(Pass):
    """Run new branches beside a span, merged by a gated average main + mean(gate·branch) with gates at 0."""

    name: ClassVar[str] = "add_branch"
    function = add_branch
    ensures = (ADDS_PARAMETERS,)
    at: str | None = arg(
        None, "node name, module path or START:END; default: beside the last main-path conv within the budget"
    )
    op: Op = arg("conv3x3", "the branch's operation")
    count: int = arg(1, "how many branches (each one a full conv beside the span)", low=1, high=MAX_BRANCHES)
    init: Literal["zero", "gradmax"] = arg(
        "zero",
        "zero: random branch weights behind the zero gate; gradmax: the branch's first conv aimed from "
        "`data` (count=1)",
    )
    data: str | None = arg(
        None, "with init=gradmax: package.module:function returning (inputs, loss_fn); CLI: --data", names_code=True
    )

    def conflict(self) -> tuple[str, str, str] | None:
        if self.init == "gradmax" and self.count != 1:
            return (
                "count",
                f"init=gradmax aims one branch at a time; {self.count} branches aimed at the same batch "
                "would start (and stay) identical",
                "use count=1 (and call again), or init=zero",
            )
        return None

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """Every backbone conv a branch of `op` can run beside, the last first."""
        sites = branch_sites(gm, self.op, self.count)
        default = default_conv(gm, self.op, self.count)[0] if sites else None
        return [
            Candidate({"at": str(n.target)}, place(gm, n), cost, n is default) for _, _, _, n, cost in reversed(sites)
        ]


@dataclass(frozen=True)
class RemoveBranch(Pass):
    """Drop a branch from a merge: exact when its gate is 0, otherwise only with allow_change=true (reported)."""

    name: ClassVar[str] = "remove_branch"
    grows: ClassVar[bool] = False  # only removes: nothing to size (it reads the gate's value, which meta tensors lack)
    function = remove_branch
    requires = (
        Requirement(
            "a branch merge (add_branch's)",
            lambda gm: bool(_merges(gm)),
            "the model has no branch merge to remove from",
            "add_branch creates one",
        ),
    )
    ensures = (REMOVES_PARAMETERS,)
    at: str | None = arg(None, "the merge node, or the span it ends; default: the last merge")
    index: int = arg(-1, "which branch (-1: the last added)")
    allow_change: bool = arg(
        False, "drop a branch whose gate is not 0 (changes the function; the report says how much)"
    )
