"""One model of a sweep, every pass, in one process (tools/sweep.py starts it): the real CLI
(`graphgrow mutate MODEL --pass P --check --onnx OUT.onnx`) run in this process once per pass, so torch, the
registry and the model's code are imported once per model instead of once per run, and the model is opened (built,
captured, its capture checked) once: the passes after the first grow the same opened model, as tests/test_zoo.py
does (a pass never modifies its input; the worker checks that, see `_fingerprint`). Each pass has its own limit
in CPU seconds of this process (SIGPROF: on shared cores a wall-clock limit measures the neighbours' load, not the
run); one JSON line per pass goes to stdout as soon as it ends: {"pass", "rc", "timed_out", "stdout", "stderr",
"seconds", "cpu_seconds"}. A pass that ran out of time stops the process: the limit may have interrupted anything,
an import half done included, so the passes after it would inherit a broken state (tools/sweep.py starts a fresh
process for them). The exporters the check imports lazily are imported before the first limit starts.

    python tools/sweep_worker.py --passes grow_width,deepen --timeout 120 -- hf:gpt2/causal-lm --input-shape 1,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time


class _Timeout(BaseException):  # not an Exception: fewer handlers catch it (the user-code guard does)
    pass


_fired = [False]


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _alarm(*_) -> None:
    _fired[0] = True  # whatever catches the exception (a guard that reports it as the model's failure), it timed out
    raise _Timeout()


def run_pass(main, runner, model: str, extra: list[str], pass_name: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        argv = [
            "mutate",
            model,
            "--pass",
            pass_name,
            "--check",
            "--onnx",
            f"{tmp}/out.onnx",
            "-o",
            f"{tmp}/out.pt",
            *extra,
        ]
        start, cpu = time.monotonic(), _cpu_seconds()
        _fired[0] = False
        signal.setitimer(signal.ITIMER_PROF, timeout, 1.0)  # and again every CPU second: a handler may swallow one
        timed_out = False
        try:
            result = runner.invoke(main, argv, catch_exceptions=True)
        except _Timeout:
            result, timed_out = None, True
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        seconds, cpu_seconds = round(time.monotonic() - start, 1), round(_cpu_seconds() - cpu, 1)
    timed_out = timed_out or _fired[0]
    if timed_out or result is None:
        return {
            "pass": pass_name,
            "rc": None,
            "timed_out": True,
            "stdout": "",
            "stderr": "",
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
        }
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):  # a crash the CLI let through
        stderr += f"\n{type(result.exception).__name__}: {result.exception}"
    return {
        "pass": pass_name,
        "rc": result.exit_code,
        "timed_out": False,
        "stdout": result.stdout[-20000:],
        "stderr": stderr[-20000:],
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def _fingerprint(opened) -> float:
    """A sum over the parameters and buffers of the opened model (its graph and the module it was captured from),
    weighted by position: a pass that changed any of them in place (a bug: passes leave their input alone)
    changes it."""
    import torch

    total = 0.0
    tensors = [*opened.gm.state_dict().values(), *opened.loaded.module.state_dict().values()]
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if t.is_floating_point() or t.is_complex():
                total += (i + 1) * float(t.double().abs().sum()) if not t.is_complex() else float(t.abs().sum())
            elif t.dtype != torch.bool:
                total += (i + 1) * float(t.double().sum())
    return total


class _OpenOnce:
    """workflow._open remembered per argument set, failures included (the same refusal for every pass)."""

    def __init__(self, open_fn) -> None:
        self.open_fn, self.cache, self.prints = open_fn, {}, {}

    def __call__(self, source, load, progress, max_memory, **extra):
        key = (source, repr(load), max_memory, repr(sorted(extra.items())))
        if key not in self.cache:
            try:
                opened = self.open_fn(source, load, progress, max_memory, **extra)
            except Exception as e:
                self.cache[key] = (None, e, None)
                raise
            self.cache[key] = (opened, None, _fingerprint(opened))
        opened, error, _ = self.cache[key]
        if error is not None:
            raise error
        return opened

    def changed(self) -> bool:
        """Whether a pass changed an opened model; such an entry is dropped (the next pass opens afresh)."""
        bad = [k for k, (o, _, fp) in self.cache.items() if o is not None and _fingerprint(o) != fp]
        for k in bad:
            del self.cache[k]
        return bool(bad)


def _preload() -> None:
    """What the check imports on first use (the ONNX exporter and runtime): imported here, outside any limit."""
    import importlib

    for name in ("onnx", "onnxscript", "onnxruntime", "torch.onnx"):
        with contextlib.suppress(Exception):  # one missing is the check's to report, in its own words
            importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", required=True)
    ap.add_argument("--timeout", type=float, required=True, help="CPU seconds per pass")
    ap.add_argument("model", nargs=argparse.REMAINDER, help="-- MODEL [extra CLI arguments]")
    a = ap.parse_args(argv)
    rest = a.model[1:] if a.model[:1] == ["--"] else a.model
    if not rest:
        ap.error("give the model after --")
    from click.testing import CliRunner

    from graphgrow.cli.commands import main as cli
    from graphgrow.jobs import workflow

    _preload()
    opener = _OpenOnce(workflow._open)
    workflow._open = opener
    signal.signal(signal.SIGPROF, _alarm)
    runner = CliRunner()
    for p in [p for p in a.passes.split(",") if p]:
        record = run_pass(cli, runner, rest[0], rest[1:], p, a.timeout)
        if not record["timed_out"] and opener.changed():  # the pass modified its input: a bug, made visible
            record["rc"] = 3
            record["stderr"] += "\ninternal error: the pass changed the model it was given (its input) in place"
        print(json.dumps(record), flush=True)
        if record["timed_out"]:
            return 0  # the passes left get a fresh process (see the module's docstring)
    return 0


if __name__ == "__main__":
    sys.exit(main())
