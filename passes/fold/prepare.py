"""Before the rules run, once: specialise the graph to eval mode and expand graphgrow's own structure
(`training` reads become False, nn.Sequential is inlined, BatchNorm subclasses split, merges become
`main + Σ (gate_i/n)·branch_i`, scalar gates become constants)."""

from __future__ import annotations

import operator

import torch
from graphgrow.passes.fold.graph import ADD, MUL, SITE, SUB, bypass, module_of, substitute  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import AverageMerge, tensor_shape, unique_attr


def training_false(gm: fx.GraphModule) -> int:
    """Reads of `training` (kept as runtime switches by the tracer) become the constant False."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and str(n.target).split(".")[-1] == "training":
            substitute(n, False)
            count += 1
    return count


def inline_sequentials(gm: fx.GraphModule) -> int:
    count = 0
    changed = True
    while changed:
        changed = False
        for n in list(gm.graph.nodes):
            m = module_of(gm, n)
            if type(m) is nn.Sequential and len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node):
                x = n.args[0]
                with gm.graph.inserting_before(n):
                    for name, _ in m.named_children():
                        x = gm.graph.call_module(f"{n.target}.{name}", (x,))
                        x.meta["gg_scope"] = n.meta.get("gg_scope")
                bypass(n, x)
                changed = True
                count += 1
    return count


def split_norm_subclasses(gm: fx.GraphModule) -> int:
    """A BatchNorm subclass with its own forward (timm's BatchNormAct2d) that computes a plain BatchNorm
    followed by its child modules — checked on a random input — becomes exactly that, so the BatchNorm can fold."""
    count = 0
    for n in list(gm.graph.nodes):
        m = module_of(gm, n)
        if (
            not isinstance(m, nn.modules.batchnorm._BatchNorm)
            or type(m).forward is nn.modules.batchnorm._BatchNorm.forward
        ):
            continue
        shape = tensor_shape(n)
        if (
            shape is None
            or len(n.args) != 1
            or n.kwargs
            or not isinstance(n.args[0], fx.Node)
            or m.running_mean is None
        ):
            continue
        plain_type = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(len(shape))
        if plain_type is None:
            continue
        plain = plain_type(
            m.num_features,
            m.eps,
            m.momentum,
            m.affine,
            m.track_running_stats,
            device=m.running_mean.device,
            dtype=m.running_mean.dtype,
        ).eval()
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
        if (
            not isinstance(want, torch.Tensor)
            or want.shape != got.shape
            or not torch.allclose(want, got, rtol=1e-5, atol=1e-6)
        ):
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
        bypass(n, y)
        count += 1
    return count


def expand_merges(gm: fx.GraphModule, notes: list[str]) -> None:
    """AverageMerge → main + Σ (gate_i/n)·branch_i; branches with a zero gate are dropped."""
    for n in list(gm.graph.nodes):
        m = module_of(gm, n)
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
        bypass(n, acc)  # type: ignore[arg-type]


def scalar_gates(gm: fx.GraphModule) -> None:
    """One-element parameters used only as multipliers (graphgrow's gates) become constants."""
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or not n.users:
            continue
        try:
            t = gm.get_parameter(n.target)
        except AttributeError:
            continue
        if t.dim() == 0 and all(u.op == "call_function" and u.target in MUL for u in n.users):
            for u in n.users:
                for user in u.users:
                    if user.op == "call_function" and user.target in ADD + SUB:
                        user.meta[SITE] = f"gate '{n.target}'"
            substitute(n, float(t.detach()))
            gm.graph.erase_node(n)


def prepare(gm: fx.GraphModule, notes: list[str]) -> None:
    """All of the above, in order (each step may expose work for the next)."""
    training_false(gm)
    inline_sequentials(gm)
    split_norm_subclasses(gm)
    expand_merges(gm, notes)
    scalar_gates(gm)
