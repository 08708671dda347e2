"""Where `make test`'s time goes: per-file totals and the slowest tests, from the JUnit XML `make test` writes.

    python tools/test_times.py [out/test-times.xml] [--top 30] [--write-order tests/file_times.json]

Times are each test's own wall time on its worker (set-up included); with `-n 2` the suite's wall time is about
half their sum, since CI's two cores are both busy throughout. `--write-order` keeps the per-file totals where
tests/conftest.py reads them to hand the longest files out first (the two workers then finish together).
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read_times(path: Path) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) for every test case in a JUnit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
        cases.append((file, case.get("name", "?"), float(case.get("time", 0.0))))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="?", default="out/test-times.xml", type=Path)
    parser.add_argument("--top", type=int, default=30, help="how many files and tests to list")
    parser.add_argument("--write-order", type=Path, help="write the per-file seconds (JSON) for the test order")
    args = parser.parse_args()
    if not args.xml.is_file():
        raise SystemExit(f"{args.xml}: no such file (run `make test` first: it writes the test times there)")
    cases = read_times(args.xml)
    per_file: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for file, _, seconds in cases:
        per_file[file] += seconds
        count[file] += 1
    total = sum(per_file.values())
    if args.write_order:
        ordered = dict(sorted(((f, round(t, 1)) for f, t in per_file.items()), key=lambda kv: -kv[1]))
        args.write_order.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{len(cases)} tests, {total:.0f} s in all (about {total / 2 / 60:.1f} min of wall time on 2 workers)\n")
    print(f"{'seconds':>8} {'share':>6} {'tests':>6}  file")
    for file, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count[file]:6d}  {file}")
    print(f"\n{'seconds':>8}  test")
    for file, name, seconds in sorted(cases, key=lambda c: -c[2])[: args.top]:
        print(f"{seconds:8.1f}  {file}::{name}")


if __name__ == "__main__":
    main()
