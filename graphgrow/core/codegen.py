"""The code fx generates reaches a module's parts by generated identifiers, never by their spelling.

torch.fx writes a module or attribute path as `self.a.b`. A segment that is not an identifier it
writes as `getattr(self.a, "SEG")` with SEG pasted between quotes unescaped, and one that is an
identifier it writes bare even when Python cannot read it so (`self.class` does not parse; NFKC
folds `self.ｓｅｌｆ` into `self.self`). PyTorch accepts all of these as module, parameter and buffer
names (torchvision's RegNet names its blocks `block4-0`), and a file can carry any of them.

`NamedByData` is the code generator graphgrow gives every graph it builds (`adopt`): a segment that
is not a plain ASCII identifier is written `getattr(BASE, _name_N)`, where `_name_N` is an identifier
fx's namespace makes and a global of the generated code bound to the segment's text. So the module
tree keeps its names as they are (state_dict keys, ONNX initialiser names, `inspect`), and no name's
text is ever part of the source — a name is a value the code reads, like a weight.

fx builds the path text in one module-level helper, `torch.fx.graph._format_target`, replaced once
here. While a `NamedByData` generator runs on this thread it writes generated identifiers; for every
other graph in the process — torch builds its own from a graphgrow model, e.g. the module
torch.export unlifts on the way to ONNX — it writes what fx writes, except that a segment that is not
a plain identifier goes into `getattr` as an escaped string (`repr`), never pasted between quotes.
Should a torch version stop calling the helper, `NamedByData` notices (a segment that needed a
generated name got none) and refuses to write the code instead of pasting the name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.fx.graph as fx_graph
from torch import fx

from .names import is_identifier

_local = threading.local()  # the running NamedByData's `name_for`, per thread
_fx_format_target: Callable[[str, str], str] | None = getattr(fx_graph, "_format_target", None)


def _format_target(base: str, target: str) -> str:
    """fx's path text: plain identifiers bare; any other segment through a generated identifier under NamedByData,
    else (a graph torch builds itself, e.g. torch.export's unlifted module) as an escaped string, never pasted."""
    name_for = getattr(_local, "name_for", None)
    out = base
    for segment in target.split("."):
        if is_identifier(segment):
            out = f"{out}.{segment}"
        elif _is_index(segment):  # nn.Sequential's "0", "1", …: ASCII digits say nothing, written as fx writes them
            out = f'getattr({out}, "{segment}")'
        else:
            out = f"getattr({out}, {name_for(segment) if name_for is not None else repr(segment)})"
    return out


if _fx_format_target is not None:
    fx_graph._format_target = _format_target


class CodegenError(RuntimeError):
    """torch.fx wrote a path without asking for its segments' names (a torch version graphgrow does not know)."""


class NamedByData(fx.graph.CodeGen):
    """fx's code generator, with path segments that are not plain identifiers read from generated globals."""

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any, **kwargs: Any) -> fx.graph.PythonCode:
        bound: dict[str, str] = {}

        def name_for(segment: str) -> str:
            if segment not in bound:
                bound[segment] = namespace.create_name("_name", None)
            return bound[segment]

        outer = getattr(_local, "name_for", None)
        _local.name_for = name_for
        try:
            code = super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        finally:
            _local.name_for = outer
        missing = [s for s in _segments(nodes) if not is_identifier(s) and not _is_index(s) and s not in bound]
        if missing:
            raise CodegenError(
                f"torch.fx wrote the path segment {missing[0][:80]!r} without a generated name; this torch "
                "version writes code in a way graphgrow does not know, so no code was made from it"
            )
        code.globals.update({name: segment for segment, name in bound.items()})
        return code


def _is_index(segment: str) -> bool:
    return segment.isascii() and segment.isdigit()


def _segments(nodes: Any) -> list[str]:
    """The path segments fx writes through `_format_target` for these nodes."""
    out: list[str] = []
    for n in nodes:
        if n.op in ("get_attr", "call_module", "call_method") and isinstance(n.target, str):
            out.extend(n.target.split("."))
    return out


_NAMED: dict[type, type[NamedByData]] = {fx.graph.CodeGen: NamedByData}


def adopt(graph: fx.Graph) -> fx.Graph:
    """`graph`, written from now on by NamedByData (deep copies keep it: fx copies the generator). A generator
    of fx's own kind (the pytree form fx's tracer uses for some signatures) keeps its behaviour, with the names."""
    current = graph._codegen
    if not isinstance(current, NamedByData):
        kind = type(current)
        if kind not in _NAMED:
            _NAMED[kind] = type(f"NamedByData{kind.__name__}", (NamedByData, kind), {"__module__": __name__})
        named = object.__new__(_NAMED[kind])  # the same state (pytree signature), written with generated names
        named.__dict__.update(current.__dict__)
        graph.set_codegen(named)
    return graph
