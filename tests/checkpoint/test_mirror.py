"""Mirror to durable storage (issue 4): a lost output_dir comes back from the mirror,
for a local folder and for a real S3-protocol server on loopback (moto)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket

import pytest
from conftest import make_config
from support.gate import Gate, wait_for

from relaytune.atomic import MANIFEST
from relaytune.checkpoint.mirror import redact


def test_redact_hides_credentials_and_queries():
    assert redact("s3://AKIA:secret@bucket/run?token=abc") == "s3://bucket/run"
    assert redact("/content/drive/MyDrive/run") == "/content/drive/MyDrive/run"


def _killed_once_step_8_is_mirrored(fork_cli, cfg, tmp_path, env=None) -> int:
    """SIGKILL the run held after step 11 once the mirror holds step-8 (and has pruned what
    retention drops): the disk is then lost with the mirror one checkpoint behind at most."""
    gate = Gate(tmp_path, 11)
    child = fork_cli.start("train", str(cfg), env={**(env or {}), **gate.env})
    gate.wait_reached(child.pid)
    state = tmp_path / "run/mirror_state.json"

    def mirrored_step_8() -> bool:
        try:
            return json.loads(state.read_text())["last_mirrored_step"] == 8
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return False

    wait_for(mirrored_step_8, child.pid, what="step-8 in the mirror")
    os.kill(child.pid, signal.SIGKILL)
    return child.wait(120).returncode


def test_local_folder_mirror_restores_a_lost_output_dir(tmp_path, tiny_model, dropout_reference, fork_cli):
    data, ref = dropout_reference
    mirror = tmp_path / "drive"
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1, save_total_limit=1,
                      mirror_to=str(mirror))
    assert _killed_once_step_8_is_mirrored(fork_cli, cfg, tmp_path) == -9
    # Committed copies only, retention applied there too: the newest checkpoint, manifest last.
    assert sorted(p.name for p in (mirror / "checkpoints").iterdir()) == ["step-8"]
    assert (mirror / "checkpoints/step-8" / MANIFEST).is_file()
    shutil.rmtree(tmp_path / "run")  # a new session on an empty disk
    again = fork_cli.run("train", str(cfg))
    assert again.returncode == 0, again.stderr
    assert "restored step-8 from the mirror" in again.stderr
    assert "continuing from step-8" in again.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref
    assert (mirror / "final/adapter_model.safetensors").read_bytes() == ref


def test_a_broken_mirror_never_stops_training(tmp_path, tiny_model, dropout_reference, fork_cli):
    data, ref = dropout_reference
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the mirror folder should be")
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1, mirror_to=str(blocker / "run"))
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "mirror to" in r.stderr and "failed" in r.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="runs")
    yield env
    server.stop()


def test_s3_mirror_restores_a_lost_output_dir(tmp_path, tiny_model, dropout_reference, s3_server, fork_cli):
    data, ref = dropout_reference
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1, save_total_limit=2,
                      mirror_to="s3://runs/exp1")
    assert _killed_once_step_8_is_mirrored(fork_cli, cfg, tmp_path, s3_server) == -9
    shutil.rmtree(tmp_path / "run")
    again = fork_cli.run("train", str(cfg), env=s3_server)
    assert again.returncode == 0, again.stderr
    assert "restored step-8 from the mirror s3://runs/exp1" in again.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref
