"""The sweep's target table (tools/sweep_targets.py, issue 39): shares over the runs a target counts, upstream
build failures and attention-free architectures left out by facts graphgrow's analyses do not produce."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from sweep_targets import hf_has_attention, targets  # noqa: E402


def run(model: str, p: str, status: str, cls: str = "", message: str = "") -> dict:
    return {"registry": "hf", "model": model, "pass": p, "status": status, "class": cls, "message": message}


def row(lines: list[str], label: str) -> list[str]:
    return next(line.rstrip(" |").split(" | ") for line in lines if line.startswith(f"| {label} |"))


def test_hf_targets_leave_out_upstream_failures_and_attention_free_models_only_where_the_target_says():
    runs = [run(m, p, "verified") for m in ("a", "b", "c") for p in ("deepen", "grow_heads")]
    runs += [run("ssm", "deepen", "verified"), run("ssm", "grow_heads", "refused", "no place", "no heads found")]
    broken_upstream = "cannot build hf:x: transformers cannot build x even from its default config (KeyError)"
    runs += [run("x", p, "refused", "model does not build", broken_upstream) for p in ("deepen", "grow_heads")]
    ours = "hf:y: the config refused the arguments: ValueError"  # the shrinker's fault: counted
    runs += [run("y", p, "refused", "model does not build", ours) for p in ("deepen", "grow_heads")]
    lines = targets(runs, "hf", {"hf_attention": {"a": True, "b": True, "c": True, "ssm": False, "y": True}})
    deepen = row(lines, "deepen")
    assert deepen[1:4] == ["5", "1", "4"], deepen  # a, b, c, ssm verified; y counted; x left out
    assert deepen[4].startswith("4 (80%") and deepen[6] == "**no**"
    heads = row(lines, "grow_heads")
    assert heads[1:4] == ["4", "2", "3"], heads  # ssm has no attention: left out here, not for deepen
    assert "x" in lines[-2] and "ssm" in lines[-2]


def test_timm_counts_stated_impossibilities_and_torchvision_splits_classification():
    timm = [dict(run("m", p, "verified"), registry="timm") for p in ("deepen", "grow_width", "add_branch")]
    timm.append(dict(run("m", "grow_heads", "refused", "no place"), registry="timm"))
    timm.append(dict(run("m", "grow_hidden", "refused", "not understood"), registry="timm"))
    every = row(targets(timm, "timm", {}), "every pass")
    assert every[3] == "3" and every[4].startswith("4 (80%") and every[6] == "**no**"
    tv = [dict(run(m, "deepen", "verified"), registry="torchvision") for m in ("resnet18", "fcn_resnet50")]
    tv.append(dict(run("raft_small", "deepen", "broken", "timeout"), registry="torchvision"))
    lines = targets(tv, "torchvision", {"torchvision_classification": {"resnet18"}})
    assert row(lines, "classification, every pass")[6] == "yes"
    other = row(lines, "other builders, every pass")
    assert other[4].startswith("1 (50%") and other[6] == "**no**"


def test_attention_is_read_from_the_modeling_code_and_sub_configs():
    pytest.importorskip("transformers")
    found = hf_has_attention(["llama", "mamba", "fuyu", "convnext"])
    # fuyu's own module has no attention class: its language model is a sub-config (AutoConfig, by model type)
    assert found == {"llama": True, "mamba": False, "fuyu": True, "convnext": False}
