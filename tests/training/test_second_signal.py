"""Issue 15 item 8 and issue 14 item 4: a second signal after the stop checkpoint is committed still
exits 75; a second one within a few seconds during a step abandons it (exit 75, nothing saved, the
last committed checkpoint named); "committed X s after the request" counts from the signal."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import make_config
from support.gate import Gate, stderr_says, wait_for

from relaytune.atomic import verify
from relaytune.training.stops import Abandoned, StopRequest


def _committed(run: Path):
    return lambda: any((p / "manifest.json").exists() for p in (run / "checkpoints").glob("step-*")) \
        if (run / "checkpoints").exists() else False


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_second_signal_after_the_stop_checkpoint_still_exits_75(signame, tmp_path, tiny_model, chat_data,
                                                                  fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=10_000, save_steps=10_000)
    run = tmp_path / "run"
    sig = getattr(signal, signame)
    gate = Gate(tmp_path, 2)
    child = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(child.pid)  # held after step 2's record
    os.kill(child.pid, sig)
    wait_for(stderr_says(child, f"{signame} received: stopping after this step"), child.pid)
    time.sleep(1.0)  # the step ends, and the save begins, a second or more after the request
    gate.open()
    wait_for(_committed(run), child.pid, what="the stop checkpoint")
    try:
        os.kill(child.pid, sig)  # the stop checkpoint is committed: the process is on its way out
    except ProcessLookupError:
        pass
    r = child.wait(120)
    assert r.returncode == 75, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
    took = float(re.search(r"committed ([0-9.]+)s after the request", r.stderr).group(1))
    assert took >= 0.95, r.stderr[-2000:]  # measured from the signal, not from the save


def test_a_second_ctrl_c_during_a_step_abandons_it(tmp_path, tiny_model, chat_data, fork_cli):
    cfg = make_config(tmp_path, tiny_model, chat_data, max_steps=10_000, save_steps=2)
    run = tmp_path / "run"
    gate = Gate(tmp_path, 3)
    child = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(child.pid)  # held after step 3's record, before its stop check
    wait_for(_committed(run), child.pid, what="step-2, committed in the background")
    os.kill(child.pid, signal.SIGINT)
    wait_for(stderr_says(child, "SIGINT received: stopping after this step"), child.pid)
    os.kill(child.pid, signal.SIGINT)  # handled apart from the first, which the kernel could otherwise merge
    wait_for(stderr_says(child, "SIGINT received again: abandoning"), child.pid)
    gate.open()
    r = child.wait(120)
    assert r.returncode == 75, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "abandoned" in r.stderr and "the last committed checkpoint, step-2, is intact" in r.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-2"] and verify(run / "checkpoints/step-2") is None  # step 3 was not saved


def test_the_abandon_flag_is_raised_only_at_a_safe_point_and_only_soon_after(capsys):
    stop = StopRequest()
    stop._handle(signal.SIGINT, None)
    stop.check()  # one signal: go on to the end of the step
    stop._handle(signal.SIGINT, None)
    with pytest.raises(Abandoned):
        stop.check()
    late = StopRequest()
    late._handle(signal.SIGTERM, None)
    late.at -= late.ABANDON_WINDOW + 1
    late._handle(signal.SIGTERM, None)
    late.check()
    saving = StopRequest()
    saving._handle(signal.SIGINT, None)
    saving.saving = True
    saving._handle(signal.SIGINT, None)
    saving.check()  # the stop checkpoint is being written: let it commit
    assert "being written" in capsys.readouterr().err


def test_safe_points_are_the_decoder_layers_even_beside_a_longer_module_list(tiny_model):
    """A model with a longer ModuleList beside its decoder (a vision tower, say) is still abandoned
    between decoder layers, the blocks every step runs through."""
    import torch
    from transformers import AutoModelForCausalLM

    from relaytune.training.stops import safe_points

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = list(model.model.layers)
    model.tower = torch.nn.ModuleList(torch.nn.Identity() for _ in range(len(layers) + 5))
    assert safe_points(model) == [model, *layers]
    plain = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3))
    assert safe_points(plain) == [plain, *plain[0]], "no decoder: the longest ModuleList"


def test_a_signal_inside_a_write_to_stderr_still_says_so(monkeypatch, capfd):
    """A signal that lands while the progress bar writes to stderr: the buffered stream refuses the
    handler's reentrant write (the RuntimeError below, as CPython raises it), and the message once
    vanished; it must still reach the terminal."""
    import relaytune.training.stops as stops

    def reentrant(message):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    monkeypatch.setattr(stops, "warn", reentrant)
    StopRequest()._handle(signal.SIGTERM, None)
    assert "relaytune: warning: SIGTERM received: stopping after this step, with a checkpoint" in capfd.readouterr().err


def test_a_committed_stop_keeps_ignoring_signals_only_where_the_process_exits_next():
    """The CLI's process exits when train() returns: between the handlers' removal and the exit a
    late signal would otherwise meet Python's defaults (exit 130 or 143 instead of 75)."""
    from relaytune.training import stops

    before = {sig: signal.getsignal(sig) for sig in stops.STOP_SIGNALS}

    def uninstalled(committed: bool) -> dict:
        request = StopRequest().install()
        request.committed = committed
        request.uninstall()
        return {sig: signal.getsignal(sig) for sig in stops.STOP_SIGNALS}

    try:
        with stops.exit_follows():
            assert uninstalled(committed=False) == before
            assert set(uninstalled(committed=True).values()) == {signal.SIG_IGN}
        for sig, handler in before.items():
            signal.signal(sig, handler)
        assert uninstalled(committed=True) == before, "the Python API gets its handlers back"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
