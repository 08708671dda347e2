"""Issue 38 (items 2, 3, 6): no name read from a file is imported or called without --trust, a search folder is
trusted only with --trust, and the user's own code (a --data function, a factory) cannot end graphgrow silently.

Every case runs the real CLI in a folder that holds a canary module: importing it, or calling its function,
writes the file CANARY there. The folder is the current one, so an import of the canary's name would find it;
CANARY must never appear."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

from graphgrow.io.load import load_model
from graphgrow.io.save import save_model

SHAPE = ["--input-shape", "1,1,8,8"]
GROW = ["--pass", "grow_width(init=gradmax)"]

USER_CODE = """
import os, signal, sys, time
import torch
from torch import nn

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

def batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    return x, lambda out: nn.functional.cross_entropy(out, y)

class Mine(BaseException):
    pass

def exits():
    sys.exit(0)

def exits_none():
    sys.exit()

def generator_exit():
    raise GeneratorExit

def keyboard_interrupt():
    raise KeyboardInterrupt  # raised by the code itself: no Ctrl-C was pressed

def own_base_exception():
    raise Mine("mine")

def loss_exits():
    x, _ = batch()
    return x, lambda out: sys.exit(0)

def chatty():
    print("hello from the data function")
    return batch()

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, as a terminal's Ctrl-C sends
    time.sleep(30)
    return batch()

def model_exits():
    sys.exit(0)

def model_generator_exit():
    raise GeneratorExit

def model_keyboard_interrupt():
    raise KeyboardInterrupt

def model_chatty():
    print("hello from the factory")
    return model()
"""

CANARY = """
from pathlib import Path
Path("CANARY").write_text("imported")

def boom(*args, **kwargs):
    Path("CANARY").write_text("called")
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with the user's module, the canary, m.pt and g.pt (m.pt grown with init=gradmax, data=mydata:batch)."""
    folder = tmp_path_factory.mktemp("hostile_code")
    (folder / "mydata.py").write_text(USER_CODE)
    (folder / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (folder / "canary.py").write_text(CANARY)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 3),
    )
    torch.save(model, folder / "m.pt")
    proc = run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "mydata:batch", "-o", "g.pt", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    gm = load_model(folder / "g.pt").module
    assert gm.meta["graphgrow"]["log"][0]["args"]["data"] == "mydata:batch"
    gm.meta["graphgrow"]["log"][0]["args"]["data"] = "canary:boom"  # what an attacker writes into the file
    save_model(gm, folder / "evil.pt")
    proc = run_cli("export", "evil.pt", "-o", "evil.onnx", cwd=folder)  # the ONNX file carries the same log
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture(autouse=True)
def no_canary(request):
    yield
    if "work" in request.fixturenames:
        folder = request.getfixturevalue("work")
        assert not (folder / "CANARY").exists(), "the canary ran"


def one_line(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path).module.state_dict()


# --- C1: a logged callable is replayed only when the user names it again, or with --trust ---


@pytest.mark.parametrize("grown", ["evil.pt", "evil.onnx"])
def test_replay_refuses_a_data_name_read_from_the_file(work, grown):
    proc = run_cli("replay", "m.pt", grown, "-o", "r.pt", cwd=work)
    one_line(
        proc,
        "step 1 of the mutation log (grow_width)",
        "data=canary:boom",
        "never imports a name read from a file",
        "--data canary:boom",
        "--trust",
    )
    assert not (work / "r.pt").exists()


def test_replay_uses_the_data_function_the_user_names_again(work):
    proc = run_cli("replay", "m.pt", "evil.pt", "-o", "again.pt", "--data", "mydata:batch", cwd=work)
    assert proc.returncode == 0, proc.stderr
    grown, again = weights(work / "g.pt"), weights(work / "again.pt")
    assert grown.keys() == again.keys() and all(torch.equal(grown[k], again[k]) for k in grown)  # seed for seed


def test_replay_with_trust_uses_the_logged_name(work):
    proc = run_cli("replay", "m.pt", "g.pt", "-o", "trusted.pt", "--trust", cwd=work)
    assert proc.returncode == 0, proc.stderr
    grown, again = weights(work / "g.pt"), weights(work / "trusted.pt")
    assert all(torch.equal(grown[k], again[k]) for k in grown)


def test_replay_refuses_data_for_a_log_without_it(work):
    proc = run_cli("mutate", "m.pt", *SHAPE, "--pass", "add_residual", "-o", "plain.pt", cwd=work)
    assert proc.returncode == 0, proc.stderr
    one_line(
        run_cli("replay", "m.pt", "plain.pt", "--data", "canary:boom", "-o", "r.pt", cwd=work),
        "no step of plain.pt's mutation log was grown with data",
    )


REGROW = """
import sys, torch
import graphgrow as gg
from graphgrow.core.errors import InputError
from graphgrow.jobs.lightning_callback import GrowthCallback
from torch import nn
import mydata

evil = gg.load_model("evil.pt").module.meta["graphgrow"]["log"]
checkpoint = {"graphgrow": {"attr": "model", "log": evil}}

class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = gg.trace(mydata.model(), (1, 1, 8, 8))

holder = Holder()
try:
    GrowthCallback.regrow(holder, checkpoint)
    print("REGREW")
except InputError as e:
    print("REFUSED", e)
before = sum(p.numel() for p in holder.model.parameters())
GrowthCallback.regrow(holder, checkpoint, data=mydata.batch)  # named again, in Python
print("PARAMS", before, sum(p.numel() for p in holder.model.parameters()))
"""


def test_lightning_regrow_refuses_a_data_name_read_from_the_checkpoint(work):
    pytest.importorskip("lightning")
    proc = subprocess.run([sys.executable, "-c", REGROW], capture_output=True, text=True, cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("REFUSED step 1 of the mutation log (grow_width) was grown with data=canary:boom"), lines
    before, after = map(int, lines[-1].split()[1:])
    assert after > before  # with the function passed again, the checkpoint's growth is replayed


# --- C3: a search folder is unpickled by Ray Tune only with --trust ---


def test_search_resume_needs_trust(work):
    folder = work / "runs" / "s1"
    folder.mkdir(parents=True)
    payload = b"ccanary\nboom\n(tR."  # unpickled: imports canary (GLOBAL) and calls boom() (REDUCE)
    (folder / "tuner.pkl").write_bytes(payload)
    shutil.copy(work / "m.pt", folder / "original.pt")
    proc = run_cli(
        "search",
        "m.pt",
        "--train",
        "mydata:batch",
        "--eval",
        "mydata:batch",
        "--mutations",
        "grow_width",
        "--storage-path",
        "runs",
        "--name",
        "s1",
        "--resume",
        cwd=work,
    )
    one_line(proc, "--resume restores the search in", "a pickle in that folder would run code", "--trust")


# --- S8 / item 6: the user's code cannot end graphgrow silently ---


@pytest.mark.parametrize(
    "fn, said",
    [
        ("exits", "mydata:exits failed: SystemExit (it called sys.exit(0))"),
        ("exits_none", "mydata:exits_none failed: SystemExit (it called sys.exit(None))"),
        ("generator_exit", "mydata:generator_exit failed: GeneratorExit"),
        ("keyboard_interrupt", "mydata:keyboard_interrupt failed: KeyboardInterrupt"),
        ("own_base_exception", "mydata:own_base_exception failed: Mine: mine"),
        ("loss_exits", "the loss_fn of data function mydata:loss_exits failed: SystemExit"),
    ],
)
def test_a_data_function_that_ends_the_process_is_one_line(work, fn, said):
    proc = run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", f"mydata:{fn}", "--dry-run", cwd=work)
    one_line(proc, said)


def test_a_data_module_that_exits_on_import_is_one_line(work):
    proc = run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "exits_on_import:batch", "--dry-run", cwd=work)
    one_line(proc, "importing exits_on_import (for exits_on_import:batch) failed: SystemExit")


@pytest.mark.parametrize(
    "fn, said",
    [
        ("model_exits", "mydata:model_exits() failed: SystemExit (it called sys.exit(0))"),
        ("model_generator_exit", "mydata:model_generator_exit() failed: GeneratorExit"),
        ("model_keyboard_interrupt", "mydata:model_keyboard_interrupt() failed: KeyboardInterrupt"),
    ],
)
def test_a_factory_that_ends_the_process_is_one_line(work, fn, said):
    one_line(run_cli("inspect", f"mydata:{fn}", *SHAPE, cwd=work), said)


def test_prints_of_user_code_go_to_stderr(work):
    proc = run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "mydata:chatty", "--dry-run", "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passes"]  # stdout is the one JSON object
    assert "hello from the data function" in proc.stderr
    proc = run_cli("inspect", "mydata:model_chatty", *SHAPE, "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] > 0
    assert "hello from the factory" in proc.stderr


def test_a_real_ctrl_c_in_user_code_still_stops(work):
    proc = run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "mydata:ctrl_c", "-o", "never.pt", cwd=work)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted (SIGINT)" in proc.stderr and not (work / "never.pt").exists()


# --- minors: what a data function may name, checkpoints ---


def test_a_library_function_as_data_is_refused_as_a_data_function(work):
    line = one_line(
        run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "os:system", "--dry-run", cwd=work),
        "os:system is in Python's standard library, not a data function",
        "a function of your own code",
    )
    assert "zoo" not in line and "timm" not in line
    line = one_line(
        run_cli("mutate", "m.pt", *SHAPE, *GROW, "--data", "torch:zeros", "--dry-run", cwd=work),
        "torch's own zeros, not a data function",
    )
    assert "zoo" not in line


def test_search_names_what_a_training_function_must_be(work):
    one_line(
        run_cli(
            "search",
            "m.pt",
            "--train",
            "os:system",
            "--eval",
            "mydata:batch",
            "--mutations",
            "grow_width",
            "--storage-path",
            "runs",
            "--name",
            "s2",
            *SHAPE,
            cwd=work,
        ),
        "os:system is in Python's standard library, not a training function",
    )


def _checkpoint(tmp_path: Path, edit) -> Path:
    import graphgrow as gg

    gm = gg.trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (1, 4))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    gm(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = gg.distributed.save_checkpoint(tmp_path / "ck", gm, opt, step=5)
    state = torch.load(path / "state.pt", weights_only=True)
    edit(state)
    torch.save(state, path / "state.pt")
    return path


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda s: s.update(step="five"), "step is str 'five', not a step number"),
        (lambda s: s.update(step=-1), "step is int -1"),
        (lambda s: s.update(extra=[1]), "extra is list, not a dict"),
        (
            lambda s: s["optimizer"]["state"]["0.weight"].update(momentum_buffer=torch.zeros(5, 5)),
            "momentum_buffer[0.weight] has shape [5, 5], which does not fit the parameter's [3, 4]",
        ),
        (lambda s: s["optimizer"].update(state={"nope": {}}), "names parameters the model does not have"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_anything_is_restored(tmp_path, edit, said):
    import graphgrow as gg

    path = _checkpoint(tmp_path, edit)
    with pytest.raises(gg.LoadError, match="state.pt: ") as e:
        gg.distributed.load_checkpoint(path)
    assert said in str(e.value)


def test_a_checkpoint_keeps_adafactor_and_lbfgs_state(tmp_path):
    """State that is not the parameter's shape but belongs to it is accepted: a step count, Adafactor's factors."""
    import graphgrow as gg

    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch without Adafactor")
    gm = gg.trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (1, 4))
    opt = torch.optim.Adafactor(gm.parameters())
    gm(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = gg.distributed.save_checkpoint(tmp_path / "ck", gm, opt, step=1)
    ck = gg.distributed.load_checkpoint(path)
    fresh = torch.optim.Adafactor(ck.model.parameters())
    ck.restore(fresh)
    fresh.step()  # the restored state fits
