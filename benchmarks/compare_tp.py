"""graphgrow's growable channel groups beside Torch-Pruning's prunable ones, on real models (random weights).

Torch-Pruning (TP, a dev dependency only) finds the same channel groups for pruning that graphgrow needs
for growth. Its groups come the way TP users get them: `DependencyGraph().build_dependency(model,
example_inputs)` and `get_all_groups(ignored_layers=...)`, the final classifier ignored (TP's README). A
group on either side is keyed by the conv/Linear layers (module paths) whose *output* channels form it;
depthwise convs are left out of the key (both sides treat them as per-channel). graphgrow's group of a
layer is the coupling group of that layer's output (trace → annotate → coupling.analyze); it is growable
when it has a producing layer and `Coupling.why_frozen` is empty, as in grow_width's `growable_layers`.

Columns: TP prunable groups; graphgrow growable groups (those only net2net-replication can grow, being
under a LayerNorm, in brackets); matched (prunable and growable); TP-only (prunable, frozen by graphgrow,
its reasons grouped by kind below the table); graphgrow-only (growable, not a prunable TP group); differ
(a TP group whose layers graphgrow splits or joins differently).

    python benchmarks/compare_tp.py [--models resnet18,timm:ghostnet_100] [--json now.json] [--before earlier.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


# name → (factory, input shape); inputs small where the model allows, to keep the run fast
def _tv(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None)

    return make


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kw)

    return make


S64, S96 = (1, 3, 64, 64), (1, 3, 96, 96)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (_tv("resnet18"), S64),
    "resnet50": (_tv("resnet50"), S64),
    "mobilenet_v2": (_tv("mobilenet_v2"), S64),
    "densenet121": (_tv("densenet121"), S64),
    "efficientnet_b0": (_tv("efficientnet_b0"), S64),
    "regnet_y_400mf": (_tv("regnet_y_400mf"), S64),
    "convnext_tiny": (_tv("convnext_tiny"), S64),
    "shufflenet_v2_x0_5": (_tv("shufflenet_v2_x0_5"), S64),
    "timm:resnest14d": (_timm("resnest14d"), S64),
    "timm:ghostnet_100": (_timm("ghostnet_100"), S64),
    "timm:vit_tiny_patch16_224": (_timm("vit_tiny_patch16_224", img_size=64), S64),
    "timm:skresnet18": (_timm("skresnet18"), S64),
    "timm:resnetv2_50x1_bit": (_timm("resnetv2_50x1_bit"), S64),
    "timm:mobilevit_xxs": (_timm("mobilevit_xxs"), S64),
}

CLASSES = 1000  # every model above is built with its default ImageNet head


@dataclass
class Compared:
    model: str
    tp_prunable: int = 0
    gg_growable: int = 0
    gg_norm_only: int = 0  # growable only by net2net replication (a LayerNorm reads the channels)
    matched: int = 0
    tp_only: list[dict] = field(default_factory=list)  # {"layers": [...], "reasons": [...]}
    gg_only: list[list[str]] = field(default_factory=list)
    differ: list[dict] = field(default_factory=list)  # {"tp": [...], "graphgrow": [[...], ...]}
    tp_error: str = ""
    gg_error: str = ""
    seconds: float = 0.0


def _is_layer(m: nn.Module) -> bool:
    """A conv or Linear whose outputs are its own channels (not a depthwise conv, which follows its input)."""
    if isinstance(m, nn.Linear):
        return True
    if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
        return not (m.groups > 1 and m.groups == m.in_channels == m.out_channels)
    return False


def tp_groups(model: nn.Module, example: torch.Tensor) -> list[frozenset[str]]:
    """TP's prunable groups, each as the layers whose output channels it prunes."""
    import torch_pruning as tp

    dg = tp.DependencyGraph().build_dependency(model, example_inputs=example)
    ignored = [
        m
        for m in model.modules()  # TP's README: do not prune the final classifier
        if (isinstance(m, nn.Linear) and m.out_features == CLASSES)
        or (isinstance(m, nn.modules.conv._ConvNd) and m.out_channels == CLASSES)
    ]
    names = {m: n for n, m in model.named_modules()}
    out = []
    for group in dg.get_all_groups(ignored_layers=ignored, root_module_types=(tp.ops.TORCH_CONV, tp.ops.TORCH_LINEAR)):
        layers = {
            names[d.target.module]
            for d, _ in group
            if dg.is_out_channel_pruning_fn(d.handler) and d.target.module in names and _is_layer(d.target.module)
        }
        if layers:
            out.append(frozenset(layers))
    return list(dict.fromkeys(out))


@dataclass
class GGView:
    """graphgrow's growth units keyed by layers: layer path → unit id, per unit its layers and why it is frozen.
    A unit is what growing one layer's coupling group changes: the group and every group it reaches."""

    group_of_layer: dict[str, int]
    layers: dict[int, frozenset[str]]
    reasons: dict[int, list[str]]
    norm_only: set[int]
    leaves: dict[str, str]  # opaque submodules (auto leaves) → why: a layer inside one is not in the graph


FUNCTIONAL_LAYERS = {F.conv1d, F.conv2d, F.conv3d, F.linear, torch.conv1d, torch.conv2d, torch.conv3d}


def gg_view(model: nn.Module, shape: tuple[int, ...]) -> GGView:
    import graphgrow as gg
    from graphgrow.analysis.coupling import analyze

    gm = gg.trace(model, shape, check=False)
    gg.annotate(gm, shape)
    c = analyze(gm)
    group_of_layer: dict[str, int] = {}
    extra: dict[int, list[str]] = {}
    for n in gm.graph.nodes:
        if n.name not in c.group_of:
            continue
        if n.op == "call_module" and _is_layer(gm.get_submodule(n.target)):
            group_of_layer[str(n.target)] = c.group_of[n.name]
        elif n.op == "call_function" and n.target in FUNCTIONAL_LAYERS and n.meta.get("nn_module_stack"):
            # a layer subclass fx traced into (timm's Linear, a weight-standardised conv): graphgrow sees its call,
            # as a layer when the call is on the layer's own (or standardised) weight (coupling.functional)
            path = list(n.meta["nn_module_stack"].values())[-1][0]
            m = model.get_submodule(path)
            if _is_layer(m) and path not in group_of_layer:
                group_of_layer[path] = c.group_of[n.name]
                if n.name not in c.functional:
                    extra.setdefault(c.group_of[n.name], []).append(
                        f"'{path}' ({type(m).__name__}) is traced through: "
                        f"graphgrow sees its {n.target.__name__} call, not a layer"
                    )
    own: dict[int, set[str]] = {}
    for path, gid in group_of_layer.items():
        own.setdefault(gid, set()).add(path)
    # what one growth changes: a group and the groups it reaches through links (a radix split, a cat)
    unit_id: dict[frozenset[str], int] = {}
    layers: dict[int, frozenset[str]] = {}
    reasons: dict[int, list[str]] = {}
    norm_only: set[int] = set()
    uid_of_gid: dict[int, int] = {}
    for gid in own:
        reached = c.reached(gid)
        unit = frozenset(p for g in reached for p in own.get(g, ()))
        uid = uid_of_gid[gid] = unit_id.setdefault(unit, len(unit_id))
        layers[uid] = unit
        why = c.why_frozen(gid) + [x for g in reached for x in extra.get(g, [])]
        reasons[uid] = [] if not why or reasons.get(uid) == [] else list(dict.fromkeys(reasons.get(uid, []) + why))
        if c.norms_reached(gid):
            norm_only.add(uid)
    group_of_layer = {path: uid_of_gid[gid] for path, gid in group_of_layer.items()}
    leaves = gm.meta["graphgrow"]["trace"].get("auto_leaves") or {}
    return GGView(group_of_layer, layers, reasons, norm_only, leaves if isinstance(leaves, dict) else {})


def unseen_reason(view: GGView, layer: str) -> str:
    leaf = next((p for p in view.leaves if layer.startswith(p + ".")), None)
    if leaf:
        return f"'{layer}' is inside the opaque leaf '{leaf}' ({view.leaves[leaf].split(' (')[0]})"
    return f"'{layer}' is not a node of graphgrow's graph"


def compare(name: str, model: nn.Module, shape: tuple[int, ...]) -> Compared:
    r = Compared(name)
    start = time.perf_counter()
    model.eval()
    try:
        view = gg_view(model, shape)
    except Exception as e:  # noqa: BLE001 — a row says what went wrong instead of ending the table
        r.gg_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        view = GGView({}, {}, {}, set(), {})
    growable = {gid for gid, rs in view.reasons.items() if not rs}
    r.gg_growable = len(growable)
    r.gg_norm_only = len(growable & view.norm_only)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prunable = tp_groups(model, torch.randn(shape))
    except Exception as e:  # noqa: BLE001
        r.tp_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        prunable = []
    r.tp_prunable = len(prunable)
    touched: set[int] = set()
    for layers in prunable:
        gids = {view.group_of_layer[p] for p in layers if p in view.group_of_layer}
        touched |= gids
        unseen = sorted(p for p in layers if p not in view.group_of_layer)
        if gids and not unseen and len(gids) == 1 and view.layers[next(iter(gids))] == layers:
            gid = next(iter(gids))
            if gid in growable:
                r.matched += 1
            else:
                r.tp_only.append(
                    {"layers": sorted(layers), "reasons": view.reasons[gid], "graphgrow": [sorted(layers)]}
                )
            continue
        reasons = [x for g in sorted(gids) for x in view.reasons[g]] + [unseen_reason(view, p) for p in unseen]
        if reasons:  # frozen; a freeze also cuts the group where graphgrow does not follow an op
            r.tp_only.append(
                {
                    "layers": sorted(layers),
                    "reasons": list(dict.fromkeys(reasons)),
                    "graphgrow": [sorted(view.layers[g]) for g in sorted(gids)],
                }
            )
        else:  # both sides can change these layers, but they couple them differently
            r.differ.append({"tp": sorted(layers), "graphgrow": [sorted(view.layers[g]) for g in sorted(gids)]})
    r.gg_only = [sorted(view.layers[g]) for g in sorted(growable - touched)]
    r.seconds = round(time.perf_counter() - start, 1)
    return r


def reason_kind(reason: str) -> str:
    """A reason without its node names and numbers: what kind of thing froze the group."""
    reason = re.sub(r"^'[^']*': ", "", reason)
    return re.sub(r"\b\d+\b", "N", re.sub(r"'[^']*'", "…", reason))


def kinds(r: Compared) -> dict[str, int]:
    """Per kind of reason, how many TP-only groups have it."""
    out: dict[str, int] = {}
    for g in r.tp_only:
        for k in dict.fromkeys(reason_kind(x) for x in g["reasons"]) or ["(no reason given)"]:
            out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def markdown(results: list[Compared], before: dict[str, dict] | None = None) -> str:
    """The table; with `before` (model → an earlier run's row, from --json) a column of its growable counts."""
    was = "growable before | " if before is not None else ""
    lines = [
        f"| model | TP prunable | {was}graphgrow growable [LN] | matched | TP-only | graphgrow-only | differ | s |",
        "|---|---:|" + ("---:|" if was else "") + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tp = f"crash ({r.tp_error[:60]})" if r.tp_error else str(r.tp_prunable)
        gg_ = f"error ({r.gg_error[:60]})" if r.gg_error else f"{r.gg_growable} [{r.gg_norm_only}]"
        old = "" if before is None else f"{before[r.model]['gg_growable'] if r.model in before else '–'} | "
        lines.append(
            f"| {r.model} | {tp} | {old}{gg_} | {r.matched} | {len(r.tp_only)} | {len(r.gg_only)} | "
            f"{len(r.differ)} | {r.seconds:.0f} |"
        )
    lines.append("")
    for r in results:
        if r.tp_only or r.differ or r.gg_only:
            lines.append(f"**{r.model}**")
            lines += [f"- TP-only ×{n}: {k}" for k, n in kinds(r).items()]
            lines += [f"- graphgrow-only: {', '.join(g[:3])}{' …' if len(g) > 3 else ''}" for g in r.gg_only[:5]]
            lines += [
                f"- differ: TP {d['tp'][:3]} vs graphgrow {[g[:3] for g in d['graphgrow']]}" for d in r.differ[:5]
            ]
    return "\n".join(lines)


def run(models: list[str], progress: Callable[[str], None] = lambda s: None) -> list[Compared]:
    out = []
    for name in models:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        progress(name)
        factory, shape = MODELS[name]
        torch.manual_seed(0)
        out.append(compare(name, factory(), shape))
    return out


def rows(models=tuple(MODELS), progress: Callable[[str], None] = lambda s: None) -> list:
    """benchmarks/run.py's section `tp`: per model, the TP-prunable groups graphgrow grows (information only)."""
    from common import Row

    result = []
    for r in run(list(models), progress):
        note = (
            f"TP {r.tp_error or r.tp_prunable}, graphgrow {r.gg_error or r.gg_growable}, TP-only {len(r.tp_only)}"
            + "".join(f"; {k} ×{n}" for k, n in list(kinds(r).items())[:3])
        )
        result.append(
            Row("tp", r.model, "TP-prunable groups graphgrow grows", r.matched, r.matched, "groups", note=note)
        )
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", help="also write every group and reason to this file")
    ap.add_argument("--before", help="a file an earlier run wrote with --json: adds its growable counts as a column")
    args = ap.parse_args(argv)
    before = None
    if args.before:
        with open(args.before) as f:
            before = {r["model"]: r for r in json.load(f)}
    torch.set_num_threads(1)
    results = run([m.strip() for m in args.models.split(",") if m.strip()], lambda s: print(s, file=sys.stderr))
    print(markdown(results, before))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
