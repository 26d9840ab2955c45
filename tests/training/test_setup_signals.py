"""A stop signal during the set-up (imports, data, the model loading), before the loop's handlers are
in place, leaves at once with exit 75 and a line saying so, never a traceback or a bare signal death;
the re-run then trains as if nothing happened. Ctrl-C in the other commands: one line, exit 130."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import make_config
from support.gate import Gate

from relaytune import cli
from relaytune.errors import StoppedEarly
from relaytune.training import stops


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", pytest.param("SIGHUP", marks=pytest.mark.slow),
                                     pytest.param("SIGUSR1", marks=pytest.mark.slow)])
def test_a_stop_signal_while_the_model_loads_exits_75_and_the_rerun_is_exact(signame, tmp_path, tiny_model,
                                                                             dropout_reference, fork_cli):
    data, ref = dropout_reference
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1)
    gate = Gate(tmp_path, "load")
    child = fork_cli.start("train", str(cfg), env=gate.env)
    gate.wait_reached(child.pid)  # held in the set-up, just before the model loads
    t0 = time.monotonic()
    os.kill(child.pid, getattr(signal, signame))
    r = child.wait(120)
    assert r.returncode == 75, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30  # left at once, not after loading and a step
    assert r.stderr.rstrip().endswith(f"relaytune: {signame} received before training began: the run is as it "
                                      "was; run the same command again to continue"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())
    again = fork_cli.run("train", str(cfg))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref


@pytest.fixture
def stop_signals_restored():
    saved = {sig: signal.getsignal(sig) for sig in stops.STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _deliver(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs the handler at the next bytecode boundary


def test_the_set_up_guard_raises_stopped_early_then_ignores_the_stop_signals(stop_signals_restored):
    with pytest.raises(StoppedEarly) as caught:
        with stops.leave_setup_at_once():
            _deliver(signal.SIGTERM)
            pytest.fail("the set-up went on after SIGTERM")
    assert str(caught.value) == "SIGTERM received before training began: the run is as it was"
    assert caught.value.exit_code == 75 and caught.value.how == "signal"
    # The process exits next: a late signal must not end it with another code.
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in stops.STOP_SIGNALS)


def test_once_the_run_s_own_handlers_took_over_the_guard_leaves_nothing(stop_signals_restored):
    before = signal.getsignal(signal.SIGINT)
    with stops.leave_setup_at_once():
        stops.take_over_from_setup()  # what StopRequest.install and the launcher do
        _deliver(signal.SIGINT)  # train() returning, its handlers handed back: ignored, no exception
    assert signal.getsignal(signal.SIGINT) is before


def test_the_loop_s_stop_request_takes_over_from_the_guard(stop_signals_restored):
    with stops.leave_setup_at_once():
        with stops.StopRequest() as stop:
            _deliver(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        _deliver(signal.SIGTERM)  # after the loop handed its handlers back: the guard no longer raises


def test_ctrl_c_in_another_command_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    from relaytune.commands import status

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(status, "run", interrupted)
    assert cli.main(["status", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "relaytune: status interrupted\n"
