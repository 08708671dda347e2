"""A warm parent for the CLI processes the tests start: `graphgrow` runs in a fresh process forked from it.

Every `python -m graphgrow.cli …` a test starts spends ~2 s of CPU importing torch and graphgrow before it reads its
arguments, and the suite starts a few hundred of them. The server below imports what the CLI imports at start
(nothing more: no torch op runs, no thread starts) and then, per request, forks a child that sets up what a new
process would have (argv, working directory, environment, sys.path from it, SIGINT at its default as from a terminal,
stdout/stderr to files, stdin empty), runs `graphgrow.cli` as `__main__`, runs the exit handlers, and exits with the
code Python would have given. Exit codes, output and signals are the child's own: a real process, started warm.

Protocol (one server per test worker, one request at a time): a JSON line on the server's stdin
{"argv", "cwd", "env", "out", "err"}; the server answers {"pid": …} when the child runs and {"rc": …} when it is done
(rc as subprocess gives it: negative for a signal). `GRAPHGROW_TEST_REAL_PROCESS=1` makes `run` start `python -m
graphgrow.cli` instead, for a run that owes nothing to this module.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(request: dict, fds: list[int] | None = None) -> None:
    """In the forked child: become the process `python -m graphgrow.cli ARGV` (or `python -c CODE ARGV`, `python
    SCRIPT ARGV`) would have been, run it, exit. `fds`: the caller's stdin, stdout and stderr (else files)."""
    import resource
    import runpy
    import traceback
    import types

    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own handler, as at a terminal
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *_BASE_PATH]
        if fds is not None:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for target, path in ((1, request.get("stdout") or request["out"]), (2, request["err"])):
                flags = os.O_WRONLY if path == request.get("stdout") else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                f = os.open(path, flags, 0o600)
                os.dup2(f, target)
                os.close(f)
        if request.get("fsize") is not None:  # `ulimit -f` (SIGXFSZ stays ignored, as Python sets it)
            resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
        try:
            if request.get("console") is not None:  # the installed `graphgrow` script, at path `console`
                sys.argv = [request["console"], *request["argv"]]
                sys.path[0] = os.path.dirname(request["console"])
                from graphgrow.cli import main as console_main

                sys.exit(console_main())
            elif request.get("script") is not None:  # `python SCRIPT ARGV`: sys.path[0] is the script's folder
                script = os.path.abspath(request["script"])
                sys.argv = [request["script"], *request["argv"]]
                sys.path[0] = os.path.dirname(script)
                runpy.run_path(request["script"], run_name="__main__")  # sys.argv[0] as given
            elif request.get("code") is None:
                sys.argv = ["graphgrow", *request["argv"]]
                runpy.run_module("graphgrow.cli", run_name="__main__", alter_sys=True)
            else:  # `python -c CODE ARGV`: sys.path[0] is '' and __main__ a fresh module
                sys.argv = ["-c", *request["argv"]]
                sys.path[0] = ""
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(request["code"], "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            _exit_handlers()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python does: die of the signal, rc -2
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        _exit_handlers()
    finally:
        os._exit(code & 0xFF)


def _exit_handlers() -> None:

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_BASE_PATH: list[str] = []


def _as_from_a_terminal() -> None:
    """A child's preexec_fn: SIGINT at its default, as a terminal starts a command. A background launch (`cmd &` in a
    script, CI runners) starts pytest with SIGINT ignored, and an ignored signal is inherited across exec: the CLI
    would then rightly ignore a Ctrl-C, and the tests of what a Ctrl-C does would fail for the launcher's reason."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def serve() -> None:
    """The server's loop: import what the CLI imports at start, then fork one child per request line."""
    global _BASE_PATH
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the children's stdout is theirs; nothing of the server's may reach it
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH = [p for p in sys.path[1:] if p not in own]

    import graphgrow.cli.commands  # noqa: F401  (what `python -m graphgrow.cli` imports before it reads argv)

    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def serve_socket(path: str) -> None:
    """The server for commands a shell runs (tests/test_docs.py's blocks): a `graphgrow` on PATH (the shim `bin_dir`
    writes) connects to `path` and passes its argv, working directory, environment and its own stdin, stdout and
    stderr; a handler forked per connection forks the CLI process on those descriptors, waits for it and answers its
    exit code, so pipelines of several commands run at once."""
    import socket

    global _BASE_PATH
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH = [p for p in sys.path[1:] if p not in own]
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)

    import graphgrow.cli.commands  # noqa: F401  (what `python -m graphgrow.cli` imports before it reads argv)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                _child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
            os._exit(0)
        conn.close()


_SHIM = """#!{python} -S
# `graphgrow` for the tests' shells: the command runs forked from a warm server (tests/cli_fork.py)
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({socket_path!r})
request = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "console": sys.argv[0]}}
socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
rc = json.loads(s.recv(1 << 16))["rc"]
if rc < 0:
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc)
"""


class _ShellServer:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="gg-cli-bin-")
        socket_path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import cli_fork; cli_fork.serve_socket({socket_path!r})"],
            cwd=HERE,
            stdin=subprocess.DEVNULL,
            preexec_fn=_as_from_a_terminal,
        )
        shim = Path(self.folder) / "bin" / "graphgrow"
        shim.parent.mkdir()
        shim.write_text(_SHIM.format(python=sys.executable, socket_path=socket_path))
        shim.chmod(0o755)
        self.bin = str(shim.parent)
        for _ in range(1200):  # the server binds once it has imported graphgrow
            if os.path.exists(socket_path) or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.exists(socket_path):
            raise RuntimeError("the CLI fork server for shells did not start")

    def close(self) -> None:
        import shutil

        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


_shell_server: _ShellServer | None = None


def bin_dir() -> str:
    """A folder holding a `graphgrow` that runs forked from a warm server: first on a shell's PATH, the commands of a
    script run as `graphgrow` does, without each importing torch (GRAPHGROW_TEST_REAL_PROCESS=1: the venv's own)."""
    global _shell_server
    if os.environ.get("GRAPHGROW_TEST_REAL_PROCESS") == "1":
        return str(Path(sys.executable).parent)
    if _shell_server is None or _shell_server.proc.poll() is not None:
        _shell_server = _ShellServer()
        atexit.register(_shell_server.close)
    return _shell_server.bin


class _Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import cli_fork; cli_fork.serve()"],
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=_as_from_a_terminal,
        )

    def close(self) -> None:
        """End the server and reap it (its CPU time, and its children's, then count as this process's children's)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, deadline: float | None) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], deadline)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the CLI fork server died")
        return json.loads(line)

    def run(self, argv: list[str], cwd: str, env: dict, timeout: float, **extra) -> subprocess.CompletedProcess:
        assert self.proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="gg-cli-") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            request = {"argv": argv, "cwd": cwd, "env": env, "out": out, "err": err, **extra}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(30)["pid"]
            try:
                rc = self._reply(timeout)["rc"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(30)
                raise subprocess.TimeoutExpired(["graphgrow", *argv], timeout) from None
            printed = "" if extra["stdout"] else Path(out).read_text()
            return subprocess.CompletedProcess(["graphgrow", *argv], rc, printed, Path(err).read_text())


_server: _Server | None = None


def run(
    argv: list[str],
    cwd: str | os.PathLike | None = None,
    env: dict | None = None,
    *,
    code: str | None = None,
    script: str | os.PathLike | None = None,
    stdout: str | os.PathLike | None = None,
    fsize_kb: int | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`python -m graphgrow.cli ARGV` (or `python -c CODE ARGV`, `python SCRIPT ARGV`) in `cwd` with exactly the
    environment `env` (default: this process's), forked from the warm server. `stdout`: a path the child writes its
    standard output to (opened without truncating, as an inherited open file; the result's stdout is then empty);
    `fsize_kb`: `ulimit -f`."""
    global _server
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    env = dict(os.environ) if env is None else env
    stdout = os.fspath(stdout) if stdout is not None else None
    if os.environ.get("GRAPHGROW_TEST_REAL_PROCESS") == "1":
        return _real(argv, cwd, env, code, script, stdout, fsize_kb, timeout)
    if _server is None or not _server.alive():
        _server = _Server()
        atexit.register(_server.close)
    fsize = None if fsize_kb is None else fsize_kb * 1024
    script = os.fspath(script) if script is not None else None
    return _server.run(list(argv), cwd, env, timeout, code=code, script=script, stdout=stdout, fsize=fsize)


def _real(argv, cwd, env, code, script, stdout, fsize_kb, timeout) -> subprocess.CompletedProcess:
    """The same run as a process started from nothing (GRAPHGROW_TEST_REAL_PROCESS=1)."""
    how = [os.fspath(script)] if script is not None else ["-c", code] if code is not None else ["-m", "graphgrow.cli"]
    cmd = [sys.executable, *how, *argv]
    if fsize_kb is not None:
        cmd = ["bash", "-c", f'ulimit -f {fsize_kb}; exec "$0" "$@"', *cmd]
    with open(stdout, "w") if stdout else open(os.devnull) as sink:
        proc = subprocess.run(
            cmd,
            stdout=sink if stdout else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            timeout=timeout,
            preexec_fn=_as_from_a_terminal,
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout or "", proc.stderr)
