"""analysis: what a traced graph allows — channel coupling (coupling, probe), stages and default places
(stages, targets: where a pass can apply, as Candidates), size limits before a pass runs (budget).

May import: core, graph, io.
"""
