"""io: models in and out of the process — files read safely (load, serialize, graph_policy), model names
(factory, zoo), files written whole (save, outputs), lineage carried through files, ONNX (export: the only
torch.onnx user; onnx_spec: named inputs, dynamic sequence length, outputs named after their keys) and
onnxruntime (runtime: the only onnxruntime user).

May import: core, graph.
"""
