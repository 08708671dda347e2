"""Growth inside a job sharded with FSDP2 (issue 43): torchrun with 2 processes, gloo on the CPU.

Every scenario runs in one launch of tests/fsdp_job.py (one process start for the file: about 30 s of CPU here);
each rank writes a JSON report and the assertions are here. The decoder is examples/grow_fsdp.py's (hidden 32, two
layers, vocabulary 96), sharded one unit per layer with gg.distributed.shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import graphgrow as gg

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build", allow_module_level=True)

pytestmark = pytest.mark.slow  # a torchrun job: make test runs it, make test-quick does not

HERE = Path(__file__).resolve().parent
JOB = HERE / "fsdp_job.py"
SPECS = ["grow_hidden(by=8)", "grow_width(factor=2)", "grow_heads(by=1)", "deepen(block=transformer)"]


def _launch(out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the FSDP job ran past 600 s:\n{str(e.output)[-3000:]}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((out / f"fsdp-rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="session")
def ranks(tmp_path_factory) -> list[dict]:
    """The job's two reports, run once per session (a file lock when pytest-xdist spreads the tests over workers)."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _launch(tmp_path_factory.mktemp("fsdp"))
    shared = tmp_path_factory.getbasetemp().parent
    out = shared / "fsdp-grow"
    with FileLock(str(shared / "fsdp-grow.lock")):
        if not (out / "fsdp-rank1.json").exists():
            out.mkdir(exist_ok=True)
            return _launch(out)
    return [json.loads((out / f"fsdp-rank{r}.json").read_text()) for r in range(2)]


def test_every_rank_grows_its_shards_without_a_jump_in_the_loss(ranks):
    """The loss on a fixed batch is the same before and after growth, in eval and train mode, on both ranks; the grown
    model is sharded again (each rank holds its chunk of every parameter) with the same units and mesh."""
    for spec in SPECS:
        for rank, report in enumerate(ranks):
            r = report["grow"][spec]
            assert r["params_after"] > r["params_before"], spec
            for mode in ("eval", "train"):
                before, after = r["probe_before"][mode], r["probe_after"][mode]
                assert abs(after - before) <= 1e-6 * abs(before), (spec, rank, mode, before, after)
            assert r["sharded"] and r["same_mesh"] and r["opt_covers_model"], (spec, rank)
            # the two layer units keep their modules (by path, grown in place); the root stays last; deepen's new
            # layer is a unit of its own, like the others
            assert r["units_after"][:2] == r["units_before"][:2] and r["units_after"][-1] == [""], (spec, r)
            assert len(r["units_before"]) == 3, r["units_before"]
            added = r["units_after"][2:-1]
            if spec.startswith("deepen"):
                assert len(added) == 1 and all(p.startswith("deepen_transformer.") for p in added[0]), added
                assert len(added[0]) >= 6, added
            else:
                assert added == [], (spec, added)
        assert ranks[0]["grow"][spec]["probe_after"] == ranks[1]["grow"][spec]["probe_after"], spec


def test_release_old_frees_the_old_state_and_puts_it_back_on_failure(ranks):
    """grow(release_old=True) on the whole-model path (layerwise=False): the same grown parameters and AdamW moments
    as without it; afterwards every old shard, gradient and moment is empty (freed while the grown model was built); a
    failure on rank 1 puts them back."""
    for report in ranks:
        r, same = report["release"], report["grow"]["grow_width(factor=2)"]
        assert "injected failure on rank 1" in r["error"] and r["restored"], r
        assert r["released"], r
        # release_old grows the whole model on the host: the same as grow_replica on a plain copy, bit for bit
        assert r["digest"] == r["reference_digest"], r
        assert r["optimizer_digest"] == r["reference_optimizer_digest"], r
        for mode in ("eval", "train"):
            assert r["probe_after"][mode] == pytest.approx(same["probe_after"][mode], rel=1e-6)


def test_each_unit_keeps_its_settings_across_growth(ranks):
    """Layers sharded with reshard_after_forward=False and bf16 compute (MixedPrecisionPolicy) are sharded the same
    way after growth; the loss (computed in bf16) is unchanged and a step follows."""
    for report in ranks:
        r = report["options"]
        assert r["after"] == r["before"] and len(r["before"]) == 3, r
        assert all(u[1] == "False" and "param_dtype=torch.bfloat16" in u[2] for u in r["before"]), r["before"]
        assert r["probe_after"] == r["probe_before"], r
        assert 0 < r["step_after"] < 10, r  # a number: the step ran
    assert ranks[0]["options"]["step_after"] == ranks[1]["options"]["step_after"]


def test_the_sharded_growth_is_the_same_growth_done_unsharded(ranks):
    """Every spec grows layer by layer (fsdp_layers.py); gathered with torch's own full state dicts, the grown
    parameters and AdamW's moments are bit-identical to the same layer-by-layer growth of a plain copy loaded with the
    same weights and optimiser state (layerwise.grow_plain, same seed, optimiser carried), and the ranks hold the same
    model."""
    for spec in SPECS:
        for r in (ranks[0]["grow"][spec], ranks[1]["grow"][spec]):
            assert r["layerwise"], spec
            assert r["differs_from_unsharded"] == [], (spec, r["differs_from_unsharded"])
            assert r["optimizer_differs"] == [] and r["optimizer_entries"] > 0, (spec, r["optimizer_differs"])
        assert ranks[0]["grow"][spec]["digest"] == ranks[1]["grow"][spec]["digest"], spec


def test_training_continues_as_it_would_unsharded(ranks):
    """Two AdamW steps after growth: the sharded job (each rank half of the batch) and the unsharded reference (the
    whole batch) reach the same losses and parameters to float rounding; the parameters deepen added learn."""
    for spec in SPECS:
        r0, r1 = ranks[0]["grow"][spec], ranks[1]["grow"][spec]
        assert r0["losses_after"] == r1["losses_after"], spec
        assert r0["losses_after"] == pytest.approx(r0["reference_after"], rel=1e-5), spec
        assert r0["max_param_gap"] < 1e-4, (spec, r0["max_param_gap"])
        assert sorted(r0["new_params_moved"]) == sorted(r0["new_params"]), spec
    assert len(ranks[0]["grow"]["deepen(block=transformer)"]["new_params"]) >= 4


def test_a_rank_that_fails_during_growth_leaves_every_rank_on_its_old_model(ranks):
    """Rank 1 fails inside the pipeline (planning), inside a layer's window (after rank 0 gathered and grew), inside
    the re-sharding of a layer, then with release_old in the check of the whole grown model (every old shard,
    gradient and moment in the spill file by then) and in the optimiser carry (after two moments were gathered on
    the training group): both ranks raise DistributedError (rank 0 naming rank 1 and its error) within seconds — in
    the carry rank 0 does not wait in its next gather for the training group's 30-minute timeout — keep the model's
    shards, gradients, the optimiser and its state bit for bit, and train on together."""
    for where in ("pipeline", "window", "reshard", "check", "carry"):
        for rank, report in enumerate(ranks):
            f = report["failure"][where]
            assert f["type"] == "DistributedError" and "injected failure on rank 1" in f["error"], (where, rank, f)
            assert f["kept"] and f["opt_kept"], (where, rank)
            assert f["seconds"] < 30, (where, rank, f["seconds"])
        assert "rank 1 could not grow" in ranks[0]["failure"][where]["error"], where
    assert ranks[0]["failure"]["step_after"] == ranks[1]["failure"]["step_after"]


def test_a_sharded_checkpoint_after_growth_resumes_in_2_processes_and_in_1(ranks):
    """save_sharded_checkpoint after growth (DCP shards + the growth log); a fresh traced model regrown from the log,
    sharded and restored gives the same loss at load and repeats the original run's next steps bit for bit in a
    group of 2; rank 0 alone in a group of one (DCP re-shards) continues to the same losses within float rounding."""
    for report in ranks:
        r = report["resume"]
        assert r["files"] == ["dcp", "state.pt"] and r["step"] == 3 and r["extra"] == {"note": "grown"}
        assert r["probe_at_load"] == r["probe_at_save"] and r["lr_at_load"] == r["lr_at_save"]
        assert r["resumed_losses"] == r["losses"], r
    alone = ranks[0]["resume"]
    for mode, loss in alone["probe_at_save"].items():
        assert alone["probe_at_load_1"][mode] == pytest.approx(loss, rel=1e-6)
    assert alone["resumed_losses_1"] == pytest.approx(alone["losses"], rel=1e-5)


def test_the_example_grows_twice_and_learns(ranks):
    """examples/grow_fsdp.py's loop (grow_hidden at step 10, grow_heads at 20) on 2 ranks: no jump, the loss falls."""
    ex = ranks[0]["example"]
    assert set(ex["events"]) == {"10", "20"}
    for event in ex["events"].values():
        assert event["before"] == pytest.approx(event["after"], rel=1e-6)
    losses = [ex["losses"][str(s)] for s in range(22)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert ex["losses"] == ranks[1]["example"]["losses"]


def test_grow_fsdp_and_shard_refuse_what_they_cannot_grow():
    """Without a process group: a model that is not sharded, and a layer path with no modules, are typed errors."""
    with pytest.raises(gg.InputError, match="sharded with fully_shard"):
        gg.distributed.grow_fsdp(nn.Linear(2, 2), None, "grow_width")
    gm = gg.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), input_shape=(2, 4))
    with pytest.raises(gg.InputError, match="no module the graph calls under 'layers.0'"):
        gg.distributed.shard(gm, ["layers.0"])


def test_the_grown_model_s_units_follow_the_old_ones_and_new_layers_get_their_own():
    """plan_units without a process group: old units keep the paths still there; what growth added at the root
    (called leaves with parameters, grouped by top-level name) becomes a unit per new module with the layers'
    settings; leaves without parameters and the root's modules stay the root's."""
    from graphgrow.jobs.fsdp import Unit, plan_units

    layer, root = {"reshard_after_forward": True}, {"reshard_after_forward": False}
    units = [Unit(("layers.0.q", "layers.0.gone"), layer), Unit(("layers.1.q",), layer), Unit(("",), root)]
    called = ["embed", "layers.0.q", "layers.1.q", "new_block.q", "new_block.k", "new_block.act", "adapter", "head"]
    present = {"", *called}
    with_params = {"embed", "layers.0.q", "layers.1.q", "new_block.q", "new_block.k", "adapter", "head"}
    before = {"", "embed", "layers.0.q", "layers.0.gone", "layers.1.q", "head"}
    plan = plan_units(units, present, called, with_params, before)
    assert [u.paths for u in plan] == [
        ("layers.0.q",),
        ("layers.1.q",),
        ("new_block.q", "new_block.k"),
        ("adapter",),
        ("",),
    ]
    assert [u.options for u in plan] == [layer, layer, layer, layer, root]
    only_root = plan_units([Unit(("",), root)], present, called, with_params, before)
    assert [u.paths for u in only_root] == [("",)]


def test_released_tensors_leave_their_memory_and_come_back_bit_for_bit():
    """fsdp.Released: each storage once (a view and its base), emptied, then restored to the same values; a storage
    torch does not let resize (viewed with .numpy()) is kept and counted."""
    import torch

    from graphgrow.jobs.fsdp import Released

    a, b = torch.randn(6, 4), torch.arange(10.0)
    pinned = torch.randn(3)
    pinned.numpy()
    want = [a.clone(), b.clone(), pinned.clone()]
    r = Released([a, a[2:], b, pinned])
    assert len(r.saved) == 2 and r.kept == pinned.untyped_storage().nbytes()
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0
    r.restore()
    assert all(torch.equal(x, y) for x, y in zip([a, b, pinned], want))


def test_a_sharded_checkpoint_that_is_not_one_is_refused(tmp_path):
    """load_sharded_checkpoint reads only plain data and says what is wrong: no folder, another format, a bad step;
    save_sharded_checkpoint refuses a model that is not sharded (before any collective)."""
    import torch

    with pytest.raises(gg.LoadError, match="not a graphgrow sharded checkpoint folder"):
        gg.distributed.load_sharded_checkpoint(tmp_path)
    (tmp_path / "dcp").mkdir()
    torch.save({"format": "something else"}, tmp_path / "state.pt")
    with pytest.raises(gg.LoadError, match="is not a graphgrow sharded checkpoint"):
        gg.distributed.load_sharded_checkpoint(tmp_path)
    torch.save({"format": "graphgrow.sharded_checkpoint", "version": 1, "step": -1}, tmp_path / "state.pt")
    with pytest.raises(gg.LoadError, match="step is not a step number"):
        gg.distributed.load_sharded_checkpoint(tmp_path)
    with pytest.raises(gg.InputError, match="takes a model sharded with FSDP2"):
        gg.distributed.save_sharded_checkpoint(tmp_path / "x", nn.Linear(2, 2))


def test_a_rank_killed_during_growth_is_an_error_on_the_survivor_not_a_hang(ranks):
    """A rank killed with SIGKILL inside a layer's window (while the other waits on graphgrow's side group) or before
    gathering the second layer's tensors with release_old (while the other is inside the training group's all-gather,
    the first layer's old shards and gradients in its spill file): the survivor raises DistributedError within
    seconds, saying a rank died, with its model's shards and gradients as they were."""
    for point in ("window", "gather"):
        assert ranks[1]["killed"][point]["status"] == -9, ranks[1]["killed"]
        r = ranks[0]["killed"][point]
        assert r["status"] == 0 and r["type"] == "DistributedError", r
        assert "a rank died, hung or was killed during growth" in r["error"] and r["kept"], r
        assert r["seconds"] < 20, r  # detected from the closed connection, before the 20 s timeout
    assert "while gathering layers.1." in ranks[0]["killed"]["gather"]["error"]


def test_growth_with_release_old_holds_one_layer_over_the_sharded_steady_state(ranks):
    """Tensor bytes held per rank (the profiler's record of the CPU allocator) while a 4-layer decoder grows
    (grow_hidden): without release_old the event holds the whole grown sharded state (shards and AdamW's two moments)
    beside the old one; with it the old state leaves as growth goes (the moments first, a shard and its gradient once
    gathered), so the peak stays within one layer's full tensors, old and grown, over the steady state — with rank 0
    verifying too: the check's working set (FSDP gathering the old model a unit at a time for the reference outputs,
    rank 0's checks of each window: gradients and SGD steps of the grown layer) fits in the room the old moments leave.
    Afterwards the old model and optimiser hold nothing (their forward, state_dict and step raise InputError)."""
    for rank, report in enumerate(ranks):
        m = report["memory"]
        keep, release, verified = m["keep"], m["release"], m["verified"]
        layer = m["layer_full"] + keep["grown_layer_full"]  # one layer's old and grown full tensors
        assert keep["peak"] - keep["steady"] >= 3 * keep["grown_shards"], (rank, keep)
        for case in (release, verified):  # the message names the span's largest allocations, to say what rose
            rise = case["peak"] - case["steady"]
            assert rise <= 1.25 * layer, (rank, rise, layer, case["steady"], case["largest_allocations"])
        assert keep["old_state_left"] > 0 and release["old_state_left"] == verified["old_state_left"] == 0
        # kept, the old model still runs; released, using it is a typed error instead of a crash on freed memory
        assert set(keep["old_used"].values()) == {None}, keep["old_used"]
        assert set(release["old_used"].values()) == {"InputError"}, release["old_used"]
        # the same growth: the grown parameters and AdamW's moments bit for bit
        for key in ("probe_after", "digest", "optimizer_digest"):
            assert release[key] == keep[key] == verified[key], (rank, key)


def test_a_spill_frees_storages_and_reads_them_back_bit_for_bit():
    """fsdp_spill.Spill: each storage written once (a view and its base, a tensor given twice), freed, its bytes
    counted; borrow reads some back for a while and frees them again; restore puts back the same values; a storage
    torch does not let resize is kept and counted."""
    import torch

    from graphgrow.jobs.fsdp_spill import _CHUNK, Spill

    a, b = torch.randn(6, 4), torch.arange(_CHUNK // 4 + 5, dtype=torch.float32)  # b spans two chunks
    pinned = torch.randn(3)
    pinned.numpy()
    want = [a.clone(), b.clone(), pinned.clone()]
    spill = Spill()
    spill.release([a, a[2:], None, b])
    spill.release([b, pinned, pinned])
    assert spill.nbytes == a.nelement() * 4 + b.nelement() * 4 and spill.kept == pinned.nelement() * 4
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0
    with spill.borrow([b, torch.ones(2)]):  # read back for the block (a tensor it never released is left alone)
        assert torch.equal(b, want[1]) and a.untyped_storage().nbytes() == 0
    assert b.untyped_storage().nbytes() == 0  # freed again; the file keeps its bytes
    spill.restore()
    assert all(torch.equal(x, y) for x, y in zip([a, b, pinned], want))


def test_growth_callback_grows_a_sharded_model_under_lightning_s_model_parallel_strategy(ranks):
    """Lightning's ModelParallelStrategy (FSDP2, CPU, gloo): the module shards its traced decoder in configure_model;
    GrowthCallback grows it at step 2 with the same loss just before and after, sharded again, AdamW (with state)
    and its scheduler carried; fit goes on to step 5. FSDPStrategy (FSDP1) is refused with an InputError."""
    if "skipped" in ranks[0]["lightning"]:
        pytest.skip(f"Lightning is not installed: {ranks[0]['lightning']['skipped']}")
    for rank, report in enumerate(ranks):
        r = report["lightning"]
        assert r["global_step"] == 5 and len(r["events"]) == 1 and r["events"][0]["when"] == 2, r
        assert r["after_params"] > r["before_params"], r
        for mode in ("eval", "train"):
            assert r["after"][mode] == pytest.approx(r["before"][mode], rel=1e-6), (rank, mode, r)
        assert r["sharded"] and r["opt_is_model"] and r["opt_state"] > 0 and r["scheduler_follows"], r
        assert "FSDPStrategy" in r["fsdp1"] and "ModelParallelStrategy" in r["fsdp1"], r
    assert ranks[0]["lightning"]["after"] == ranks[1]["lightning"]["after"]
