"""Shared fixtures: a tiny random model built in-process, data files, configs, CLI runs.

The helpers live in `support/`; the names tests import from here (`from conftest import ...`)
are re-exported below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fork_server import ONE_THREAD_ENV, ForkedRun, ForkServer
from support.run_helpers import (
    chat_rows,
    lora_model_with_gradients,
    make_config,
    run_cli,
    run_until_done,
    step_records,
    write_jsonl,
)

from relaytune.tiny import make_tiny_model

# The multi-process tests' fixtures (tests/distributed): the uninterrupted runs they compare against.
pytest_plugins = ["support.ranks"]

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "ONE_THREAD_ENV", "ForkServer", "ForkedRun", "chat_rows", "lora_model_with_gradients",
           "make_config", "run_cli", "run_until_done", "step_records", "write_jsonl"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer llama, hidden 64, with a byte-level BPE tokenizer and ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def chat_data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", chat_rows())


@pytest.fixture(scope="session")
def fork_cli(tmp_path_factory):
    """`fork_cli.run("train", cfg, env={...})`: a CLI run without the import cost of a new process."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield server
    server.close()


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
