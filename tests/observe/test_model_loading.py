"""Issue 15 item 7 (a malicious pytorch_model.bin) and issue 14 item 6 (no library warning lines)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, chat_rows, make_config, write_jsonl

from relaytune.cli import main


class RunsCode:
    """Unpickling this runs a command: what a malicious pytorch_model.bin would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("container", ["torch_zip", "raw_pickle"])
def test_a_pickled_model_is_refused_with_a_message_and_never_run(tmp_path, tiny_model, capsys, container):
    import pickle

    import torch

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for f in model.glob("*.safetensors*"):
        f.unlink()
    marker = tmp_path / "PWNED"
    payload = {"model.embed_tokens.weight": RunsCode(marker)}
    if container == "torch_zip":
        torch.save(payload, model / "pytorch_model.bin")
    else:
        with open(model / "pytorch_model.bin", "wb") as fh:
            pickle.dump(payload, fh)
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, model, data, max_steps=2)
    rc = main(["train", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err
    assert "pytorch_model.bin" in err and "safetensors" in err and "none was run" in err
    assert not marker.exists()


def test_a_tiny_train_prints_no_library_warning_lines(tmp_path, tiny_model):
    """A real process (the fork server pre-imports bitsandbytes outside relaytune): its stderr holds
    neither bitsandbytes' kernels line nor transformers' gradient-checkpointing FutureWarnings."""
    pytest.importorskip("bitsandbytes")
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, tiny_model, data, max_steps=1, save_steps=1, gradient_checkpointing=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run([sys.executable, "-m", "relaytune.cli", "train", str(cfg)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gemm_4bit_forward" not in r.stderr
    assert "FutureWarning" not in r.stderr, r.stderr[-3000:]
