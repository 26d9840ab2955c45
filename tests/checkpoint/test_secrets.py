"""No credential reaches the disk or the terminal: planted secrets are grepped for in every file of
the run folder and in everything printed, by train, status and export."""

from __future__ import annotations

from pathlib import Path

from conftest import make_config

SECRET = "PLANTED-s3cr3t-9f3a1c"
TOKEN = "hf_PLANTEDtokenZZ123"


def every_byte(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_credentials_in_mirror_to_are_refused_and_never_printed_or_written(tmp_path, tiny_model, chat_data,
                                                                            fork_cli):
    url = f"s3://AKIAPLANTED:{SECRET}@bucket/runs?token={TOKEN}"
    cfg = make_config(tmp_path, tiny_model, chat_data, mirror_to=url)
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    run = tmp_path / "run"
    for secret in (SECRET, TOKEN, "AKIAPLANTED"):
        assert secret not in r.stdout + r.stderr
        assert not run.exists() or secret.encode() not in every_byte(run)


def test_a_run_with_secrets_in_the_environment_writes_and_prints_none_of_them(tmp_path, tiny_model, chat_data,
                                                                             fork_cli):
    """Tokens that the libraries read from the environment, and a mirror whose URL carries none, through a
    whole run (with its checkpoints, mirror state and final/), then status and export."""
    env = {"HF_TOKEN": TOKEN, "AWS_SECRET_ACCESS_KEY": SECRET, "WANDB_API_KEY": SECRET,
           "HUGGING_FACE_HUB_TOKEN": TOKEN}
    cfg = make_config(tmp_path, tiny_model, chat_data, mirror_to=str(tmp_path / "mirror"), max_steps=6,
                      save_steps=2)
    printed = []
    for argv in (["train", str(cfg)], ["status", str(tmp_path / "run")],
                 ["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]):
        r = fork_cli.run(*argv, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        printed.append(r.stdout + r.stderr)
    for secret in (SECRET, TOKEN):
        assert all(secret not in text for text in printed)
        for root in (tmp_path / "run", tmp_path / "mirror", tmp_path / "export"):
            assert secret.encode() not in every_byte(root), root
