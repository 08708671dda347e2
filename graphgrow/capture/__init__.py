"""capture: nn.Module → GraphModule — tracing with leaves and mode-dependent code (trace), the trace checked
against the model (fidelity, which uses verify's reference), the example input shape (input_shape).

May import: core, graph, io, analysis, verify.
"""
