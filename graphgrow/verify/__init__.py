"""verify: a change proven — eval/train preservation and trainability (preserve), the check after every pass
(verify), torch against onnxruntime (equivalence). The tolerance and the comparison are core.protocol's.

May import: core, graph, io, analysis, capture.
"""
