"""A model grown inside one of its parts, stored and read back whole (architecture.md §7, capture/parts.py).

A model that cannot be captured whole has no graph to store. Its file (`graphgrow.part`, version 1) holds:
- `model`: the name the model was built by — a zoo name (`torchvision:NAME(...)`, `timm:NAME`, `hf:TYPE/TASK`) with
  its literal arguments, read back by the same parser and checks as a name on the command line (io/zoo.py);
- `part`: the grown part's module path in that model, and `graph`: its GraphModule in graphgrow's stored-graph format
  (io/serialize.py: the module tree of standard layers and the graph as data, checked node by node on load);
- `weights`: the whole model's state dict, part included (torch.save stores a tensor the two share once);
- `inputs`: the whole model's example input spec; `factory_seed`: the seed its random weights were drawn with.

Loading builds the model by its name under the same checks as a name given on the command line (io/load.py's
factory path: the zoo's registered builders only, no weights, --max-load), puts the part rebuilt from its checked
records at its path (reached through the module tree's children only), loads the weights strictly, and runs the
whole model once: the part must be called once on exactly the input its stored spec says. A name that is not a zoo
name (`package.module:factory`) would make the file import and call code: it is refused unless the user says
`--trust` (trust=True) or names that factory again (`factory=`, compared with the stored one).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import LoadError, SaveError, first_line
from ..core.names import is_path, shown
from ..graph.calls import record_calls, spec_matches
from ..graph.graph_meta import input_spec_of
from ..graph.inputs import InputSpec, call, parse_spec, records
from . import serialize

FORMAT = "graphgrow.part"
VERSION = 1
MAX_NAME_TEXT = 2_000  # characters of the stored model name with its arguments (zoo.MAX_ARGUMENTS)


def stored_name(loaded_kind: str, source: str, model_name: str | None) -> str:
    """The name a part file rebuilds its model by: the model's name for a model built by name (or one read from a
    part file). A model read from a file has none: SaveError."""
    if model_name is not None:
        return model_name
    if loaded_kind == "factory":
        return source
    raise SaveError(
        f"cannot save the model grown inside a part: {source} was read from a file, and a file of a model grown "
        "inside a part rebuilds the model by its name",
        "name the model (torchvision:NAME, timm:NAME, hf:TYPE/TASK or package.module:factory), or save the grown "
        "part alone from Python (graphgrow.save)",
    )


def payload(
    name: str, path: str, part: fx.GraphModule, whole: nn.Module, spec: InputSpec, factory_seed: int | None
) -> dict[str, Any]:
    """The file's content: the name, the part's path and stored graph, the whole model's weights and input spec."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": name,
        "part": path,
        "graph": serialize.to_payload(part),  # SaveError for a node graphgrow could not read back
        "weights": {k: v.detach() for k, v in whole.state_dict().items()},
        "inputs": records(spec),
        "factory_seed": factory_seed if factory_seed is not None else 0,
    }


def save(
    target: Path,
    name: str,
    path: str,
    part: fx.GraphModule,
    whole: nn.Module,
    spec: InputSpec,
    factory_seed: int | None,
) -> None:
    """Write the part file through a staging file (save.atomic_write's caller gives `target`, already staged)."""
    from .outputs import torch_save

    torch_save(payload(name, path, part, whole, spec, factory_seed), target)


def is_part_payload(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def _refuse(file: str, what: str, after_build: bool = False) -> LoadError:
    done = "the model built by its name is not returned" if after_build else "nothing was built or run"
    return LoadError(f"{file}: {what}; {done}", "the file is corrupted or hostile; re-create it")


def read(
    obj: dict[str, Any],
    file: str,
    trust: bool,
    build: Callable[[str, int], nn.Module],
    factory: str | None = None,
    limit: int | None = None,
) -> tuple[nn.Module, str, InputSpec, list[Any]]:
    """(the whole model, its name, its example input spec, the part's mutation log) from a part file's content.
    `build(name, seed)` builds a model by name under the command line's checks (load.py). Every field is checked
    before anything is built; LoadError names the first that is wrong."""
    if obj.get("version") != VERSION:
        raise _refuse(file, f"part file version {shown(obj.get('version'))} is not supported (this graphgrow reads 1)")
    name, path, graph, weights = obj.get("model"), obj.get("part"), obj.get("graph"), obj.get("weights")
    seed = obj.get("factory_seed", 0)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_TEXT:
        raise _refuse(file, "the stored model name is not a name of at most 2,000 characters")
    if not is_path(path):
        raise _refuse(file, f"the stored part path {shown(path)} is not a module path")
    if not isinstance(graph, dict) or graph.get("format") != serialize.FORMAT:
        raise _refuse(file, "the stored part is not a graphgrow graph")
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise _refuse(file, "the stored weights are not a state dict of tensors")
    if type(seed) is not int or not 0 <= seed < 2**63:
        raise _refuse(file, "the stored factory seed is not a seed")
    spec = _whole_spec(obj.get("inputs"), file)
    _allowed_name(name, file, trust, factory)
    root, nodes = graph.get("root"), graph.get("nodes")
    if isinstance(root, nn.Module) and isinstance(nodes, list):
        from .mode_switch import check_node_total

        check_node_total(root, len(nodes), serialize.MAX_NODES)
    part = serialize.from_payload(graph, trusted=trust)  # every node checked before anything is built
    model = build(name, seed)
    holder, child = _holder(model, path, file, name)
    holder._modules[child] = part
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise _refuse(
            file, f"its weights do not fit {name[:200]} with the part '{path}' grown: {first_line(e, 300)}", True
        ) from e
    _check_fits(model, path, part, spec, file, limit)
    return model, name, spec, list(part.meta.get("graphgrow", {}).get("log", []))


def _whole_spec(value: Any, file: str) -> InputSpec:
    try:
        return parse_spec(serialize.stored_inputs(value))
    except LoadError as e:
        raise _refuse(file, e.message) from e


def _allowed_name(text: str, file: str, trust: bool, factory: str | None) -> None:
    """A zoo name is read as one from the command line; any other name would import and call code a file names."""
    from .zoo import parse_name

    name = parse_name(text)  # LoadError for anything that is not a model name with literal arguments
    if name.zoo is not None or trust:
        return
    if factory is not None and factory.strip() == text.strip():
        return
    raise LoadError(
        f"{file} rebuilds its model by the factory {shown(name.target)}, which is not a zoo model (timm:, "
        "torchvision:, hf:); a file never makes graphgrow import or call a name; nothing was imported",
        "pass --trust if you wrote the file yourself, or name that factory again when loading (factory=...)",
    )


def _holder(model: nn.Module, path: str, file: str, name: str) -> tuple[nn.Module, str]:
    """The module holding the part and the part's name in it, reached through children only (no attribute read)."""
    *parents, child = path.split(".")
    holder = model
    for seg in parents:
        nxt = holder._modules.get(seg)
        if not isinstance(nxt, nn.Module):
            raise _refuse(file, f"{name[:200]} has no submodule '{path[:300]}' for the stored part", True)
        holder = nxt
    if not isinstance(holder._modules.get(child), nn.Module):
        raise _refuse(file, f"{name[:200]} has no submodule '{path[:300]}' for the stored part", True)
    return holder, child


def _check_fits(
    model: nn.Module, path: str, part: fx.GraphModule, spec: InputSpec, file: str, limit: int | None
) -> None:
    """Run the rebuilt whole model once (eval, seeded example input, under the allocation guard): the part must be
    called once, on the input its own stored spec says."""
    from ..core.allocation import AllocationGuard
    from ..core.state import preserved_buffers, seeded, training_mode
    from ..graph.shapes import example_input

    part_spec = input_spec_of(part)
    x = example_input(model, spec, seed=0)

    def run(m: nn.Module) -> Any:
        with torch.no_grad(), training_mode(m, False), preserved_buffers(m), seeded(0):
            return call(m, x)

    guard = AllocationGuard(limit if limit is not None else int(os.environ.get("GRAPHGROW_MAX_LOAD_BYTES", 16 << 30)))
    try:
        with guard:
            calls, _ = record_calls(model, run)
    except Exception as e:
        raise _refuse(file, f"the rebuilt model does not run on its stored input: {first_line(e, 300)}", True) from e
    if not spec_matches(part_spec, calls.get(path)):
        raise _refuse(file, f"the stored part '{path[:300]}' is not called once on the input it was grown for", True)
