"""rewrite: the pass layer — the pass contract (pass_base: Pass, arg, PassResult; verify after each), growth
over coupling's groups (widen), function-preserving initialisers (initializers). May import:
core, graph, io, analysis, capture, verify.

This package is the pass author's API: everything a pass (built-in or plugin) needs to rewrite a graph, in one place.

A pass is a frozen dataclass (graphgrow.Pass) whose `function` takes the traced model, its fields
as keyword arguments and a generator, and returns a `Rewrite`. Built-in passes import only from
`graphgrow` and this module (a test keeps it so); see examples/plugin_pass for a complete one.

Editing the graph (fx_edit):
    begin, factory_kwargs, copy_graph_module, find_node, resolve_tensor, nodes_in_module,
    module_boundary, tensor_shape, is_float_tensor, computed_from, unique_attr, add_module, add_parameter,
    inserting_after, replace_uses, set_scope, finish, new_parameters, Rewrite,
    inline_containers (graph.inline: the calls of containers a pass inserted become their layers' calls),
    dead_places (verify.dead_ends: tensors no gradient reaches, where a new zero-gated contribution would be dead)
Where to grow (stages, targets, deployed): main_path, stages, Stage, stage_end, stage_end_candidates, default_point,
    place, graphgrow_modules, is_graphgrow_node, tensor_or_feature_end, DEFAULT_BUDGET, pick_within_budget, keep_heard,
    deployed_nodes (what the deployed function computes: no train-only auxiliary head), train_only_note
Channels (coupling: analysis; widen: planning and applying):
    analyze, Coupling, channel_axis, plan_growth, make_layout, Insertion, Layout, grow_group,
    resize, columns, rows, set_module, identity_adapter, Init,
    conv_dims (a tensor's spatial dims when its channels are at dim 1: a Conv1d's (N, C, L) is 1),
    conv2d_facts, ConvFacts (in/out channels, groups, kernel of a Conv2d module or of a conv2d call on a layer's own
    or standardised weight: timm's StdConv2d)
Residual streams (analysis.stream: what carries a transformer's hidden size; rewrite.stream: growing it exactly):
    find_stream, Stream, grow_stream
Attention heads (analysis.heads: every attention, its projections and head-size constants; rewrite.heads):
    find_attentions, Attention, grow_attentions; eager_cores (attention written as softmax(q @ kᵀ) @ v, or why not)
Merged blocks (a mode switch: per-path work of a block that branches on self.training):
    eval_passthrough (the input a switch hands back unchanged in eval mode, or None)
New weights (initializers): kaiming_, zero_last_bn; from data (gradmax): gradmax_init, group_layouts, adapter_layouts,
    load_data, aim_units (rows read by zero columns), aim_gates / GatedBlock / check_aimable
    (a block behind a zero gate)
The pass's declarations (arguments, contract): pass_function (a plain function whose argument defaults and allowed
    values the Pass declares, with arg()), Requirement (a precondition: Pass.requires), Guarantee (a postcondition:
    Pass.ensures), ADDS_PARAMETERS, REMOVES_PARAMETERS
The op vocabulary (graph.ops: which ops only read a shape, which are views, elementwise, reductions): ops
Layers and sizes: AverageMerge, param_count, input_spec_of (the example input a model was traced with: its input spec
    when it has one, else its float input shape), input_shape_of (the float input shape only),
    example_input (seeded inputs for that shape or spec: a probe of the model's behaviour)
"""

from __future__ import annotations

from ..analysis.axes import conv_dims
from ..analysis.coupling import Coupling, analyze, channel_axis
from ..analysis.coupling_layers import ConvFacts, conv2d_facts
from ..analysis.deployed import deployed_nodes, train_only_note
from ..analysis.eager_attention import eager_cores
from ..analysis.heads import Attention, find_attentions
from ..analysis.hearing import keep_heard
from ..analysis.opaque import eval_passthrough
from ..analysis.stages import (
    DEFAULT_BUDGET,
    Stage,
    default_point,
    graphgrow_modules,
    is_graphgrow_node,
    main_path,
    pick_within_budget,
    place,
    stage_end,
    stage_end_candidates,
    stages,
)
from ..analysis.stream import Stream, find_stream
from ..analysis.targets import tensor_or_feature_end
from ..graph import ops
from ..graph.fx_edit import (
    Rewrite,
    add_module,
    add_parameter,
    begin,
    computed_from,
    copy_graph_module,
    factory_kwargs,
    find_node,
    finish,
    inserting_after,
    is_float_tensor,
    module_boundary,
    new_parameters,
    nodes_in_module,
    replace_uses,
    resolve_tensor,
    set_scope,
    tensor_shape,
    unique_attr,
)
from ..graph.graph_meta import input_shape_of, input_spec_of
from ..graph.inline import inline_containers
from ..graph.layers import AverageMerge
from ..graph.shapes import example_input, param_count
from ..verify.dead_ends import dead_places
from .arguments import pass_function
from .contract import ADDS_PARAMETERS, REMOVES_PARAMETERS, Guarantee, Requirement
from .gradmax import adapter_layouts, group_layouts, load_data
from .gradmax_gate import GatedBlock, aim_gates, check_aimable
from .gradmax_units import aim_units, gradmax_init
from .heads import grow_attentions
from .initializers import kaiming_, zero_last_bn
from .stream import grow_stream
from .widen import (
    Init,
    Insertion,
    Layout,
    columns,
    grow_group,
    identity_adapter,
    make_layout,
    plan_growth,
    resize,
    rows,
    set_module,
)

__all__ = [
    "begin",
    "factory_kwargs",
    "copy_graph_module",
    "find_node",
    "resolve_tensor",
    "nodes_in_module",
    "module_boundary",
    "tensor_shape",
    "computed_from",
    "is_float_tensor",
    "unique_attr",
    "add_module",
    "add_parameter",
    "inserting_after",
    "replace_uses",
    "set_scope",
    "finish",
    "new_parameters",
    "Rewrite",
    "eval_passthrough",
    "inline_containers",
    "dead_places",
    "main_path",
    "stages",
    "Stage",
    "stage_end",
    "stage_end_candidates",
    "default_point",
    "place",
    "graphgrow_modules",
    "is_graphgrow_node",
    "tensor_or_feature_end",
    "DEFAULT_BUDGET",
    "pick_within_budget",
    "keep_heard",
    "deployed_nodes",
    "train_only_note",
    "analyze",
    "Coupling",
    "channel_axis",
    "conv_dims",
    "conv2d_facts",
    "ConvFacts",
    "plan_growth",
    "make_layout",
    "Insertion",
    "Layout",
    "grow_group",
    "resize",
    "columns",
    "rows",
    "set_module",
    "identity_adapter",
    "Init",
    "kaiming_",
    "zero_last_bn",
    "gradmax_init",
    "group_layouts",
    "adapter_layouts",
    "load_data",
    "aim_units",
    "aim_gates",
    "check_aimable",
    "GatedBlock",
    "AverageMerge",
    "param_count",
    "input_shape_of",
    "input_spec_of",
    "example_input",
    "ops",
    "find_stream",
    "Stream",
    "grow_stream",
    "find_attentions",
    "eager_cores",
    "Attention",
    "grow_attentions",
    "pass_function",
    "Requirement",
    "Guarantee",
    "ADDS_PARAMETERS",
    "REMOVES_PARAMETERS",
]
