"""A worker whose launcher was SIGKILLed before the worker asked to die with it (world.die_with_parent)
kills itself instead of living on, re-parented, with the run's lock it inherited: the re-run would be
refused for as long as it waits for its dead peers (the process group's 30-minute timeout). CI's
ten-launcher-kill test met this once (the lock still held 30 s after a kill).

Real processes and a real SIGKILL: a stand-in launcher starts a worker and is killed before the worker
makes its request; the worker then reports whether it survived the request. And a forked worker makes
the request without looking libc up (the launcher did, before the fork)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from support.ranks import alive

from relaytune.distributed.world import LAUNCHER_PID, die_with_parent, libc_prctl

WORKER = textwrap.dedent("""
    import os, sys, time
    launcher = int(sys.argv[1])
    deadline = time.monotonic() + 10
    while os.getppid() == launcher and time.monotonic() < deadline:  # until the launcher is gone
        time.sleep(0.01)
    from relaytune.distributed.world import die_with_parent
    die_with_parent()
    with open(sys.argv[2], "w") as f:
        f.write("survived")
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    env = dict(os.environ)
    if sys.argv[3] == "tells":
        env[sys.argv[4]] = str(os.getpid())
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]], env=env)
    print(worker.pid, flush=True)
    time.sleep(60)  # killed by the test before the worker makes its request
""")


def orphan(tmp_path, tells: str) -> tuple[bool, int]:
    """Whether the worker outlived its request, and its pid."""
    marker = tmp_path / f"worker-{tells}"
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(marker), tells, LAUNCHER_PID],
                                stdout=subprocess.PIPE, text=True, env=env)
    worker = int(launcher.stdout.readline())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while alive(worker) and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # a survivor has written its marker by now
    survived = marker.exists()
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
    return survived, worker


def test_a_worker_whose_launcher_died_before_its_request_kills_itself(tmp_path):
    survived, pid = orphan(tmp_path, "tells")
    assert not survived
    assert not alive(pid)


def test_without_the_launcher_s_pid_the_request_cannot_tell_its_parent_died(tmp_path):
    """Under an external torchrun (no RELAYTUNE_LAUNCHER_PID) only getppid() is known, read after the
    launcher died: the worker lives on. This is what the launcher's pid is for."""
    survived, _ = orphan(tmp_path, "silent")
    assert survived


def test_a_forked_worker_asks_without_looking_up_libc(monkeypatch):
    """The launcher looks prctl up before it forks (launch.py); the forked worker only calls it."""
    import ctypes

    prctl = libc_prctl()  # as the launcher does

    def lookup(*args, **kwargs):
        raise RuntimeError("looked up libc after the fork")

    monkeypatch.setattr(ctypes, "CDLL", lookup)
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    pid = os.fork()
    if pid == 0:  # the worker: ask, then report the signal its parent's death would send
        try:
            die_with_parent()
            asked = ctypes.c_int()
            prctl(2, ctypes.byref(asked))  # PR_GET_PDEATHSIG
            os._exit(asked.value)
        except BaseException:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == signal.SIGKILL
