"""The documentation's moving parts: generated regions and code blocks (README.md and docs/*.md).

    python tools/docs.py           rewrite every generated region from the code (`make docs`)
    python tools/docs.py --check   exit 1 when a region is stale
    python tools/docs.py --list    every code block, where it is and how tests/test_docs.py checks it

A generated region sits between `<!-- generated: NAME -->` and `<!-- /generated -->`; NAME is a key of
GENERATORS. A code block is checked according to a `<!-- docs-test: KIND -->` comment on the line before
its fence, or by its language when there is none: `sh` and `python` blocks run (KIND `run`); KIND
`make` checks `make` lines against the Makefile; `in FILE` says the block is an excerpt of FILE;
`layout` checks the module map against the tree; `install` checks that its `pip install` lines name
extras pyproject.toml declares and that the other commands are graphgrow's. A block with no known check fails the tests.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)
FENCE = re.compile(r"^(?P<fence>```+)(?P<lang>[\w-]*)\s*$")
MARK = re.compile(r"^<!-- docs-test: (?P<kind>.+?) -->$")
KINDS_BY_LANGUAGE = {"sh": "run", "python": "run"}


def _passes_table() -> str:
    from graphgrow.cli.show import passes_markdown
    from graphgrow.jobs.registry import all_passes

    built_in = {n: c for n, c in all_passes().items() if getattr(c, "__module__", "").startswith("graphgrow.passes")}
    return passes_markdown(built_in)


def _cli_reference() -> str:
    from graphgrow.cli.commands import cli_reference

    return cli_reference()


GENERATORS = {"passes-table": _passes_table, "cli-reference": _cli_reference}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def regenerate(text: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"unknown generated region {name!r} (known: {', '.join(GENERATORS)})")
        return m.group(1) + GENERATORS[name]().strip() + "\n" + m.group(4)

    return REGION.sub(fill, text)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str  # run, make, in FILE, layout, generated; "" when nothing says how it is checked
    section: str  # the heading above it (its GitHub anchor)
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append(anchor(line.lstrip("#")))
    return out


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, section, generated = [], "", False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- generated: "):
            generated = True
        elif line == "<!-- /generated -->":
            generated = False
        elif line.startswith("#"):
            section = anchor(line.lstrip("#"))
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group("fence")), None)
        if end is None:
            raise ValueError(f"{path.name}:{i + 1}: a code block that never closes")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        kind = "generated" if generated else mark.group("kind") if mark else KINDS_BY_LANGUAGE.get(m.group("lang"), "")
        found.append(Block(path, i + 1, m.group("lang"), kind, section, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return found


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for path in doc_files():
            for b in blocks(path):
                print(f"{b.where:28} {b.lang or '-':8} {b.kind or 'UNCHECKED':24} #{b.section}")
        return 0
    stale = []
    for path in doc_files():
        text = path.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if "--check" not in argv:
                path.write_text(new)
    if stale:
        print(("stale (run `make docs`): " if "--check" in argv else "regenerated: ") + ", ".join(map(str, stale)))
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
