"""graph: the traced model as data — graphgrow's metadata on a GraphModule (graph_meta), reading and editing
nodes (fx_edit), shapes, parameters and FLOPs (shapes), the layers graphgrow itself inserts (layers), outputs a
model already gave on the check input, kept between checks (reference).

May import: core.
"""
