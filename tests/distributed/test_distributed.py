"""Several processes on one run (CPU, gloo, 2 ranks of the tiny model): launch, exact global
batches on any process count, one checkpoint format for any count, guards agreed across ranks.

Runs go through the CLI in forked children of the pre-imported fork server (`fork_cli`); the
child is the launcher, which forks its workers through torch's elastic agent (fork start
method on the CPU), so a 2-process run costs a few seconds. Why the tolerances: support/ranks.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ONE_THREAD_ENV, REPO, run_until_done, step_records
from support.gate import Gate, stderr_says, wait_for
from support.ranks import (
    ADAPTER,
    alive,
    assert_close,
    children,
    config,
    expected_rows,
    free_port,
    rows_by_step,
    run_ok,
    wait_gone,
    wait_unlocked,
)

from relaytune.checkpoint import verify
from relaytune.faults import SESSION_VARIABLES
from relaytune.observe.metrics import read_records


def test_two_processes_train_the_same_maths_as_one(tmp_path, tiny_model, data_file, fork_cli, one_process):
    rows = tmp_path / "rows"
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=2)
    r = run_ok(fork_cli, cfg, env={"RELAYTUNE_RECORD_ROWS": str(rows)})
    assert "starting 2 workers" in r.stderr
    assert rows_by_step(rows) == expected_rows(), "the ranks' shares make up exactly the 1-process global batches"
    assert len(list(tmp_path.glob("rows.rank1.jsonl"))) == 1
    # Aligned shares: the very same additions as one process, so the same bytes.
    assert (tmp_path / "run" / ADAPTER).read_bytes() == (one_process / ADAPTER).read_bytes()
    ref = [(r["step"], r["loss"]) for r in step_records(one_process / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in step_records(tmp_path / "run/metrics.jsonl")] == ref
    sessions = (tmp_path / "run/sessions.jsonl").read_text().splitlines()
    assert len(sessions) == 2, "only rank 0 writes sessions.jsonl"
    state = json.loads((tmp_path / "run/checkpoints/step-10/trainer_state.json").read_text())
    assert state["world_size"] == 2


def test_regrouped_shares_stay_within_tolerance(tmp_path, tiny_model, data_file, fork_cli):
    """Global batch 6 = micro-batch 2 x 3: one process cuts 2+2+2, each of 2 ranks 2+1."""
    kw = dict(lora_dropout=0.0, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    run_ok(fork_cli, config(tmp_path / "one", tiny_model, data_file, **kw))
    run_ok(fork_cli, config(tmp_path / "two", tiny_model, data_file, num_gpus=2, **kw))
    worst = assert_close(tmp_path / "one/run", tmp_path / "two/run")
    print(f"regrouped 2-process vs 1-process: max abs difference {worst:.3g}")


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_process_count(tmp_path, tiny_model, data_file, fork_cli, one_process,
                                                       first, second):
    rows = tmp_path / "rows"
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=first)
    env = {"RELAYTUNE_CRASH_AT": "step:end:7", "RELAYTUNE_RECORD_ROWS": str(rows)}
    r = fork_cli.run("train", str(cfg), "max_restarts=0", env=env)
    assert r.returncode in (-9, 1), r.stderr[-3000:]  # 1 process: killed; 2: the launcher gives up (0 restarts)
    ckpts = sorted((tmp_path / "run/checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    assert ckpts and all(verify(p) is None for p in ckpts)
    resumed_from = max(int(p.name.split("-")[1]) for p in ckpts)
    written_by = json.loads((ckpts[-1] / "trainer_state.json").read_text())["world_size"]
    assert written_by == first
    for f in tmp_path.glob("rows.rank*.jsonl"):
        f.unlink()
    run_ok(fork_cli, cfg, f"num_gpus={second}", env={"RELAYTUNE_RECORD_ROWS": str(rows)})
    later = rows_by_step(rows)
    assert sorted(later) == list(range(resumed_from, 12)), "the resume continues at the checkpoint's step"
    assert later == {s: v for s, v in expected_rows().items() if s >= resumed_from}
    assert len(list(tmp_path.glob("rows.rank*.jsonl"))) == second
    assert [s["world_size"] for s in _starts(tmp_path / "run")] == [first, second]
    status = fork_cli.run("status", str(tmp_path / "run"))
    assert status.returncode == 0, status.stderr[-2000:]
    table = status.stdout[status.stdout.index("sessions:"):].splitlines()
    assert table[1].split()[-1] == "processes" and [ln.split()[-1] for ln in table[2:4]] == [str(first), str(second)]
    worst = assert_close(tmp_path / "run", one_process)
    print(f"{first} -> {second} processes from step {resumed_from}: max abs difference {worst:.3g}")


def test_sigterm_to_the_launcher_stops_every_rank_with_one_checkpoint(tmp_path, tiny_model, data_file, fork_cli,
                                                                      two_process):
    ref_run, _ = two_process
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, lora_dropout=0.1, save_steps=100)
    run = tmp_path / "run"
    gate = Gate(tmp_path, 2)
    started = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(started.pid)
    os.kill(started.pid, signal.SIGTERM)
    wait_for(stderr_says(started, "SIGTERM received"), started.pid)
    gate.open()
    r = started.wait(120)
    assert r.returncode == 75, r.stderr[-4000:]
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert ckpts == ["step-2"] and verify(run / "checkpoints/step-2") is None, ckpts
    assert step_records(run / "metrics.jsonl")[-1]["step"] == 2
    ends = [json.loads(x) for x in (run / "sessions.jsonl").read_text().splitlines()]
    assert ends[-1]["how"] == "signal"
    run_ok(fork_cli, cfg)
    assert (run / ADAPTER).read_bytes() == (ref_run / ADAPTER).read_bytes()


def test_an_oom_on_rank_1_steps_both_ranks_down(tmp_path, tiny_model, data_file, fork_cli, one_process):
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=2)
    run_ok(fork_cli, cfg, env={"RELAYTUNE_OOM_AT": "3:0", "RELAYTUNE_OOM_RANK": "1"})
    events = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    ooms = [e for e in events if e.get("event") == "oom"]
    assert [(e["step"], e["micro_batch_size"], e["was"]) for e in ooms] == [(3, 2, 4)]
    assert [r["step"] for r in step_records(tmp_path / "run/metrics.jsonl")] == list(range(1, 13))
    state = json.loads((tmp_path / "run/checkpoints/step-10/trainer_state.json").read_text())
    assert state["recovery"]["micro_batch_size"] == 2
    assert_close(tmp_path / "run", one_process)  # same rows, same maths, smaller micro-batches


def _starts(run: Path) -> list[dict]:
    """The session starts so far; read while the run writes, so a torn last line is skipped."""
    return [e for e in read_records(run / "sessions.jsonl") if e["event"] == "start"]


def test_a_killed_worker_is_restarted_and_the_run_ends_the_same(tmp_path, tiny_model, data_file, fork_cli,
                                                               two_process):
    ref_run, _ = two_process
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, lora_dropout=0.1)
    run = tmp_path / "run"
    gate = Gate(tmp_path, 5)  # step-4 is committed by then (in the background, so waited for)
    started = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(started.pid)
    wait_for(lambda: verify(run / "checkpoints/step-4") is None, started.pid, what="step-4")
    workers = [w for w in children(started.pid) if alive(w)]
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    wait_for(lambda: len(_starts(run)) == 2, started.pid, what="the restarted workers' session")
    gate.open()
    r = started.wait(180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [s["from_step"] for s in _starts(run)] == [0, 4], "the restarted workers resumed from step-4"
    assert (run / ADAPTER).read_bytes() == (ref_run / ADAPTER).read_bytes()
    assert [r["step"] for r in step_records(run / "metrics.jsonl")] == list(range(1, 13))


@pytest.mark.slow
def test_workers_killed_ten_times_then_rerun_is_exact(tmp_path, tiny_model, data_file, fork_cli, two_process):
    """Ten SIGKILLs, each to one worker at a random moment: the agent restarts both workers from the
    last committed checkpoint (every restart round has a fresh key space in the agent's store);
    once the restarts run out the command fails and the next one continues."""
    ref_run, _ = two_process
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, lora_dropout=0.1)
    run, rng = tmp_path / "run", random.Random(3)
    killed, commands, t0 = 0, 0, time.monotonic()
    gate = Gate(tmp_path, 11)  # the run cannot finish while kills are still to come
    while killed < 10:
        started = fork_cli.start("train", str(cfg), env={"RELAYTUNE_SLOW_STEP": "0.6", **gate.env})
        commands += 1
        while killed < 10 and alive(started.pid):
            newest = max((int(p.name[5:]) for p in run.glob("checkpoints/step-*") if p.name[5:].isdigit()),
                         default=0)
            time.sleep(rng.uniform(0.5, 2.5 if newest < 8 else 1.0))
            workers = [w for w in children(started.pid) if alive(w)]  # a zombie would take no kill
            if len(workers) == 2:  # not between two rounds
                os.kill(rng.choice(workers), signal.SIGKILL)
                killed += 1
        if killed == 10:
            gate.open()
        r = started.wait(180)
        assert "connectFullMesh" not in r.stderr, "a restarted round met the crashed round's keys"
        if r.returncode == 0:
            break
        assert r.returncode == 1 and "the workers failed 4 times" in r.stderr, r.stderr[-3000:]
    assert killed == 10, f"the run finished after {killed} worker kills"
    run_until_done(fork_cli, cfg)
    assert (run / ADAPTER).read_bytes() == (ref_run / ADAPTER).read_bytes()
    assert [r["step"] for r in step_records(run / "metrics.jsonl")] == list(range(1, 13))
    print(f"10 worker kills over {commands} commands, {time.monotonic() - t0:.1f} s")


def kill_launcher_and_resume(tmp_path, tiny_model, data_file, fork_cli, two_process, kills: int, seed: int):
    ref_run, _ = two_process
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, lora_dropout=0.1)
    run = tmp_path / "run"
    rng = random.Random(seed)
    killed = 0
    t0 = time.monotonic()
    gate = Gate(tmp_path, 11)  # never opened: the run cannot finish before it has been killed `kills` times
    while killed < kills:
        started = fork_cli.start("train", str(cfg), env={"RELAYTUNE_SLOW_STEP": "0.6", **gate.env})
        # Set-up takes ~1.5 s, then a step every ~0.6 s: kills land in both. Near the end of the 12 steps
        # the kills come sooner, so that they land in steps rather than in the pause after step 11.
        newest = max((int(p.name[5:]) for p in run.glob("checkpoints/step-*") if p.name[5:].isdigit()), default=0)
        time.sleep(rng.uniform(0.3, 2.8 if newest < 8 else 1.2))
        workers = children(started.pid)
        try:
            os.kill(started.pid, signal.SIGKILL)  # it cannot finish: the pause holds it
        except ProcessLookupError:
            pass  # it failed: the exit code's assertion below shows its stderr
        r = started.wait(120)
        wait_gone(workers)  # PR_SET_PDEATHSIG: the workers die with their launcher
        wait_unlocked(run)  # and one forked after `children` was read, which wait_gone cannot know
        assert r.returncode == -9, r.stderr[-3000:]
        killed += 1
        for p in (run / "checkpoints").glob("step-*") if (run / "checkpoints").is_dir() else []:
            assert verify(p) is None, f"{p.name} visible but not intact"
    run_until_done(fork_cli, cfg)
    assert (run / ADAPTER).read_bytes() == (ref_run / ADAPTER).read_bytes()
    assert [r["step"] for r in step_records(run / "metrics.jsonl")] == list(range(1, 13))
    print(f"{killed} launcher kills, {time.monotonic() - t0:.1f} s")


def test_launcher_killed_a_few_times_then_rerun_is_exact(tmp_path, tiny_model, data_file, fork_cli, two_process):
    kill_launcher_and_resume(tmp_path, tiny_model, data_file, fork_cli, two_process, kills=3, seed=1)


@pytest.mark.slow
def test_launcher_killed_ten_times_then_rerun_is_exact(tmp_path, tiny_model, data_file, fork_cli, two_process):
    kill_launcher_and_resume(tmp_path, tiny_model, data_file, fork_cli, two_process, kills=10, seed=2)


def test_two_nodes_under_external_torchrun_match_one_node(tmp_path, tiny_model, data_file, two_process):
    """`torchrun --nnodes 2 --rdzv-backend c10d` twice on this machine, one process each, one
    shared output_dir: relaytune joins instead of launching; global rank 0 commits."""
    ref_run, _ = two_process
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.1)  # num_gpus auto: torchrun decides
    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, **ONE_THREAD_ENV, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("RELAYTUNE_") or k in SESSION_VARIABLES}
    nodes = []
    for node in (0, 1):
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "relaytune-test",
               "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "--max-restarts", "0",
               "-m", "relaytune.cli", "train", str(cfg)]
        nodes.append(subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert (tmp_path / "run" / ADAPTER).read_bytes() == (ref_run / ADAPTER).read_bytes()
