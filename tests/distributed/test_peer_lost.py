"""A worker of relaytune's launcher that gets SIGTERM after a peer died exits at once (training/stops.py,
distributed/launch.peer_lost), once a checkpoint being committed in the background has finished: its
step can never finish, and the agent would SIGKILL it only 30 s later (measured on 2 H200s). With every
peer alive the same signal still stops after the step.

Real processes and real signals: a choreographer process starts two workers (as the agent does),
SIGKILLs one, reaps it (as torch's ProcessContext.join does before it terminates the others), then
sends the survivor SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import sys, time
    from relaytune.training.stops import StopRequest
    stop = StopRequest().install()
    stop.finish_writes = lambda: (time.sleep(0.5), print("background write committed", flush=True))
    print("ready", flush=True)
    while not stop.requested:
        time.sleep(0.02)
    print("stopping after the step", flush=True)
    time.sleep(60)  # a step that never ends: its collective waits for the dead peer
""")

CHOREOGRAPHER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    worker, kill_peer = sys.argv[1], sys.argv[2] == "kill"
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", WORLD_SIZE="2", RELAYTUNE_LAUNCHED="1")
    procs = [subprocess.Popen([sys.executable, "-c", worker], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    if kill_peer:
        procs[1].kill()
        procs[1].wait()
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    try:
        rc = procs[0].wait(timeout=30 if kill_peer else 4)
    except subprocess.TimeoutExpired:
        rc = None
    seconds = time.monotonic() - t0
    line = procs[0].stdout.readline().strip() if rc is None else procs[0].stdout.read().strip()
    for p in procs:
        p.kill()
        p.wait()
    print(json.dumps({"rc": rc, "seconds": seconds, "stdout": line, "stderr": procs[0].stderr.read()}))
""")


def _run(tmp_path, kill_peer: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHOREOGRAPHER, WORKER, "kill" if kill_peer else "keep"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_after_a_peer_died_sigterm_ends_the_worker_at_once(tmp_path):
    got = _run(tmp_path, kill_peer=True)
    # At once: well before the step (60 s) or the agent's SIGKILL (30 s) would end it; the bound
    # leaves a loaded machine room to start the interpreter's exit.
    assert got["rc"] == 1 and got["seconds"] < 25, got
    assert got["stdout"] == "background write committed", "a checkpoint in flight may finish first"
    assert ("SIGTERM received after another worker died: exiting now, the launcher restarts the workers from "
            "the last committed checkpoint") in got["stderr"]


def test_with_every_peer_alive_sigterm_still_stops_after_the_step(tmp_path):
    got = _run(tmp_path, kill_peer=False)
    assert got["rc"] is None, got  # still in its step after 4 s: it stops after it, with a checkpoint
    assert got["stdout"] == "stopping after the step"
    assert "SIGTERM received: stopping after this step, with a checkpoint" in got["stderr"]
