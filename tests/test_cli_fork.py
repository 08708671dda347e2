"""The warm CLI the tests use (tests/cli_fork.py) gives what a process started from nothing gives: the same exit code,
standard output and error, for a run, a refusal, a factory found through PYTHONPATH, `python -c`, a script, a shell
pipeline, and a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import cli_fork
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _real(argv: list[str], cwd: Path, env: dict, *how: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *(how or ("-m", "graphgrow.cli")), *argv], capture_output=True, text=True, cwd=cwd, env=env
    )


CASES = {
    "help": ["--help"],
    "a bad pass spec": ["mutate", "nothing.pt", "--pass", "grow_width(by=)"],
    "a missing file": ["inspect", "missing.pt", "--input-shape", "1,4"],
    "a factory on PYTHONPATH": ["inspect", "factories:square_linear", "--input-shape", "2,4", "--json"],
}


@pytest.mark.parametrize("argv", CASES.values(), ids=list(CASES))
def test_a_forked_run_is_the_run_of_a_fresh_process(argv, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "COLUMNS": "100"}
    forked = cli_fork.run(argv, tmp_path, env)
    real = _real(argv, tmp_path, env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def test_python_c_and_a_script_see_what_a_fresh_interpreter_sees(tmp_path):
    code = "import sys, os; print(sys.argv, repr(sys.path[0]), os.getcwd(), __name__); sys.exit(3)"
    forked = cli_fork.run(["a", "b"], tmp_path, dict(os.environ), code=code)
    real = _real(["a", "b"], tmp_path, dict(os.environ), "-c", code)
    assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout) == (3, real.stdout)
    (tmp_path / "s.py").write_text("import sys\nprint(sys.argv, sys.path[0], __name__)\nraise SystemExit('bye')\n")
    forked = cli_fork.run(["x"], tmp_path, dict(os.environ), script="s.py")
    real = _real(["x"], tmp_path, dict(os.environ), "s.py")
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.stderr == "bye\n"


def test_a_shell_pipeline_runs_the_warm_graphgrow_with_its_exit_code(tmp_path):
    if os.environ.get("GRAPHGROW_TEST_REAL_PROCESS") == "1":
        pytest.skip("the shim is not used")
    env = {**os.environ, "PATH": cli_fork.bin_dir() + os.pathsep + os.environ["PATH"]}
    script = "graphgrow --help | head -n 1; graphgrow inspect missing.pt --input-shape 1,4; echo rc=$?"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    real = _real(["inspect", "missing.pt", "--input-shape", "1,4"], tmp_path, env)
    assert proc.stdout.splitlines()[0].startswith("Usage: graphgrow")
    assert proc.stdout.splitlines()[-1] == f"rc={real.returncode}" and real.returncode == 2
    assert proc.stderr == real.stderr


def test_a_signal_ends_the_forked_process_as_it_ends_a_fresh_one(tmp_path):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert cli_fork.run([], tmp_path, code=code).returncode == -signal.SIGTERM
    code = "raise KeyboardInterrupt"
    forked = cli_fork.run([], tmp_path, code=code)
    assert forked.returncode == _real([], tmp_path, dict(os.environ), "-c", code).returncode == -signal.SIGINT
