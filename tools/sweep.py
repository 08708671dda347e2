"""Sweep a model registry: every model × every built-in pass at its default place, through the real CLI with the
full check (`graphgrow mutate MODEL --pass P --check --onnx OUT.onnx`: verification, save, ONNX, onnxruntime), one
process per model (tools/sweep_worker.py runs the CLI in it once per pass, the model opened once) with a time
limit per run; results
appended to a JSONL state file (a rerun skips the runs it holds), then a generated table written to docs/sweep.md
(tools/sweep_report.py). `make sweep` runs it.

    python tools/sweep.py --registry torchvision --passes grow_width,add_residual --limit 20 --timeout 120
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_models import PASSES, REGISTRIES, Model  # noqa: E402
from sweep_report import broken_kind, part_of, reason_class, render, status_of  # noqa: E402
from sweep_targets import facts_for, targets  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STARTUP = 60.0  # CPU seconds a model's process may take to import torch, the registry and the model's code
# the wall-clock backstop of a worker, as a multiple of its CPU budget: the per-pass limits count CPU seconds
# (tools/sweep_worker.py), a niced process on shared cores gets a fraction of one
WALL_FACTOR = 5.0
LIVE: set[subprocess.Popen] = set()  # the workers running now (with --jobs, in other threads): killed on a stop


def run_model(model: Model, passes: list[str], timeout: float, cwd: Path, threads: int = 0) -> list[dict]:
    """Every pass of one model (tools/sweep_worker.py: the CLI in-process, each pass under its own limit of CPU
    seconds), niced, in its own process group, with `threads` intra-op threads (0: torch's default). A worker stops
    after a pass that ran out of time; the passes left get a fresh one. The records, one per pass: exit, status,
    class, the one-line message."""
    reported: dict[str, dict] = {}
    while True:
        todo = [p for p in passes if p not in reported]
        if not todo:
            break
        got, killed, rc, err, deadline = _run_worker(model, todo, timeout, cwd, threads)
        reported.update(got)
        if killed or not got or not list(got.values())[-1]["timed_out"]:
            break  # a worker that did not stop for a time limit has reported every pass it could
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    records = []
    for p in passes:
        r = reported.get(p)
        crash = ""
        if r is None:  # the process stopped before this pass ended: the wall-clock backstop, or a crash
            crash = "timeout" if killed else f"crash (exit {rc})"
            why = (
                f"no result after {deadline:g} s (wall clock) for the model's process"
                if killed
                else f"the model's process ended (exit {rc}): {_message(err)}"
            )
            r = {"rc": None, "timed_out": killed, "stdout": "", "stderr": why, "seconds": 0.0}
        timed_out = bool(r["timed_out"])
        rc_p = None if timed_out else r["rc"]
        status = status_of(rc_p, timed_out) if not crash else "broken"
        message = (
            _message(r["stderr"], r["stdout"])
            if not timed_out or r["stderr"]
            else f"no result after {timeout:g} CPU seconds"
        )
        cls = (
            crash
            or (reason_class(message) if status == "refused" else "")
            or (broken_kind(rc_p, timed_out) if status == "broken" else "")
        )
        records.append(
            {
                "registry": model.registry,
                "model": model.key,
                "pass": p,
                "name": model.name,
                "args": list(model.args),
                "rc": rc_p,
                "status": status,
                "class": cls,
                "message": message if status != "verified" else "",
                "part": part_of(r["stdout"]) if status == "verified" else "",
                "seconds": r["seconds"],
                "cpu_seconds": r.get("cpu_seconds"),
                "when": when,
            }
        )
    return records


def _run_worker(
    model: Model, passes: list[str], timeout: float, cwd: Path, threads: int = 0
) -> tuple[dict[str, dict], bool, int | None, str, float]:
    """One worker process for these passes: (its records by pass, killed at the wall-clock backstop, its exit code,
    its stderr, the backstop in seconds)."""
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        str(ROOT / "tools" / "sweep_worker.py"),
        "--passes",
        ",".join(passes),
        "--timeout",
        str(timeout),
        "--",
        model.name,
        *model.args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if threads:  # parallel workers: one core each, not every worker spinning on all of them
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    deadline = (timeout * len(passes) + STARTUP) * WALL_FACTOR
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    LIVE.add(proc)
    killed = False
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        killed = True
        os.killpg(proc.pid, signal.SIGKILL)  # the group this model started: the worker and its children
        out, err = proc.communicate()
    except BaseException:  # the sweep itself stopped (Ctrl-C, SIGTERM): leave no run behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        LIVE.discard(proc)
    reported = {}
    for line in out.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and r.get("pass") in passes:
            reported[r["pass"]] = r
    return reported, killed, proc.returncode, err, deadline


def _message(stderr: str, stdout: str = "") -> str:
    """The CLI's one-line error (`error: …`), else the checks its report marks FAIL (exit 1 says it there), else the
    last line it wrote (a crash's exception)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    failed = [ln.strip() for ln in stdout.splitlines() if "FAIL" in ln]
    if failed and not any(ln.lower().startswith("error") for ln in lines):
        return "; ".join(failed)
    errors = [ln for ln in lines if ln.lower().startswith("error")]
    text = errors[-1] if errors else (lines[-1] if lines else "(nothing on stderr)")
    return text[len("error:") :].strip() if text.lower().startswith("error:") else text


def load_state(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when a sweep was killed mid-write
            continue
    return records


def header(results: list[dict], registries: list[str]) -> str:
    when = max((r["when"] for r in results), default="-")[:10]
    return "\n".join(
        [
            "# Sweep: every model of a registry × every built-in pass",
            "",
            "<!-- generated by tools/sweep.py (make sweep) from its state file; do not edit by hand -->",
            "",
            f"Each run is `graphgrow mutate MODEL --pass P --check --onnx OUT.onnx` in its own process "
            f"(random weights, small inputs and configs, the pass at its default place): **verified** "
            f"(exit 0: verified in eval and train mode, saved, exported and checked on onnxruntime), "
            f"**refused** (exit 2, with the one-line reason and its class) "
            f"or **broken** (exit 1 — a check failed —, exit 3, a crash or the time limit). "
            f"Registries: {', '.join(registries)}; last run {when} on {platform.machine()} {platform.system()} "
            f"({os.cpu_count()} CPUs, shared). See [tools/sweep.py](../tools/sweep.py) for the models and settings.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--registry", default="torchvision", help="torchvision, timm, hf or smoke; comma-separated for several"
    )
    ap.add_argument(
        "--only", default="", help="model keys to run (comma-separated; 'resnet*' for every key starting so)"
    )
    ap.add_argument("--passes", default=",".join(PASSES), help="passes to run (comma-separated)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many models per registry (0: all)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="CPU seconds per run (one pass of one model) before it counts as broken",
    )
    ap.add_argument("--state", default="tools/sweep_state.jsonl", help="JSONL results; runs it holds are skipped")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="models run at once, each worker with one thread when more than 1 (at most the CPU cores: the limits "
        "count CPU seconds, so parallel workers measure the same, but they share memory)",
    )
    ap.add_argument("--table", default="docs/sweep.md", help="markdown table to write (empty: none)")
    ap.add_argument("--header", default="", help="a file whose text replaces the generated header of the table")
    ap.add_argument(
        "--retry-timeouts", action="store_true", help="run again the runs that timed out (e.g. with a longer --timeout)"
    )
    ap.add_argument("--retry-broken", action="store_true", help="run again every broken run (after a fix)")
    ap.add_argument(
        "--again", action="store_true", help="run again the runs of the --only models even when the state holds them"
    )
    ap.add_argument("--table-only", action="store_true", help="write the table from the state file, run nothing")
    ap.add_argument("--cwd", default=str(ROOT), help="folder the runs start in (model factories are found there)")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit through run_one: its run is killed too
    if not 1 <= a.jobs <= (os.cpu_count() or 1):
        ap.error(f"--jobs: 1 to {os.cpu_count()} (this machine's cores)")
    registries = [r for r in a.registry.split(",") if r]
    unknown = [r for r in registries if r not in REGISTRIES]
    passes = [p for p in a.passes.split(",") if p]
    if unknown or any(p not in PASSES for p in passes):
        ap.error(f"registries are {', '.join(REGISTRIES)}; passes are {', '.join(PASSES)}")
    state = Path(a.state)
    latest = {
        (r["registry"], r["model"], r["pass"]): r for r in load_state(state)
    }  # a rerun's record replaces the old one
    results = list(latest.values())
    done = {
        k
        for k, r in latest.items()
        if not (a.retry_timeouts and r["class"] == "timeout")
        and not (a.retry_broken and r["status"] == "broken")
        and not (
            a.again
            and a.only
            and any(k[1] == o or (o.endswith("*") and k[1].startswith(o[:-1])) for o in a.only.split(","))
        )
    }
    only = [o for o in a.only.split(",") if o]
    if not a.table_only:
        state.parent.mkdir(parents=True, exist_ok=True)
        for registry in registries:
            models = [
                m
                for m in REGISTRIES[registry]()
                if not only or any(m.key == o or (o.endswith("*") and m.key.startswith(o[:-1])) for o in only)
            ]
            models = models[: a.limit] if a.limit else models
            work = [(m, todo) for m in models if (todo := [p for p in passes if (registry, m.key, p) not in done])]
            threads = 1 if a.jobs > 1 else 0
            with ThreadPoolExecutor(a.jobs) as pool:  # each thread waits on one model's worker process
                running = [pool.submit(run_model, m, todo, a.timeout, Path(a.cwd), threads) for m, todo in work]
                try:
                    for future in as_completed(running):
                        for rec in future.result():
                            with state.open("a") as f:  # a line per run, written at once: a killed sweep resumes
                                f.write(json.dumps(rec) + "\n")
                            key = (registry, rec["model"], rec["pass"])
                            results = [r for r in results if (r["registry"], r["model"], r["pass"]) != key] + [rec]
                            done.add(key)
                            print(
                                f"{registry:11} {rec['model']:40} {rec['pass']:15} {rec['status']:8} "
                                f"{rec['seconds']:6.1f}s {rec['class']} {rec['message'][:100]}",
                                flush=True,
                            )
                except BaseException:  # stopped (Ctrl-C, SIGTERM): nothing new starts, the running workers die
                    for job in running:
                        job.cancel()
                    for proc in list(LIVE):
                        os.killpg(proc.pid, signal.SIGKILL)
                    raise
    if a.table:
        # every run the state holds, whichever registries this call ran: one table per state file; refusals are
        # classified again from their messages, so the classes follow the current patterns
        results = [{**r, "class": reason_class(r["message"])} if r["status"] == "refused" else r for r in results]
        text = Path(a.header).read_text() if a.header else header(results, sorted({r["registry"] for r in results}))
        facts = facts_for(results)
        extra = {
            reg: targets([r for r in results if r["registry"] == reg], reg, facts)
            for reg in {r["registry"] for r in results}
        }
        Path(a.table).write_text(render(results, text, PASSES, extra))
        print(f"wrote {a.table}: {len(results)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
