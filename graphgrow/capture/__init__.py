"""capture: nn.Module → GraphModule — tracing with leaves and mode-dependent code (trace), the trace checked
against the model with core.protocol's comparison (fidelity, which leaves graph.reference's outputs for the
first check), the example input shape (input_shape).

May import: core, graph, io, analysis.
"""
