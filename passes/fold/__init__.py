"""fold: a deployment transform. Growth's linear structure folds back into plain layers.

Eval-mode semantics: BatchNorm uses its running statistics, dropout and drop-path are
off, gates are constants. The result computes what the model computes in eval mode
(verified: eval-mode preservation here, onnxruntime equivalence with --check); it is
not meant to be trained further.

Rules, applied until nothing changes:
- graphgrow's merges expand into `main + Σ (gate_i/n)·branch_i`; a zero gate drops its
  branch; scalar gates become constants; a gate behind a ReLU moves into the layer
  before it (a negative gate turns the add into a subtract);
- identities (nn.Identity, dropout and drop-path in eval mode, relu of a non-negative
  tensor) are removed, and nn.Sequential containers are inlined;
- every chain and sum of linear maps of one tensor — conv, Linear, BatchNorm, scalar
  multiples, average pooling with count_include_pad, the identity — becomes one conv
  (or Linear) when that costs no more multiply-adds and no more weights than what it
  replaces (a k×k conv after a k×k conv never becomes a larger kernel, and a branch
  with a larger kernel enlarges the main conv only with grow_kernels=true): BatchNorm
  into its conv, parallel branches into the main conv (smaller kernels centre-padded),
  a 1×1 adapter into the conv before or after it, a mode=adapter widening back into a
  conv of the original width;
- a 1×1 conv before global average pooling moves into the classifier Linear.
What stays (non-linear branches, real depth or width) is listed with the reason.

The package, one job per module (every import is absolute, within graphgrow, graphgrow.rewrite and this package):
  driver     the fixed-point loop, the `fold` function and the `Fold` pass
  prepare    once, before the loop: eval-mode specialisation, merges and gates expanded
  rules/     the local rewrite rules, one family per module (identities, relus, terms, heads),
             registered in rules/__init__.py's RULES (and MOVES, for moves into the classifier)
  graph      the shared vocabulary: op tables (add, mul, ReLU), bypass, substitute
  form       Form, the linear map of one tensor as one conv or Linear; local: the form of one node
  algebra    compose, sum, re-associate forms; analysis: which chains and sums are worth one layer, and why not
  emit       one layer per maximal form; report: what stays, with the reason

Adding a rule = one function `rule(gm) -> int` (rewrites made; 0 when nothing applies) in a family
module under rules/, registered in RULES; the driver runs it every round until nothing changes:

    def drop_double_negation(gm: fx.GraphModule) -> int:  # in rules/terms.py: −(−x) → x
        count = 0
        for n in list(gm.graph.nodes):  # the test sees earlier rewrites: a bypassed node's users read its replacement
            if n.target is operator.neg and getattr(n.args[0], "target", None) is operator.neg:
                bypass(n, n.args[0].args[0])
                count += 1
        return count

    RULES = [remove_identities, ..., drop_double_negation]  # in rules/__init__.py: now it runs every round
"""

from __future__ import annotations

from graphgrow.passes.fold.driver import Fold, fold  # noqa: TID251 (the fold package's own module)

__all__ = ["Fold", "fold"]
