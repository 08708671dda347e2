"""One model of a sweep, every pass, in one process (tools/sweep.py starts it): the real CLI
(`graphgrow mutate MODEL --pass P --check --onnx OUT.onnx`) run in this process once per pass, so torch, the
registry and the model's code are imported once per model instead of once per run. Each pass has its own time
limit (SIGALRM); one JSON line per pass goes to stdout as soon as it ends:
{"pass", "rc", "timed_out", "stdout", "stderr", "seconds"}.

    python tools/sweep_worker.py --passes grow_width,deepen --timeout 120 -- hf:gpt2/causal-lm --input-shape 1,8
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time


class _Timeout(BaseException):  # not an Exception: fewer handlers catch it (the user-code guard does)
    pass


_fired = [False]


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
        start = time.monotonic()
        _fired[0] = False
        signal.setitimer(signal.ITIMER_REAL, timeout, 1.0)  # and again every second: a handler may swallow one
        timed_out = False
        try:
            result = runner.invoke(main, argv, catch_exceptions=True)
        except _Timeout:
            result, timed_out = None, True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = round(time.monotonic() - start, 1)
    timed_out = timed_out or _fired[0]
    if timed_out or result is None:
        return {"pass": pass_name, "rc": None, "timed_out": True, "stdout": "", "stderr": "", "seconds": seconds}
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
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", required=True)
    ap.add_argument("--timeout", type=float, required=True, help="seconds per pass")
    ap.add_argument("model", nargs=argparse.REMAINDER, help="-- MODEL [extra CLI arguments]")
    a = ap.parse_args(argv)
    rest = a.model[1:] if a.model[:1] == ["--"] else a.model
    if not rest:
        ap.error("give the model after --")
    from click.testing import CliRunner

    from graphgrow.cli.commands import main as cli

    signal.signal(signal.SIGALRM, _alarm)
    runner = CliRunner()
    for p in [p for p in a.passes.split(",") if p]:
        print(json.dumps(run_pass(cli, runner, rest[0], rest[1:], p, a.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
