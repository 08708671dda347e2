"""as_native for MLPs upcycled into mixtures of experts: a LLaMA or Mistral model whose every layer's MLP became a
routed mixture (the graph's record `mixtures`: each MLP's router, top_k and every expert's layers, expert 0 first)
comes back as the family's mixture-of-experts class, Mixtral — the same attention, norms and embeddings, its
sparse block holding the router (`mlp.gate`) and the experts (`mlp.experts.gate_up_proj`, `down_proj`) — so
`generate`, `save_pretrained`/`from_pretrained` and the Trainer work on it, with Mixtral's auxiliary load-balancing
loss when training (`output_router_logits=True`: `aux_loss` in the output, added to the loss with
`router_aux_loss_coef`).

Mixtral computes what the graph does: softmax over the router's logits, the top_k of them, renormalised to sum to
one (the graph runs every expert, Mixtral only the chosen ones). What Mixtral cannot hold is refused by name: a
family other than LLaMA or Mistral, biases on the attention or the MLP, an activation other than SiLU, a layer left
dense, layers with different numbers of experts or top_k, an MLP whose layers are not gate/up/down, a model also
grown in size (its sizes come from the original's config here). The result is checked against the grown graph.
The record is read as untrusted (a loaded file): every path must name a layer of the grown model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import GraphgrowError, NotApplicable
from ..core.protocol import compare_outputs
from ..core.state import module_dtype
from ..graph.float32_run import HALF, float32_output
from ..graph.graph_meta import graph_info, input_spec_of
from ..graph.shapes import example_input

MIXTURES_KEY = "mixtures"  # written by the upcycle pass
_FAMILIES = {"llama", "mistral"}
_LAYERS = {"gate_proj", "up_proj", "down_proj"}
_KEEP = "keep the GraphModule (graphgrow's own file keeps the mixture in its dense form)"


def has_mixtures(grown: fx.GraphModule) -> bool:
    return bool(graph_info(grown).get(MIXTURES_KEY))


def moe_native(
    grown: fx.GraphModule, original: nn.Module, stored_dtype: torch.dtype | None, use_cache: bool | None
) -> nn.Module:
    """The upcycled graph as a MixtralForCausalLM (or MixtralModel), checked against the graph."""
    from transformers import MixtralConfig, MixtralForCausalLM, MixtralModel

    config = original.config
    family = getattr(config, "model_type", "?")
    if family not in _FAMILIES:
        raise NotApplicable(
            f"{type(original).__name__} ({family}) has no mixture-of-experts class graphgrow maps it to "
            f"(it maps {', '.join(sorted(_FAMILIES))} to Mixtral)",
            _KEEP,
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise NotApplicable(f"{type(original).__name__} has {flag}=True: Mixtral has no such biases", _KEEP)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotApplicable(f"the MLPs' activation is {config.hidden_act}: Mixtral's experts use SiLU", _KEEP)
    layers = int(config.num_hidden_layers)
    mixtures = _read(grown, layers)
    experts = {len(m["experts"]) for m in mixtures.values()}
    top_k = {m["top_k"] for m in mixtures.values()}
    if len(experts) != 1 or len(top_k) != 1:
        raise NotApplicable(
            f"the layers have {sorted(experts)} experts and top_k {sorted(top_k)}: Mixtral's config holds one of each",
            "upcycle every layer with the same experts= and top_k=",
        )
    fields = {k: v for k, v in config.to_dict().items() if k in MixtralConfig.__dataclass_fields__}
    fields.update(num_local_experts=experts.pop(), num_experts_per_tok=top_k.pop(), router_jitter_noise=0.0)
    if use_cache is not None:
        fields["use_cache"] = bool(use_cache)
    moe_config = MixtralConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    moe_config.dtype = torch.float32
    cls = MixtralForCausalLM if hasattr(original, "lm_head") else MixtralModel
    native = cls(copy.deepcopy(moe_config)).float()
    state = _state(grown, original, mixtures, layers)
    persistent = set(native.state_dict())
    missing, unexpected = native.load_state_dict({k: v for k, v in state.items() if k in persistent}, strict=False)
    if missing or set(state) - persistent:
        raise NotApplicable(
            f"Mixtral has parameters the upcycled model has not, or the reverse: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(set(state) - persistent)[:4]}",
            _KEEP,
        )
    if getattr(moe_config, "tie_word_embeddings", False) and hasattr(native, "tie_weights"):
        native.tie_weights()
    native.eval()
    _check(grown, native)
    if getattr(original, "generation_config", None) is not None:
        native.generation_config = copy.deepcopy(original.generation_config)
    if stored_dtype in (torch.bfloat16, torch.float16):
        native = native.to(stored_dtype)
    return native


def _read(grown: fx.GraphModule, layers: int) -> dict[str, dict[str, Any]]:
    """The record, checked: one mixture per layer (`model.layers.{i}.mlp`), each expert naming gate/up/down Linears
    of the grown model, the router a Linear without bias."""
    mixtures = graph_info(grown).get(MIXTURES_KEY)
    if not isinstance(mixtures, dict):
        raise NotApplicable("the grown model's record of mixtures of experts is malformed", _KEEP)
    want = {f"model.layers.{i}.mlp" for i in range(layers)}
    if set(mixtures) != want:
        dense = sorted(want - set(mixtures))
        raise NotApplicable(
            f"Mixtral has a mixture of experts in every layer; {', '.join(dense[:3]) or 'other MLPs'} "
            f"{'are' if len(dense) > 1 else 'is'} not upcycled",
            "upcycle every layer's MLP (upcycle without at=)",
        )
    for path, m in mixtures.items():
        ok = (
            isinstance(m, dict)
            and isinstance(m.get("top_k"), int)
            and isinstance(m.get("router"), str)
            and isinstance(m.get("experts"), list)
            and all(isinstance(e, dict) and set(e) == _LAYERS for e in m["experts"])
            and all(_linear(grown, p) for e in m["experts"] for p in e.values())
            and _linear(grown, m["router"], bias=False)
        )
        if not ok:
            raise NotApplicable(
                f"the mixture at {path} is not gate/up/down Linear experts behind a Linear router "
                "(or the record is malformed)",
                _KEEP,
            )
    return mixtures


def _linear(grown: fx.GraphModule, path: Any, bias: bool | None = None) -> bool:
    try:
        m = grown.get_submodule(path) if isinstance(path, str) else None
    except AttributeError:
        return False
    return isinstance(m, nn.Linear) and (bias is None or (m.bias is not None) == bias)


def _state(
    grown: fx.GraphModule, original: nn.Module, mixtures: dict[str, dict[str, Any]], layers: int
) -> dict[str, torch.Tensor]:
    """Mixtral's parameters: the dense model's own by their names (sizes as the original's), each layer's router and
    experts stacked as Mixtral stores them (gate_up_proj: E × 2F × C, gate rows first; down_proj: E × C × F)."""
    own = dict(original.named_parameters(remove_duplicate=False))
    grown_state = dict(grown.named_parameters(remove_duplicate=False))  # buffers (RoPE's) are Mixtral's own
    mixture_paths = {p for m in mixtures.values() for e in m["experts"] for p in e.values()}
    mixture_paths |= {str(m["router"]).rpartition(".")[0] for m in mixtures.values()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in grown_state.items():
        if any(name == p or name.startswith(p + ".") for p in mixture_paths):
            continue
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise NotApplicable(
                f"{name} is {tuple(tensor.shape)} in the upcycled model and {tuple(own[name].shape)} in the original: "
                "the model was also grown in size, which this conversion does not solve",
                "as_native the grown dense model first, then trace it again and upcycle",
            )
        state[name] = tensor
    for path, m in mixtures.items():
        weight = {role: [grown.get_submodule(e[role]).weight.detach() for e in m["experts"]] for role in _LAYERS}
        state[f"{path}.gate.weight"] = grown.get_submodule(m["router"]).weight.detach()
        state[f"{path}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u], dim=0) for g, u in zip(weight["gate_proj"], weight["up_proj"])]
        )
        state[f"{path}.experts.down_proj"] = torch.stack(weight["down_proj"])
    return {k: v.detach().clone() for k, v in state.items()}


def _check(grown: fx.GraphModule, native: nn.Module) -> None:
    """The Mixtral model against the grown graph in eval mode, on the recorded inputs at two batch sizes."""
    spec = input_spec_of(grown)
    for seed, batch in ((0, 1), (1, 2)):
        x = example_input(grown, spec, seed=seed, batch=batch)
        kwargs = x if isinstance(x, dict) else {"input_ids": x}
        was = grown.training
        grown.eval()
        try:
            with torch.no_grad():
                half = module_dtype(grown) in HALF  # grown in its half dtype: run in float32 (verify.low_precision)
                want = _main(float32_output(grown, x, "eval", 0) if half else grown(**kwargs))
                got = _main(native(**kwargs))
        finally:
            grown.train(was)
        try:
            check = compare_outputs(want, got, "eval")
        except GraphgrowError as e:
            raise NotApplicable(f"Mixtral gives another output shape than the grown graph ({e.message})", _KEEP) from e
        if not check.ok:
            raise NotApplicable(
                f"Mixtral does not compute what the upcycled graph does (relative error {check.rel_err:.3g} at "
                f"batch {batch})",
                _KEEP,
            )


def _main(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for k in ("logits", "last_hidden_state"):
        if k in out and out[k] is not None:
            return out[k]
    raise NotApplicable("the model's output has no logits or last_hidden_state to compare", _KEEP)
