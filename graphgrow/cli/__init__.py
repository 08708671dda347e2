"""cli: the `graphgrow` command — options and commands (commands), the flags they share (flags), printing
reports (show), running one command with its exit code, signals and staged outputs (run). `main` is the console script
(pyproject: graphgrow = "graphgrow.cli:main"); `python -m graphgrow.cli` runs it too.

Exit codes: 0 success; 1 a check failed (verification, export, equivalence); 2 bad input or a pass that
cannot apply; 3 an internal error (a bug: please report). Errors are one line on stderr; --debug shows the
traceback.

The top layer. May import: core, graph, io, analysis, capture, verify, rewrite, jobs, search.
Nothing in graphgrow imports it.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
