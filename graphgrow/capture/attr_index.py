"""fx's Tracer.getattr with the root's parameters and buffers indexed once per trace.

To name a parameter or buffer that forward reads, fx walks every named parameter (then buffer) of
the root at every read: O(parameters) each, about half of tracing timm's efficientnet_b0, which
graphgrow traces hundreds of times over while it merges the paths of mode-branching blocks
(mode_merge). The index finds the same name fx's walk finds first; a tensor it does not hold goes
to fx's own walk, as before.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import fx, nn
from torch.fx.proxy import ParameterProxy


class IndexedGetattr(fx.Tracer):
    """Mix in before fx.Tracer."""

    _attr_index: dict[str, dict[int, tuple[str, torch.Tensor]]] | None = None
    _factory_kwarg: bool | None = None

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self._attr_index = None  # a new root, or the same one with other tensors
        return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if self._attr_index is None:
            self._attr_index = {
                "parameters": {id(p): (n, p) for n, p in self.root.named_parameters()},
                "buffers": {id(b): (n, b) for n, b in self.root.named_buffers()},
            }
        kinds = (["parameters"] if isinstance(attr_val, nn.Parameter) else []) + (
            ["buffers"] if self.proxy_buffer_attributes else []
        )
        for kind in kinds:
            hit = self._attr_index[kind].get(id(attr_val))
            if hit is not None and hit[1] is attr_val:
                return self._proxy_for(hit[0], attr_val, parameter_proxy_cache)
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _proxy_for(self, name: str, attr_val: torch.Tensor, cache: dict[str, Any]) -> Any:
        """What fx's walk returns on a match: one get_attr proxy per name, kept in the cache."""
        if name not in cache:
            if self._factory_kwarg is None:
                self._factory_kwarg = "proxy_factory_fn" in inspect.signature(self.create_proxy).parameters
            kwargs: dict[str, Any] = {}
            if self._factory_kwarg:
                kwargs["proxy_factory_fn"] = (
                    None if not self.param_shapes_constant else lambda node: ParameterProxy(self, node, name, attr_val)
                )
            cache[name] = self.create_proxy("get_attr", name, (), {}, **kwargs)
        return cache[name]
