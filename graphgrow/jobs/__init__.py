"""jobs: what a user runs — passes found through entry points (registry), specs run in order with
verification (pipeline), the CLI's jobs as functions returning plain data (workflow), what a command was
asked as options objects passed cli → jobs → search (options), the picture of a change (diagram), an
optimiser carried across a growth event (optim); growth inside data-parallel training jobs (distributed: the
public face; ddp, replicas, checkpoint, and lightning_callback, which alone imports Lightning).

May import: core, graph, io, analysis, capture, verify, rewrite.
"""
