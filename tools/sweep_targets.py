"""The sweep's targets (issue 39), measured from its own results: per registry and pass, what share of the runs
verified (or refused for a stated impossibility, where the target counts those), against the target.

What a denominator leaves out is decided by facts about the model that graphgrow's own analyses do not produce
(else a model the analysis misreads would excuse itself):
- a model that the installed library cannot build even from its own default config, or that needs an optional
  package that is not installed (the run's message says so), is upstream's failure: left out, and counted;
- grow_hidden and grow_heads count only on transformers models whose architecture has attention, read from the
  code transformers ships (an nn.Module class named *Attention* in the module of the model's class, or a number of
  attention heads in its config or a sub-config); a model counts as having attention if either says so;
- torchvision's classification builders (quantized ones included) and its other builders have separate targets
  (read from its registry).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections import defaultdict

UPSTREAM = re.compile(r"even from its default config|needs an optional package", re.I)
# classes of refusal that state an impossibility of the model (the pass has nothing it may grow there)
STATED = {"impossible by construction", "no place"}
ATTENTION_PASSES = {"grow_hidden", "grow_heads"}


HEAD_FIELD = re.compile(r"attention_heads|^num_heads$|^n_heads?$")


def _config_fields(config_class: type, depth: int = 0) -> set[str]:
    """The field names of a config class and of its sub-configs (found by their declared model type where the
    sub-config class is AutoConfig), from annotations and from the defaults where they validate."""
    import transformers

    names = {k for c in getattr(config_class, "__mro__", [config_class]) for k in getattr(c, "__annotations__", {})}
    with contextlib.suppress(Exception):  # a default the config's own validation refuses: the annotations serve
        names |= set(vars(config_class()))
    if depth < 2:
        for spec in getattr(config_class, "sub_configs_defaults", {}).values():
            sub_type = getattr(spec, "model_type", None)
            if sub_type in transformers.CONFIG_MAPPING:
                names |= _config_fields(transformers.CONFIG_MAPPING[sub_type], depth + 1)
        for sub in getattr(config_class, "sub_configs", {}).values():
            if sub is not transformers.AutoConfig:
                names |= _config_fields(sub, depth + 1)
    return names


def hf_has_attention(model_types: list[str]) -> dict[str, bool]:
    """model type → whether its architecture has attention: the modeling module of its swept model class
    defines an nn.Module named *Attention*, or its config (or a sub-config) has a number of attention heads.
    Reads code and configs only (no model is built); a type whose class cannot be imported is left out."""
    import torch.nn as nn
    import transformers
    from sweep_models import hf_task

    out = {}
    for t in model_types:
        found = hf_task(t)
        cls_name = found[1] if found else None
        try:
            cls = getattr(transformers, cls_name) if cls_name else None
            module = importlib.import_module(cls.__module__) if cls is not None else None
            config_class = transformers.CONFIG_MAPPING[t]
        except Exception:
            continue
        if module is None:
            continue
        out[t] = any(
            isinstance(v, type) and issubclass(v, nn.Module) and "Attention" in k for k, v in vars(module).items()
        ) or any(HEAD_FIELD.search(f) for f in _config_fields(config_class))
    return out


def torchvision_classification() -> set[str]:
    import torchvision.models as tvm

    others = {
        n for m in ("detection", "segmentation", "video", "optical_flow") for n in tvm.list_models(getattr(tvm, m))
    }
    return {n for n in tvm.list_models() if n not in others}  # quantized classifiers are classifiers


def _row(label: str, runs: list[dict], left_out: int, target: float, stated_counts: bool) -> str:
    ok = [r for r in runs if r["status"] == "verified" or (stated_counts and r.get("class") in STATED)]
    verified = sum(r["status"] == "verified" for r in runs)
    share = len(ok) / len(runs) if runs else 0.0
    met = "yes" if runs and share >= target else "**no**"
    what = "verified or stated impossibility" if stated_counts else "verified"
    return (
        f"| {label} | {len(runs)} | {left_out} | {verified} | {len(ok)} ({share:.0%} {what}) | {target:.0%} | {met} |"
    )


HEAD = [
    "| pass | runs counted | left out | verified | meeting the target | target | met |",
    "|---|---|---|---|---|---|---|",
]


def targets(runs: list[dict], registry: str, facts: dict[str, object]) -> list[str]:
    """Markdown lines: the target table of one registry's runs (empty for a registry without targets)."""
    upstream = [r for r in runs if r["status"] != "verified" and UPSTREAM.search(r.get("message", ""))]
    counted = [r for r in runs if r not in upstream]
    lines: list[str] = []
    if registry == "hf":
        attention = facts.get("hf_attention", {})
        assert isinstance(attention, dict)
        by_pass = defaultdict(list)
        for r in counted:
            by_pass[r["pass"]].append(r)
        lines += HEAD
        for p, target in (("deepen", 0.9), ("grow_width", 0.9), ("grow_hidden", 0.75), ("grow_heads", 0.75)):
            rs = by_pass.get(p, [])
            if p in ATTENTION_PASSES:
                rs = [r for r in rs if attention.get(r["model"], True)]
            left = sum(r["pass"] == p for r in runs) - len(rs)
            lines.append(_row(p, rs, left, target, stated_counts=False))
        no_attention = sorted(m for m, a in attention.items() if not a and any(r["model"] == m for r in runs))
        lines += [
            "",
            f"Left out: {len({r['model'] for r in upstream})} models that transformers cannot build here "
            f"({', '.join(sorted({r['model'] for r in upstream})) or 'none'}); for grow_hidden and grow_heads also "
            f"{len(no_attention)} models whose architecture has no attention (no attention module in its modeling "
            f"code, no attention heads in its config) "
            f"({', '.join(no_attention) or 'none'}).",
        ]
    elif registry == "timm":
        lines += HEAD
        lines.append(_row("every pass", counted, len(runs) - len(counted), 0.95, stated_counts=True))
    elif registry == "torchvision":
        classification = facts.get("torchvision_classification", set())
        assert isinstance(classification, set)
        lines += HEAD
        cls_runs = [r for r in counted if r["model"] in classification]
        other = [r for r in counted if r["model"] not in classification]
        lines.append(_row("classification, every pass", cls_runs, 0, 1.0, stated_counts=True))
        lines.append(_row("other builders, every pass", other, 0, 0.8, stated_counts=True))
    return ["### Targets (issue 39)", "", *lines, ""] if lines else []


def facts_for(results: list[dict]) -> dict[str, object]:
    """What targets() needs to know about the models in `results` (imports the registries that appear)."""
    registries = {r["registry"] for r in results}
    facts: dict[str, object] = {}
    if "hf" in registries:
        facts["hf_attention"] = hf_has_attention(sorted({r["model"] for r in results if r["registry"] == "hf"}))
    if "torchvision" in registries:
        facts["torchvision_classification"] = torchvision_classification()
    return facts
