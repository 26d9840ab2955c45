"""Shared fixtures: a tiny random model built in-process, data files, configs, CLI runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relaytune.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer llama, hidden 64, with a byte-level BPE tokenizer and ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_rows(n: int = 40, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [{"role": "user", "content": f"{a} plus {b}"},
                                  {"role": "assistant", "content": f"{a + b}"}]})
    return rows


@pytest.fixture
def chat_data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", chat_rows())


def make_config(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    """A small, fast config file; returns its path."""
    cfg = {
        "model": str(model), "dataset": str(data), "output_dir": str(tmp_path / "run"),
        "max_steps": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "save_steps": 4, "logging_steps": 1, "learning_rate": 1e-3, "save_every_seconds": 0,
    }
    cfg.update(overrides)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m relaytune.cli ARGS` in a child process, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "relaytune.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


# --- appended: fast CLI runs in forked children of a pre-imported process ----------------
#
# A CLI run costs ~5 s of imports on these machines; the training itself takes well under a
# second. `ForkServer` imports relaytune, torch, transformers, peft and bitsandbytes once, in a
# process that never runs a torch kernel (libgomp hangs in a child forked after an OpenMP
# region), then forks one child per run. The child calls `relaytune.cli.main` exactly as
# `python -m relaytune.cli` would, with its own environment, stdout/stderr files and freshly
# seeded Python/NumPy RNGs, and exits with main's return code; a SIGKILL shows as -9, as in
# subprocess. test_crash.py::test_real_processes_crash_and_resume checks it against real processes.

_FORK_SERVER_SOURCE = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w", buffering=1)  # the reply channel; fd 1 itself goes to /dev/null
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
import torch, transformers, peft, safetensors.torch, bitsandbytes  # noqa: F401,E401
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
import relaytune.cli, relaytune.training.recipe  # noqa: F401,E401
out.write(json.dumps({"ready": os.getpid()}) + "\n")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
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
                code = relaytune.cli.main(req["argv"])
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
    out.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    out.write(json.dumps({"rc": rc}) + "\n")
'''


ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ForkedRun:
    """A CLI run in progress in a forked child; `pid` may be killed by the caller."""

    def __init__(self, server: "ForkServer", argv: list[str], pid: int, files: tuple[Path, Path]):
        self.server, self.argv, self.pid, self.files = server, argv, pid, files

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        import signal

        try:
            reply = self.server.reply(timeout)
        except TimeoutError:
            os.kill(self.pid, signal.SIGKILL)
            self.server.reply(60)
            self.server.running = None
            raise TimeoutError(f"relaytune {' '.join(self.argv)} ran over {timeout} s") from None
        self.server.running = None
        out, err = (p.read_text(encoding="utf-8", errors="replace") for p in self.files)
        return subprocess.CompletedProcess(["relaytune", *self.argv], reply["rc"], out, err)


class ForkServer:
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
        for k in [k for k in env if k.startswith("RELAYTUNE_")]:
            del env[k]
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER_SOURCE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env, cwd=str(workdir))
        self.ready = False

    def reply(self, timeout: float = 300) -> dict:
        """The server's next JSON line (unbuffered reads, so select() never misses a line)."""
        import select
        import time

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
            import signal

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
        child_env = {k: None for k in ("RELAYTUNE_CRASH_AT", "RELAYTUNE_FAIL_AT", "RELAYTUNE_OOM_AT",
                                       "RELAYTUNE_NAN_AT", "RELAYTUNE_FILL_AT", "RELAYTUNE_SLOW_STEP")}
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


@pytest.fixture(scope="session")
def fork_cli(tmp_path_factory):
    """`fork_cli.run("train", cfg, env={...})`: a CLI run without the import cost of a new process."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield server
    server.close()


def step_records(metrics_path: Path) -> list[dict]:
    """The per-step records of a metrics.jsonl (records with an "event" key are events)."""
    records = [json.loads(line) for line in Path(metrics_path).read_text(encoding="utf-8").splitlines()
               if line.strip()]
    return [r for r in records if "event" not in r and "eval_loss" not in r]


def run_until_done(cli, cfg: Path, limit: int = 10, **kwargs) -> list[subprocess.CompletedProcess]:
    """Re-run `relaytune train CFG` (no fault switches) until it exits 0; returns every result."""
    results = []
    for _ in range(limit):
        r = cli.run("train", str(cfg), **kwargs)
        results.append(r)
        if r.returncode == 0:
            return results
        assert r.returncode in (-9, 75), f"rc {r.returncode}:\n{r.stderr[-3000:]}"
    raise AssertionError(f"no exit 0 after {limit} runs")


@pytest.fixture
def one_thread():
    """Run the test with one intra-op torch thread (restored after): in-process training on a
    busy 2-core machine is many times slower with OpenMP's spinning second thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def dropout_reference(tmp_path_factory, tiny_model, fork_cli):
    """(data file, final adapter bytes) of an uninterrupted forked run of make_config's defaults
    with lora_dropout 0.1, for the fault tests that must end byte-identical to it."""
    tmp = tmp_path_factory.mktemp("dropout-ref")
    data = write_jsonl(tmp / "data.jsonl", chat_rows())
    cfg = make_config(tmp, tiny_model, data, lora_dropout=0.1)
    assert fork_cli.run("train", str(cfg)).returncode == 0
    return data, (tmp / "run/final/adapter_model.safetensors").read_bytes()
