"""Growth inside data-parallel jobs (issue 24): torchrun with 2 processes, gloo on the CPU.

The jobs themselves are tests/distributed_job.py (and distributed_lightning.py); each test launches one or
two of them with a timeout, each on a port of its own (torchrun --standalone picks a free one; the
hand-launched fault jobs bind port 0 to find one), so two pytest workers never collide. Every rank writes
a JSON report; the assertions are here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.jobs.ddp import carry_scheduler, rebuild_options

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build", allow_module_level=True)

HERE = Path(__file__).resolve().parent
JOB = HERE / "distributed_job.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}


def torchrun(scenario: str, out: Path, nproc: int = 2) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(JOB),
        scenario,
        str(out),
    ]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the job ran past {timeout} s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    return output


def reports(out: Path, scenario: str, world: int) -> list[dict]:
    return [json.loads((out / f"{scenario}-w{world}-rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="session")
def grown_job(tmp_path_factory):
    """One 2-process job: a CNN and a transformer grow at step 2, checkpoint after step 4, train to step 7. Run once
    for the whole session, also when pytest-xdist spreads the tests that use it over several workers (a file lock in
    the folder they share)."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("ddp-grow")
        finish(torchrun("grow", out))
        return out, reports(out, "grow", 2)
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, shared by its workers
    out = shared / "ddp-grow"
    with FileLock(str(shared / "ddp-grow.lock")):
        if not (out / "grow-w2-rank1.json").exists():
            out.mkdir(exist_ok=True)
            finish(torchrun("grow", out))
    return out, reports(out, "grow", 2)


def test_every_rank_grows_the_same_model_without_a_jump_in_the_loss(grown_job):
    _, ranks = grown_job
    for kind in ("cnn", "transformer"):
        r0, r1 = ranks[0][kind], ranks[1][kind]
        assert r0["params_after"] > r0["params_before"], kind
        for r in (r0, r1):
            for mode in ("eval", "train"):  # exact: the same loss before and after, on every rank
                assert abs(r["probe_after"][mode] - r["probe_before"][mode]) <= 1e-6 * abs(r["probe_before"][mode]), (
                    kind,
                    mode,
                    r,
                )
            assert r["opt_covers_model"] and r["momentum_carried"] > 0, kind
            assert r["lr_after"] == r["lr_before"], kind
        assert r0["probe_after"] == r1["probe_after"] and r0["seed"] == r1["seed"], kind


def test_ranks_stay_identical_and_new_parameters_learn_after_growth(grown_job):
    """Each rank trains on its own half of every batch: identical parameters afterwards mean DDP all-reduces the new
    parameters' gradients too (a wrapper that did not know them would let the ranks drift apart)."""
    _, ranks = grown_job
    for kind in ("cnn", "transformer"):
        r0, r1 = ranks[0][kind], ranks[1][kind]
        assert r0["fingerprint"] == r1["fingerprint"], kind
        assert r0["losses"] == r1["losses"], kind
        assert r0["new_params"] and sorted(r0["new_params_moved"]) == sorted(r0["new_params"]), kind


def test_ranks_that_disagree_or_grow_different_weights_all_raise_and_keep_their_model(grown_job):
    """Rank 1 asks for another spec; then rank 1's pipeline perturbs a new parameter: the checksums differ. Both
    ranks raise DistributedError (naming the rank and the first tensor that differs), keep the model and the
    optimiser, and train on together."""
    _, ranks = grown_job
    for rank, r in enumerate(ranks):
        d = r["disagreements"]
        assert "rank 1's growth spec 'insert_adapter' is not rank 0's 'deepen'" in d["spec"], d
        assert "the ranks grew different models: rank 1's deepen_linear_relu_gate is not rank 0's" in d["weights"], d
        assert d["kept"], rank
    assert ranks[0]["disagreements"]["step_after"] == ranks[1]["disagreements"]["step_after"]


def test_a_checkpoint_after_growth_resumes_with_2_and_with_1_process(grown_job):
    """The checkpoint written after growth resumes in a new process group of 2 and repeats the original run's steps
    bit for bit. With 1 process (this one, no process group, the same global batches) the loss at load is the same,
    and the transformer (no BatchNorm: nothing depends on how the batch is split) continues to the same losses."""
    sys.path.insert(0, str(HERE))
    from distributed_job import run_resume

    out, ranks = grown_job
    two = torchrun("resume", out, 2)
    resumed1 = json.loads(json.dumps(run_resume(out, 0, 1)))  # while the two processes start
    finish(two)
    resumed2 = reports(out, "resume", 2)
    for kind in ("cnn", "transformer"):
        original = ranks[0][kind]
        for r in resumed2:
            assert r[kind]["step"] == 5 and r[kind]["probe_at_load"] == original["probe_at_save"], kind
            assert r[kind]["losses"] == {k: v for k, v in original["losses"].items() if int(k) >= 5}, kind
            assert r[kind]["fingerprint"] == original["fingerprint"], kind
        assert resumed1[kind]["step"] == 5
        for mode, loss in original["probe_at_save"].items():
            assert resumed1[kind]["probe_at_load"][mode] == pytest.approx(loss, rel=1e-6), (kind, mode)
    for step, loss in resumed1["transformer"]["losses"].items():
        assert loss == pytest.approx(ranks[0]["transformer"]["losses"][step], rel=1e-5, abs=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fault_job(how: str, out: Path) -> list[subprocess.Popen]:
    """Two ranks launched by hand: torchrun would end rank 0 itself as soon as rank 1 dies, and the point is what
    rank 0 does on its own."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **ENV,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "GROW_TIMEOUT": "4",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), how, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_a_rank_killed_or_hung_during_growth_gives_the_others_a_clear_error(tmp_path):
    """Rank 1 is SIGKILLed (one job) or hangs (another) inside the growth step; rank 0 raises DistributedError —
    within the 4 s timeout the growth step was given, not the process group's 30 minutes — and keeps its model."""
    jobs = {how: _fault_job(how, tmp_path) for how in ("die", "hang")}
    try:
        for how, procs in jobs.items():
            output = finish(procs[0], timeout=300)
            report = json.loads((tmp_path / f"{how}-w2-rank0.json").read_text())
            assert report["type"] == "DistributedError", (how, report, output[-2000:])
            assert (
                "not every rank answered" in report["error"] and "resume from the last checkpoint" in report["error"]
            ), report
            assert report["model_kept"], how
            # the 4 s timeout, not the process group's 1800 s; the margin is rank 0's own growth on a busy machine
            assert report["seconds"] < 4 + 120, (how, report["seconds"])
            if how == "hang":
                assert report["seconds"] >= 3.5, report  # it waited for the hung rank, up to the timeout
        assert jobs["die"][1].wait(timeout=120) == -9  # rank 1 did die by SIGKILL, inside the growth step
    finally:
        for procs in jobs.values():
            for p in procs:
                p.kill()
                p.communicate()


def test_lightning_growth_callback_under_ddp(tmp_path):
    """GrowthCallback under Lightning's ddp strategy (2 CPU processes): the loss on a fixed batch is the same just
    before and just after growth on both ranks, the optimiser Lightning steps and the wrapper DDP reduces cover the
    grown model, the scheduler follows, the ranks end identical; a Lightning checkpoint after growth resumes into a
    fresh (un-grown) module, regrown by its on_load_checkpoint, at the saved weights and step."""
    pytest.importorskip("lightning", reason="the Lightning extra is not installed (pip install 'graphgrow[lightning]')")
    finish(torchrun("lightning", tmp_path))
    ranks = reports(tmp_path, "lightning", 2)
    for r in ranks:
        assert r["after_params"] > r["before_params"] and r["after_ddp_params"] == r["after_params"]
        for mode in ("eval", "train"):
            assert abs(r["after"][mode] - r["before"][mode]) <= 1e-6 * abs(r["before"][mode]), r
        assert r["after_opt_is_model"] and r["after_sched_follows"]
        assert [e["when"] for e in r["events"]] == [3] and r["lr"] == [pytest.approx(0.05 * 0.5**3)]
        assert r["loaded_fingerprint"] == r["fingerprint"] and r["loaded_step"] == 6
        assert r["resumed_params"] == r["after_params"] and r["resumed_keys_match"] and r["resumed_global_step"] == 8
    assert (
        ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
        and ranks[0]["resumed_fingerprint"] == ranks[1]["resumed_fingerprint"]
    )
    assert ranks[0]["events"][0]["seed"] == ranks[1]["events"][0]["seed"]


# --- one process: the parts that need no second rank --------------------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one process (this pytest worker), torn down afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _small():
    torch.manual_seed(0)
    return gg.trace(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)),
        input_shape=(1, 3, 6, 6),
    )


def test_the_rebuilt_wrapper_keeps_the_old_wrappers_options(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    gm = _small()
    ddp = DDP(gm, find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=7, broadcast_buffers=False)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    g = gg.distributed.grow(ddp, opt, "insert_adapter", seed=3)
    assert isinstance(g.model, DDP) and g.model is not ddp and g.gm is not gm
    assert rebuild_options(g.model) == rebuild_options(ddp)
    assert rebuild_options(ddp)["find_unused_parameters"] and rebuild_options(ddp)["bucket_cap_mb"] == 7
    assert g.seed == 3 and g.gm.meta["graphgrow"]["log"][-1]["seed"] == 3  # the agreed seed is the one logged
    assert {id(p) for grp in g.optimizer.param_groups for p in grp["params"]} == {id(p) for p in g.model.parameters()}


def test_a_failed_growth_changes_nothing(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    gm = _small()
    ddp = DDP(gm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = [p.detach().clone() for p in gm.parameters()]
    with pytest.raises(gg.NotApplicable):
        gg.distributed.grow(ddp, opt, "add_branch(at=_4)", timeout=10)  # a Linear: no conv to branch beside
    with pytest.raises(gg.SpecError):
        gg.distributed.grow(ddp, opt, "no_such_pass")
    assert ddp.module is gm and all(torch.equal(a, p) for a, p in zip(before, gm.parameters()))
    assert opt.param_groups[0]["params"][0] is next(gm.parameters())


def test_the_scheduler_follows_the_carried_optimiser():
    gm = _small()
    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [warm, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)], milestones=[2]
    )
    for _ in range(3):
        opt.step()
        sched.step()
    lr = sched.get_last_lr()
    g = gg.distributed.grow_replica(gm, opt, "deepen", sched)  # no process group: the one-process growth step
    assert g.scheduler is sched and sched.optimizer is g.optimizer and warm.optimizer is g.optimizer
    assert sched.get_last_lr() == lr and g.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    g.optimizer.step()
    sched.step()
    assert g.optimizer.param_groups[0]["lr"] == pytest.approx(lr[0] * 0.5)  # the schedule goes on from where it was
    with pytest.raises(gg.InputError):
        carry_scheduler(object(), g.optimizer)


def test_checkpoint_refuses_mixed_folders_and_wrong_optimisers(tmp_path):
    gm = _small()
    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    gm(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    grown = gg.distributed.grow_replica(gm, opt, "deepen", seed=1)
    gg.distributed.save_checkpoint(tmp_path / "a", grown.gm, grown.optimizer, step=3, extra={"epoch": 1})
    gg.distributed.save_checkpoint(tmp_path / "b", gm, opt, step=1)
    ck = gg.distributed.load_checkpoint(tmp_path / "a")
    assert ck.step == 3 and ck.extra == {"epoch": 1}
    fresh = torch.optim.SGD(ck.model.parameters(), lr=1.0)
    ck.restore(fresh)
    assert fresh.param_groups[0]["lr"] == 0.1 and sum("momentum_buffer" in s for s in fresh.state.values()) == len(
        list(gm.parameters())
    )
    with pytest.raises(gg.InputError):
        ck.restore(torch.optim.SGD(gm.parameters(), lr=0.1))
    (tmp_path / "a" / "model.pt").write_bytes((tmp_path / "b" / "model.pt").read_bytes())
    with pytest.raises(gg.LoadError, match="belong together"):
        gg.distributed.load_checkpoint(tmp_path / "a")
    with pytest.raises(gg.SaveError):
        gg.distributed.save_checkpoint(tmp_path / "a" / "model.pt", gm, opt)


def test_importing_graphgrow_loads_neither_the_distributed_jobs_nor_lightning():
    code = (
        "import sys, graphgrow as gg; assert 'graphgrow.jobs.ddp' not in sys.modules; gg.distributed.grow; "
        "assert 'lightning' not in sys.modules, 'lightning was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
