"""Issue 38, item 4 and the CLI minors, through the real CLI: no output replaces an input (under any name: a
derived .data name, a symlink, a hard link), nor anything that is not a regular file or a new name; default
names are claimed atomically; standard output that cannot be written; stored metadata of the wrong types or
with terminal escapes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import cli_fork
import pytest
import torch
from conftest import run_cli, small_cnn
from test_hostile import _graphgrow, _one_line_refusal, digest

SHAPE = ("--input-shape", "1,3,32,32")


def _tree(folder: Path) -> dict[str, tuple]:
    """Every entry of `folder` (links and special files too) with what identifies it: no file replaced, none added."""
    out = {}
    for p in sorted(folder.iterdir()):
        st = os.lstat(p)
        body = p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None
        out[p.name] = (st.st_ino, st.st_mode, body)
    return out


@pytest.fixture
def model(tmp_path) -> Path:
    p = tmp_path / "m.pt"
    torch.save(small_cnn(), p)
    return p


# --- C2: outputs never replace inputs, under any name ---


def test_export_never_writes_its_data_file_over_the_input(tmp_path):
    net = tmp_path / "net.data"
    torch.save(small_cnn(), net)
    before = _tree(tmp_path)
    proc = run_cli("export", "net.data", "--external-data", "-o", "net", *SHAPE, cwd=tmp_path)
    _one_line_refusal(proc, "--external-data writes the weights of net to net.data: output net.data is the input file")
    assert _tree(tmp_path) == before and not proc.stdout


def test_an_output_that_is_the_input_under_another_name_is_refused(tmp_path, model):
    os.link(model, tmp_path / "hard.pt")
    os.link(model, tmp_path / "h.data")
    (tmp_path / "link.pt").symlink_to("m.pt")
    before = _tree(tmp_path)
    proc = run_cli(
        "mutate", "m.pt", "--pass", "deepen", *SHAPE, "-o", "hard.pt", cwd=tmp_path
    )  # a hard link of the input
    _one_line_refusal(proc, "output hard.pt is the input file m.pt (the same file under another name)")
    proc = run_cli(
        "mutate", "link.pt", "--pass", "deepen", *SHAPE, "-o", "m.pt", cwd=tmp_path
    )  # the input through a link
    _one_line_refusal(proc, "output m.pt is the input file link.pt (the same file under another name)")
    proc = run_cli(
        "export", "m.pt", "--external-data", "-o", "h", *SHAPE, cwd=tmp_path
    )  # the derived name, a hard link
    _one_line_refusal(proc, "output h.data is the input file m.pt (the same file under another name)")
    assert _tree(tmp_path) == before


def test_replay_never_writes_over_the_data_file_of_the_log_it_reads(tmp_path, model):
    """The log's ONNX file and its NAME.onnx.data are inputs as well: `protect` records them when read."""
    assert run_cli("mutate", "m.pt", "--pass", "deepen", *SHAPE, "-o", "g.pt", cwd=tmp_path).returncode == 0
    assert run_cli("export", "g.pt", "--external-data", "-o", "g.onnx", cwd=tmp_path).returncode == 0
    before = _tree(tmp_path)
    proc = run_cli("replay", "m.pt", "g.onnx", "-o", "g.onnx.data", cwd=tmp_path)
    _one_line_refusal(proc, "output g.onnx.data is the input file")
    assert _tree(tmp_path) == before


LINK_AT_COMMIT = """
import os
from graphgrow.io import serialize
real = serialize.to_payload
def to_payload(gm):  # after the output was checked, before it is renamed into place: out.pt becomes a link
    os.symlink('m.pt', 'out.pt')
    return real(gm)
serialize.to_payload = to_payload
"""


def test_the_last_check_before_the_rename_refuses_a_link_that_appeared_meanwhile(tmp_path, model):
    proc = _graphgrow("mutate", "m.pt", "--pass", "deepen", *SHAPE, "-o", "out.pt", cwd=tmp_path, setup=LINK_AT_COMMIT)
    _one_line_refusal(proc, "output out.pt is a symbolic link")
    assert os.readlink(tmp_path / "out.pt") == "m.pt" and torch.load(model, weights_only=False) is not None
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "out.pt"]  # no staging file left


# --- S7: -o replaces only a regular file or a new name ---


def _special(tmp: Path, kind: str) -> str:
    if kind == "symlink to stdout":
        (tmp / "out.pt").symlink_to("/proc/self/fd/1")
        return "out.pt"
    if kind == "symlink to a file":
        (tmp / "other.pt").write_bytes(b"someone's file")
        (tmp / "out.pt").symlink_to("other.pt")
        return "out.pt"
    if kind == "directory":
        (tmp / "out.pt").mkdir()
        return "out.pt"
    if kind == "fifo":
        os.mkfifo(tmp / "out.pt")
        return "out.pt"
    return "/dev/stdout"


SPECIAL = [
    ("symlink to stdout", "is a symbolic link"),
    ("symlink to a file", "is a symbolic link"),
    ("/dev/stdout", "is a symbolic link"),
    ("directory", "is a directory"),
    ("fifo", "is not a regular file"),
]


@pytest.mark.parametrize("kind, message", SPECIAL, ids=[s[0] for s in SPECIAL])
@pytest.mark.parametrize("command", ["mutate", "export"])
def test_an_output_that_is_not_a_regular_file_is_never_replaced(tmp_path, model, kind, message, command):
    out = _special(tmp_path, kind)
    before = _tree(tmp_path)
    argv = (["mutate", "m.pt", "--pass", "deepen"] if command == "mutate" else ["export", "m.pt"]) + [*SHAPE, "-o", out]
    with open(tmp_path.parent / f"{tmp_path.name}.stdout", "w+") as stdout:  # stdout redirected to a file, as in S7
        proc = cli_fork.run(argv, tmp_path, stdout=stdout.name)
        stdout.seek(0)
        printed = stdout.read()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert printed == "" and _tree(tmp_path) == before
    if kind == "symlink to a file":
        assert (tmp_path / "other.pt").read_bytes() == b"someone's file"


# --- S6: default names are claimed atomically ---


def test_two_concurrent_runs_never_take_the_same_default_name(tmp_path, model):
    (tmp_path / "m.grown.pt").write_bytes(b"an earlier result")
    argv = [sys.executable, "-m", "graphgrow.cli", "mutate", "m.pt", "--pass", "deepen", *SHAPE, "--json"]
    runs = [
        subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [r.communicate(timeout=600) for r in runs]
    import json

    assert all(r.returncode == 0 for r in runs), [e for _, e in results]
    written = [json.loads(o)["outputs"][0] for o, _ in results]
    assert sorted(Path(w).name for w in written) == ["m.grown-1.pt", "m.grown-2.pt"], written
    assert (tmp_path / "m.grown.pt").read_bytes() == b"an earlier result"
    for w in written:
        assert run_cli("inspect", w, "--json", cwd=tmp_path).returncode == 0


def test_claim_takes_the_next_free_name_and_replaces_nothing(tmp_path):
    from graphgrow.io import outputs

    first = tmp_path / "m.grown.pt"
    first.write_bytes(b"taken")
    (tmp_path / "m.grown-1.pt").mkdir()
    tmp = tmp_path / "staged"
    tmp.write_bytes(b"new")
    assert outputs.claim(tmp, first) == tmp_path / "m.grown-2.pt"
    assert (tmp_path / "m.grown-2.pt").read_bytes() == b"new" and first.read_bytes() == b"taken" and not tmp.exists()


# --- minors ---


def _exported(tmp: Path) -> Path:
    torch.save(small_cnn(), tmp / "m.pt")
    assert run_cli("export", "m.pt", "--external-data", "-o", "m.onnx", *SHAPE, cwd=tmp).returncode == 0
    return tmp / "m.onnx"


def test_a_hard_linked_data_file_is_refused(tmp_path):
    onnx_file = _exported(tmp_path)
    os.link(tmp_path / "m.onnx.data", tmp_path / "elsewhere.bin")
    before = digest(tmp_path)
    for argv in (["inspect", "m.onnx"], ["check", "m.onnx", "m.pt"]):
        proc = run_cli(*argv, cwd=tmp_path)
        _one_line_refusal(proc, "'m.onnx.data' is a hard link (2 names)")
    assert digest(tmp_path) == before and onnx_file.exists()


def test_a_swapped_data_file_is_not_called_a_float64_problem(tmp_path):
    from graphgrow.io.runtime import RuntimeUnavailable, open_session

    onnx_file = _exported(tmp_path)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])  # swapped for a shorter one after the reader's check
    with pytest.raises(RuntimeUnavailable) as e:
        open_session(onnx_file.read_bytes(), "cpu", external_folder=tmp_path)
    assert "float32" not in str(e.value) and "NAME.onnx.data from the same export" in str(e.value)


def test_a_report_that_cannot_be_written_is_exit_2_after_the_outputs(tmp_path, model):
    proc = cli_fork.run(
        ["mutate", "m.pt", "--pass", "deepen", *SHAPE, "-o", "g.pt", "--json"], tmp_path, stdout="/dev/full"
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "error: cannot write to standard output: No space left on device; the outputs were written whole: g.pt"
    ), lines[0]
    assert "please report" not in proc.stderr and (tmp_path / "g.pt").is_file()


def test_a_closed_pipe_ends_quietly_with_141(tmp_path, model):
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphgrow.cli", "inspect", "m.pt", *SHAPE, "--all"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before anything is printed (`| head` that already quit)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141 and stderr == "", stderr


def _graphgrow_file(tmp: Path, edit) -> Path:
    """A file graphgrow wrote, its metadata edited by hand (the format kept)."""
    good = tmp / "g.pt"
    if not good.exists():
        torch.save(small_cnn(), tmp / "m.pt")
        assert run_cli("mutate", "m.pt", "--pass", "deepen", *SHAPE, "-o", "g.pt", cwd=tmp).returncode == 0
    p = copy.deepcopy(torch.load(good, weights_only=False))
    edit(p["meta"])
    bad = tmp / "bad.pt"
    torch.save(p, bad)
    return bad


def test_terminal_escapes_in_stored_metadata_are_printed_escaped(tmp_path):
    def edit(meta):
        meta["log"][0]["pass"] = "deepen\x1b]0;pwned\x07\x1b[2J"
        meta["log"][0]["targets"]["chosen"] = "\x1b[31mred\u202eevil"

    bad = _graphgrow_file(tmp_path, edit)
    for argv in (["inspect", bad.name], ["mutate", bad.name, "--pass", "deepen", "-o", "again.pt"]):
        proc = run_cli(*argv, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "\x1b" not in proc.stdout and "\u202e" not in proc.stdout and "\x07" not in proc.stdout
    assert "deepen\\x1b]0;pwned\\x07\\x1b[2J" in run_cli("inspect", bad.name, cwd=tmp_path).stdout


MALFORMED = [
    ("trace as a string", lambda m: m.__setitem__("trace", "abc"), "the stored trace report is str, not a record"),
    (
        "mode_reads as an int",
        lambda m: m["trace"].__setitem__("mode_reads", 5),
        "'mode_reads' as int, not a list of text",
    ),
    ("auto_leaves as an int", lambda m: m["trace"].__setitem__("auto_leaves", 5), "'auto_leaves' as int"),
    ("a log entry without fields", lambda m: m.__setitem__("log", [{}]), "mutation log's entry 1 has no 'pass'"),
    ("args as a string", lambda m: m["log"][0].__setitem__("args", "x"), "'args' as str, not a record"),
    ("a count as a string", lambda m: m["log"][0].__setitem__("params_after", "x"), "'params_after' as str"),
    ("a seed as a float", lambda m: m["log"][0].__setitem__("seed", 1.5), "'seed' as float"),
]


@pytest.mark.parametrize("label, edit, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_metadata_of_the_wrong_type_is_exit_2_naming_the_field(tmp_path, label, edit, message):
    bad = _graphgrow_file(tmp_path, edit)
    before = digest(tmp_path)
    for argv in (["inspect", bad.name], ["inspect", bad.name, "--json"], ["replay", "m.pt", bad.name, "-o", "r.pt"]):
        _one_line_refusal(run_cli(*argv, cwd=tmp_path), message)
    assert digest(tmp_path) == before


def test_a_named_input_in_a_message_is_written_as_the_user_writes_it(tmp_path):
    proc = run_cli(
        "inspect",
        "hf:gpt2(n_layer=1,n_embd=32,n_head=2,vocab_size=100)",
        "--input",
        "input_ids:int64[64,seq=4096]",
        "--max-memory",
        "1M",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]  # (transformers may warn about its config first)
    assert line.startswith("error: ") and "input_ids:int64[64,seq=4096]" in line and "TensorSpec" not in line, line
