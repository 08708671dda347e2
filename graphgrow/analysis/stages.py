"""The backbone as a practitioner sees it: the main path, its stages, and words for a place in it.

The *main path* is the chain of tensors every input-to-output path passes through (cut points of
the data-flow graph): a ResNet's block outputs, a ViT's token stream between encoder blocks —
not the tensors inside a block, a squeeze-excitation gate or a skip. A *stage* is a run of
main-path tensors at one resolution (H×W for feature maps, the token count for sequences). Pass
defaults use this to pick places a person would pick: a skip over one stage, a branch beside a
main-path conv, growth of a main-path layer, never graphgrow's own added modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import fx, nn

from ..graph.fx_edit import is_float_tensor, tensor_shape
from ..graph.graph_meta import graph_info, scope_of
from ..graph.shapes import param_count
from .axes import assign_channel_axes, node_axis
from .deployed import deployed_outputs
from .hearing import keep_heard
from .targets import Candidate, _is_head_pool, is_feature_map, is_global_pool, tensor_or_feature_end

T = TypeVar("T")
DEFAULT_BUDGET = 0.25  # what a pass's default target may add, as a fraction of the model's parameters


@dataclass
class Stage:
    index: int  # 1-based, in data-flow order
    resolution: tuple[int, ...]  # (H, W) of feature maps, (L,) of 1-D maps (N, C, L) or (tokens,) of sequences
    nodes: list[fx.Node]  # main-path tensors at this resolution, in order

    def describe(self, gm: fx.GraphModule, count: int) -> str:
        where = module_path(gm, self.nodes[-1]) or self.nodes[-1].name
        res = "×".join(map(str, self.resolution))
        if len(self.resolution) == 1:
            res = f"length {res}" if is_feature_map(self.nodes[-1]) else f"{res} tokens"
        return f"stage {self.index} of {count} ({where}, {res})"


def _reach(starts: list[fx.Node], step: Callable[[fx.Node], list[fx.Node]]) -> set[fx.Node]:
    """Every node reached from `starts` by repeatedly following `step` (users or inputs)."""
    seen: set[fx.Node] = set()
    todo = list(starts)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _data_nodes(gm: fx.GraphModule, end: fx.Node) -> list[fx.Node]:
    """Nodes between the graph's inputs and `end` along the data flow (no parameter fetches)."""
    down = _reach([n for n in gm.graph.nodes if n.op == "placeholder"], lambda n: list(n.users))
    up = _reach([end], lambda n: n.all_input_nodes)
    return [
        n
        for n in gm.graph.nodes
        if n in down and n in up and (n.op == "placeholder" or _carries_tensors(n.meta.get("gg_shape")))
    ]


def _carries_tensors(shape) -> bool:
    """A recorded output shape that holds a tensor (not a size or another plain value: those only say how big)."""
    if isinstance(shape, tuple):
        return True
    return isinstance(shape, list) and any(_carries_tensors(s) for s in shape)


def _carries_features(n: fx.Node) -> bool:
    """A float tensor, or several: not an integer or boolean index or mask (a sequence classifier's position of
    the last real token, computed from the token ids, picks the logits without carrying any of their features)."""
    return n.op == "placeholder" or getattr(n.meta.get("gg_dtype"), "is_floating_point", True) is not False


def main_path(gm: fx.GraphModule, end: fx.Node | None = None) -> list[fx.Node]:
    """Single float tensors that every path of features from the input to `end` (default: the first output
    tensor the deployed function returns, not a train-only one) passes through, in order; the input
    itself excluded. Paths through integer or boolean tensors (indices, masks) do not count."""
    if end is None:
        outs = [a for a in deployed_outputs(gm) if is_float_tensor(a)]
        if not outs:
            return []
        end = outs[0]
    nodes = _data_nodes(gm, end)
    pos = {n: i for i, n in enumerate(nodes)}
    cover = [0] * (len(nodes) + 1)
    for n in nodes:  # an edge u → v jumping over positions between them makes those positions bypassable
        if not _carries_features(n):  # an index or mask computed from the input selects features, carries none
            continue
        for u in n.all_input_nodes:
            if u in pos and pos[u] + 1 < pos[n] and _carries_features(u):
                cover[pos[u] + 1] += 1
                cover[pos[n]] -= 1
    cuts, depth = [], 0
    for i, n in enumerate(nodes):
        depth += cover[i]
        if depth == 0 and n.op != "placeholder" and is_float_tensor(n):
            cuts.append(n)
    return cuts


def _volumetric(gm: fx.GraphModule) -> bool:
    """Whether the model's feature maps are volumes (N, C, D, H, W): it convolves in 3-D (a video network). Only
    then is a rank-5 tensor a feature map; elsewhere it is a regrouping on the way (a channel shuffle's 5-D view)."""
    convs = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    return any(isinstance(m, nn.modules.conv._ConvNd) and len(m.kernel_size) == 3 for m in convs)


def _pools_a_volume(n: fx.Node) -> bool:
    """A rank-5 map pooled to one voxel per channel (is_global_pool knows 1-D and 2-D maps only)."""
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    s, out = tensor_shape(src) if src is not None else None, tensor_shape(n)
    if s is None or out is None or not len(s) == len(out) == 5:
        return False
    return all(d == 1 for d in out[2:]) and not all(d == 1 for d in s[2:])


def _resolution(n: fx.Node, volumetric: bool = False) -> tuple[int, ...] | None:
    s = tensor_shape(n)
    if s is None:
        return None
    if len(s) == 4 or (len(s) == 5 and volumetric and node_axis(n) == 1):
        return tuple(s[2:])
    if len(s) == 3:  # (N, C, L) after a Conv1d, (N, T, C) tokens
        return (s[2],) if node_axis(n) == 1 else (s[1],)
    return None


def backbone(gm: fx.GraphModule) -> list[fx.Node]:
    """The main path up to the backbone's last feature map or token sequence (before the head's
    global pooling, token selection or flatten, or a language model's per-token output Linear)."""
    assign_channel_axes(gm)
    path = main_path(gm)
    volumetric = _volumetric(gm)
    out: list[fx.Node] = []
    for n in path:
        if is_global_pool(gm, n) and _is_head_pool(n) and not _reshape_only(n):
            break  # patches flattened into a token sequence (same elements): the backbone goes on
        if volumetric and _pools_a_volume(n) and _is_head_pool(n):
            break  # a video network's global pool, (N, C, D, H, W) → (N, C, 1, 1, 1): the head
        if _resolution(n, volumetric) is None:
            if out and len(tensor_shape(n) or ()) <= 2:  # rank 2: the head
                break
            continue  # another rank on the way (a channel shuffle's 5-D view): the backbone goes on
        out.append(n)
    return out[: _token_head(gm, out)]


def _reshape_only(n: fx.Node) -> bool:
    """A rank-3 tensor holding exactly its input's elements (flatten(2) of a map), not a pooled one."""
    shape, src = tensor_shape(n), tensor_shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None
    return shape is not None and src is not None and len(shape) == 3 and _numel(shape) == _numel(src)


def _numel(shape: tuple) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _token_head(gm: fx.GraphModule, path: list[fx.Node]) -> int:
    """Where the backbone of a token model stops: before a last per-token nn.Linear to another width (a
    language model's lm_head, a token classifier) followed only by functions of its own shape (a logits
    bias); the path's length when there is none."""
    for i in range(len(path) - 1, 0, -1):
        n = path[i]
        shape = tensor_shape(n)
        if shape is None or len(shape) != 3 or is_feature_map(n):
            return len(path)
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            before = tensor_shape(path[i - 1])
            return i if before is not None and len(before) == 3 and before[-1] != shape[-1] else len(path)
        if n.op == "call_module" or tensor_shape(path[-1]) != shape:
            return len(path)
    return len(path)


def stages(gm: fx.GraphModule) -> list[Stage]:
    """The backbone's main path split where the resolution changes."""
    result: list[Stage] = []
    volumetric = _volumetric(gm)
    for n in backbone(gm):
        res = _resolution(n, volumetric)
        if res is None:
            continue
        if (
            result
            and result[-1].resolution == res
            and len(tensor_shape(result[-1].nodes[-1]) or ()) == len(tensor_shape(n) or ())
        ):
            result[-1].nodes.append(n)
        else:
            result.append(Stage(len(result) + 1, res, [n]))
    return result


def stage_end(found: list[Stage], i: int) -> fx.Node:
    """The output of stage i's last whole block: its last main-path tensor whose block (two levels of module
    path, e.g. layer3.1 or features.13) does not go on into the next stage. Inside a downsampling block
    without a skip (a MobileNet expansion) tensors are on the main path but are not a block's end."""

    def block(n: fx.Node) -> tuple[str, ...]:
        path = scope_of(n) + ((str(n.target),) if n.op == "call_module" else ())
        return path[:2]

    stage = found[i]
    later = {block(n) for n in found[i + 1].nodes} if i + 1 < len(found) else set()
    ends = [n for n in stage.nodes if block(n) not in later]
    return ends[-1] if ends else stage.nodes[-1]


def stage_ends(found: list[Stage]) -> list[tuple[Stage, fx.Node]]:
    """Each stage with the output of its last whole block (stage_end)."""
    return [(s, stage_end(found, i)) for i, s in enumerate(found)]


def module_path(gm: fx.GraphModule, n: fx.Node) -> str:
    """The module a node belongs to: its own for a module call, else the innermost enclosing one."""
    if n.op == "call_module":
        return str(n.target)
    scope = scope_of(n)
    return scope[-1] if scope else ""


def graphgrow_modules(gm: fx.GraphModule) -> set[str]:
    """Top-level modules that graphgrow's passes added (from the mutation log)."""
    return {m for e in graph_info(gm).get("log", []) for m in e.get("modules_added", [])}


def is_graphgrow_node(gm: fx.GraphModule, n: fx.Node, added: set[str] | None = None) -> bool:
    """Whether `n` calls (or lives inside) a module one of graphgrow's passes added."""
    added = graphgrow_modules(gm) if added is None else added
    path = module_path(gm, n)
    return bool(path) and path.split(".")[0] in added


def place(gm: fx.GraphModule, n: fx.Node, found: list[Stage] | None = None) -> str:
    """A node in words: module path, stage, resolution and channels."""
    found = stages(gm) if found is None else found
    shape = tensor_shape(n)
    stage = next((s for s in found if n in s.nodes), None)
    if stage is None:
        res = _resolution(n, _volumetric(gm))
        stage = next((s for s in found if s.resolution == res), None) if res is not None else None
    parts = [f"'{module_path(gm, n) or n.name}'"]
    if stage is not None:
        parts.append(stage.describe(gm, len(found)))
    axis = node_axis(n)
    if shape is not None and len(shape) >= 2 and axis is not None:
        parts.append(f"{shape[axis]} channels")
    return ", ".join(parts)


def default_point(
    gm: fx.GraphModule, cost: Callable[[fx.Node], int], budget: float = DEFAULT_BUDGET
) -> tuple[fx.Node, str]:
    """Where a pass that inserts a layer after a tensor goes by default: the end of the latest backbone stage
    where the layer (`cost(node)` parameters) stays within `budget` of the model's parameters; the backbone's
    last feature map when it fits. Returns (node, why in words)."""
    found = stages(gm)
    total = max(param_count(gm), 1)
    if not found:
        node, why = tensor_or_feature_end(gm, None)
        return node, why
    costs = [(s, end, cost(end)) for s, end in reversed(stage_ends(found))]
    live = keep_heard(gm, costs, lambda t: t[1])
    (stage, node, c), over = pick_within_budget(live, lambda t: t[2], total, budget)
    if over:
        where = "the smallest stage end"
    else:
        where = (
            "the backbone's last feature map"
            if node is costs[0][1]
            else f"the latest stage end where it adds at most {budget:.0%} of the parameters"
        )
    deaf = len(live) < len(costs)
    return (
        node,
        f"{where}: end of {stage.describe(gm, len(found))}; adds {c:,} "
        f"parameters ({100 * c / total:.1f}% of the model){over}"
        + (
            f"; {len(costs) - len(live)} other stage ends get a vanishing gradient from the output (an untrained "
            "stack too deep to pass its signal on): a layer grown there could not learn"
            if deaf
            else ""
        ),
    )


def pick_within_budget(
    ordered: list[T], cost: Callable[[T], int], total: int, budget: float = DEFAULT_BUDGET
) -> tuple[T, str]:
    """A default among main-path places: the first of `ordered` (the pass's preference) whose `cost` stays
    within `budget` of the model's `total` parameters; when none does (a small model), the smallest one.
    Returns (the place, "" or the sentence that says it is over the budget and why, for the report)."""
    for item in ordered:
        if cost(item) <= budget * total:
            return item, ""
    return min(ordered, key=cost), (
        f"; over budget: no main-path place adds at most {budget:.0%} of the model's "
        f"{total:,} parameters (a model this small grows more at any place), so the "
        "default is the smallest one"
    )


def stage_end_candidates(gm: fx.GraphModule, cost: Callable[[fx.Node], int]) -> list[Candidate]:
    """The end of each backbone stage, the last first, as `after=` candidates of a pass that inserts a layer
    there (`cost(node)` parameters); the one default_point picks is marked."""
    found = stages(gm)
    if not found:
        return []
    default, _ = default_point(gm, cost)
    return [
        Candidate({"after": end.name}, f"end of {s.describe(gm, len(found))}", cost(end), end is default)
        for s, end in reversed(stage_ends(found))
    ]
