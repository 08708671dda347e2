"""verify: a change proven — outputs kept between checks (reference), eval/train preservation and
trainability (preserve), the check after every pass (verify), torch against onnxruntime (equivalence).

May import: core, graph, io, analysis.
"""
