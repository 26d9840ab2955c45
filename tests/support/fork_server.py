"""Fast CLI runs in forked children of a pre-imported process.

A CLI run costs ~5 s of imports on these machines; the training itself takes well under a
second. The server (`serve`, run as `python tests/support/fork_server.py`) imports relaytune,
torch, transformers, peft and bitsandbytes once, in a process that never runs a torch kernel
(libgomp hangs in a child forked after an OpenMP region), then forks one child per request.
The child calls `relaytune.cli.main` exactly as `python -m relaytune.cli` would, with its own
environment, working directory, stdout/stderr files and freshly seeded Python/NumPy RNGs, and
exits with main's return code; a SIGKILL shows as -9, as in subprocess.
test_crash.py::test_real_processes_crash_and_resume checks it against real processes.

Protocol, one JSON object a line: the server says {"ready": pid} once its imports are done;
for each request {"argv", "env", "cwd", "stdout", "stderr"} on its stdin it answers {"pid"}
when the child starts and {"rc"} when the child ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from relaytune.faults import SESSION_VARIABLES, VARIABLES

ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# --- server side: runs in its own process ------------------------------------------------


def serve() -> None:
    """Import everything once, then fork one child per request line on stdin until EOF."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the reply channel; fd 1 itself goes to /dev/null
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import relaytune.cli
    import relaytune.training.recipe  # noqa: F401

    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, null, relaytune.cli.main)  # never returns
        out.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"rc": rc}) + "\n")


def _child(req: dict, null: int, main: Callable[[list[str]], int]) -> None:
    """In the forked child: set up stdio, environment, cwd and RNGs, run `main(argv)`, exit."""
    try:
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for k, v in req["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.chdir(req["cwd"])
        import random

        import numpy as np

        random.seed()
        np.random.seed()
        try:
            code = main(req["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# --- client side: used by the tests ------------------------------------------------------


class ForkedRun:
    """A CLI run in progress in a forked child; `pid` may be killed by the caller."""

    def __init__(self, server: ForkServer, argv: list[str], pid: int, files: tuple[Path, Path]):
        self.server, self.argv, self.pid, self.files = server, argv, pid, files

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            reply = self.server.reply(timeout)
        except TimeoutError:
            hung = process_tree(self.pid)  # before the kill: what each process of the run was waiting in
            os.kill(self.pid, signal.SIGKILL)
            self.server.reply(60)
            self.server.running = None
            err = self.files[1].read_text(encoding="utf-8", errors="replace")[-3000:]
            raise TimeoutError(f"relaytune {' '.join(self.argv)} ran over {timeout} s\nits processes then:\n{hung}"
                               f"\nthe end of its stderr:\n{err}") from None
        self.server.running = None
        out, err = (p.read_text(encoding="utf-8", errors="replace") for p in self.files)
        return subprocess.CompletedProcess(["relaytune", *self.argv], reply["rc"], out, err)


def process_tree(root: int) -> str:
    """One line per process under `root` (itself included): pid, state, kernel wait channel, threads,
    command line; to say where a run that timed out was stuck."""
    lines, todo = [], [root]
    while todo:
        pid = todo.pop()
        proc = Path(f"/proc/{pid}")
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            wchan = (proc / "wchan").read_text() or "-"
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            lines.append(f"  {pid} {stat[0]} {wchan} threads={stat[17]} {cmd}")
            for task in (proc / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return "\n".join(lines)


class ForkServer:
    """The test side of the server: starts it, sends requests, reads replies."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.count = 0
        self.running: ForkedRun | None = None
        self._buffer = b""
        # One intra-op thread: on a small shared machine, OpenMP's spinning threads make a run
        # several times slower when other processes compete for the cores. CPU results can
        # differ in the last bits between thread counts, so runs compared with forked ones must
        # use the same setting (ONE_THREAD_ENV).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD_ENV}
        for k in [k for k in env if k.startswith("RELAYTUNE_") and k not in SESSION_VARIABLES]:
            del env[k]
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env, cwd=str(workdir))
        self.ready = False

    def reply(self, timeout: float = 300) -> dict:
        """The server's next JSON line (unbuffered reads, so select() never misses a line)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no reply from the fork server")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server exited (rc {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, *argv: str, env: dict | None = None) -> ForkedRun:
        """Start `relaytune ARGV` in a forked child; `env` entries set (or with None, unset) variables."""
        if self.running is not None:  # a test that failed before waiting for its run
            try:
                os.kill(self.running.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.running.wait(60)
        if not self.ready:
            self.reply(600)  # the imports
            self.ready = True
        self.count += 1
        files = (self.workdir / f"run{self.count}.out", self.workdir / f"run{self.count}.err")
        child_env: dict[str, str | None] = dict.fromkeys(VARIABLES)  # no fault plan unless the test sets one
        child_env.update(env or {})
        req = {"argv": list(argv), "env": child_env, "cwd": os.getcwd(),
               "stdout": str(files[0]), "stderr": str(files[1])}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        self.running = ForkedRun(self, list(argv), self.reply(60)["pid"], files)
        return self.running

    def run(self, *argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """Like run_cli(ARGV), in a forked child: returncode, stdout, stderr."""
        return self.start(*argv, env=env).wait(timeout)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    serve()
