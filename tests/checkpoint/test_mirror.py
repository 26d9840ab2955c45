"""Mirror to durable storage (issue 4): a lost output_dir comes back from the mirror,
for a local folder and for a real S3-protocol server on loopback (moto)."""

from __future__ import annotations

import shutil
import socket

import pytest
from conftest import make_config

from relaytune.atomic import MANIFEST
from relaytune.checkpoint.mirror import redact


def test_redact_hides_credentials_and_queries():
    assert redact("s3://AKIA:secret@bucket/run?token=abc") == "s3://bucket/run"
    assert redact("/content/drive/MyDrive/run") == "/content/drive/MyDrive/run"


def test_local_folder_mirror_restores_a_lost_output_dir(tmp_path, tiny_model, dropout_reference, fork_cli):
    data, ref = dropout_reference
    mirror = tmp_path / "drive"
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1, save_total_limit=1,
                      mirror_to=str(mirror))
    r = fork_cli.run("train", str(cfg), env={"RELAYTUNE_CRASH_AT": "step:end:11", "RELAYTUNE_SLOW_STEP": "0.3"})
    assert r.returncode == -9
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
    r = fork_cli.run("train", str(cfg), env={**s3_server, "RELAYTUNE_CRASH_AT": "step:end:11",
                                        "RELAYTUNE_SLOW_STEP": "0.5"})
    assert r.returncode == -9, r.stderr
    shutil.rmtree(tmp_path / "run")
    again = fork_cli.run("train", str(cfg), env=s3_server)
    assert again.returncode == 0, again.stderr
    assert "restored step-8 from the mirror s3://runs/exp1" in again.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == ref
