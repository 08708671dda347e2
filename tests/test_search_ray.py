"""graphgrow search on Ray Tune, started here on 2 CPUs: a population of 4 for a few rounds.

One in-process search checks the promises (no errored trial, the mutation log matches the
reported growth count, the metric just before and just after each growth is equal, the best
model replays and exports); a CLI search interrupted with Ctrl-C resumes from its checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import graphgrow as gg

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(ROOT / "examples"))
import digits_task as task  # noqa: E402

from graphgrow.graph.graph_meta import input_shape_of  # noqa: E402
from graphgrow.jobs.pipeline import from_log  # noqa: E402
from graphgrow.search import MutationSpace, SearchOptions, search  # noqa: E402
from graphgrow.search.trial import MODEL_FILE, STATE_FILE  # noqa: E402

GROWTH = "deepen;add_residual;grow_width(factor=2)"  # no no-op: every exploit grows unless the budget says no


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


def _final_checkpoint(trial_dir: Path) -> Path:
    return max(trial_dir.glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))


def test_population_grows_exactly_and_the_best_model_replays(tmp_path, local_ray):
    gm = gg.trace(task.model(), input_shape=task.INPUT_SHAPE)
    options = SearchOptions(population=4, rounds=4, epochs_per_round=1, storage_path=str(tmp_path), name="s", seed=1)
    lines: list[str] = []
    result = search(
        gm, task.train_epoch, task.evaluate, MutationSpace.parse(GROWTH, max_params=50_000), options, say=lines.append
    )
    assert [ln for ln in lines if ln.startswith("round ")][-1].startswith("round 4/4")
    assert len(result.trials) == 4 and all(t["val_loss"] is not None for t in result.trials)
    growths = 0
    for trial in result.trials:
        rows = result.history[trial["trial"]]
        assert rows[-1]["epoch"] == 4  # every trial ran to the end (none errored: search would have raised)
        folder = _final_checkpoint(Path(trial["path"]))
        state = json.loads((folder / STATE_FILE).read_text())
        grown = gg.load_model(folder / MODEL_FILE).module
        log = grown.meta["graphgrow"]["log"]
        assert len(log) == rows[-1]["growths"]  # the mutation log is the reported growth count
        assert [e["search_move"] for e in log] == [m["id"] for m in state["moves"] if m["grew"]]
        for move in state["moves"]:
            if move["grew"]:  # the metric just before and just after each growth is the same
                assert move["metric_after"] == pytest.approx(move["metric_before"], rel=1e-5, abs=1e-6), move
        growths += sum("grow:" in str(r.get("event")) for r in rows)
        events = [str(r.get("event") or "") for r in rows]
        assert not any(a and a == b for a, b in zip(events, events[1:])), events  # each event reported once
    assert growths >= 1, "no trial grew: PBT never exploited"
    assert all(r["growth_delta"] <= 1e-5 for rows in result.history.values() for r in rows)
    # the best model: a graphgrow file whose lineage replays on the original and that exports to ONNX
    best = gg.load_model(result.best_path).module
    assert best.meta["graphgrow"]["log"] == result.lineage
    original = gg.load_model(result.original_path).module
    if result.lineage:
        replayed = from_log(result.lineage).run(original).gm
        assert {k: v.shape for k, v in replayed.state_dict().items()} == {
            k: v.shape for k, v in best.state_dict().items()
        }
    x = torch.randn(3, 1, 8, 8)
    proto = gg.export_onnx(best, [1, 1, 8, 8], tmp_path / "best.onnx")
    assert (tmp_path / "best.onnx").stat().st_size > 0 and len(proto.graph.node) > 0
    with torch.no_grad():
        assert best.eval()(x).shape == (3, 10)


def test_an_interrupted_search_resumes_from_its_checkpoints(tmp_path, local_ray):
    cmd = [
        sys.executable,
        "-m",
        "graphgrow.cli",
        "search",
        "examples.digits_task:model",
        "--train",
        "examples.digits_task:train_epoch",
        "--eval",
        "examples.digits_task:evaluate",
        "--mutations",
        GROWTH + ";noop",
        "--population",
        "4",
        "--rounds",
        "5",
        "--num-cpus",
        "2",
        "--storage-path",
        str(tmp_path),
        "--name",
        "r",
        "--input-shape",
        "1,1,8,8",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 240
    assert proc.stderr is not None
    midway = re.compile(r"round [234]/5")  # asynchronous PBT: a trial that exploits a donor ahead of it can make
    for line in proc.stderr:  # the population's slowest point jump a round (1 → 3 was seen)
        seen.append(line)
        if midway.match(line) or time.monotonic() > deadline:
            break
    assert any(midway.match(ln) for ln in seen), "".join(seen)[-2000:]
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest[-2000:]
    assert "--resume --trust" in rest
    options = SearchOptions(
        population=4, rounds=5, epochs_per_round=1, storage_path=str(tmp_path), name="r", resume=True, trust=True
    )
    result = search(
        None, task.train_epoch, task.evaluate, MutationSpace.parse(GROWTH + ";noop"), options, say=lambda m: None
    )
    for trial, rows in result.history.items():
        epochs = [r["epoch"] for r in rows]
        assert epochs[-1] == 5, (trial, epochs)
        assert epochs.count(1) == 1, (trial, epochs)  # resumed from checkpoints: no trial started over
    assert input_shape_of(gg.load_model(result.best_path).module) == [1, 1, 8, 8]
