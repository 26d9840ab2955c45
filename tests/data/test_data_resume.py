"""Exact resume with packing on: SIGKILL after step 5, re-run, and the final adapter is
byte-identical to an uninterrupted run's. The second session reads the tokenization cache."""

import random

import pytest
from conftest import make_config, run_cli, write_jsonl


def varied_rows(n=60, seed=0):
    """Chat rows of spread-out lengths, so packing puts 1 to 4 rows in a sequence."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = " ".join(rng.choice(["one", "two", "plus", "fox", "dog"]) for _ in range(rng.randint(1, 25)))
        rows.append({"messages": [{"role": "user", "content": words},
                                  {"role": "assistant", "content": str(rng.randint(0, 99))}]})
    return rows


@pytest.mark.slow  # three training runs in child processes: about a minute on 2 cores
def test_exact_resume_with_packing(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "data.jsonl", varied_rows())
    settings = dict(packing=True, max_seq_length=96, max_steps=8, save_steps=2)
    (tmp_path / "a").mkdir()
    straight = make_config(tmp_path / "a", tiny_model, data, **settings)
    r = run_cli("train", str(straight))
    assert r.returncode == 0, r.stderr
    assert "packed 60 rows into" in r.stderr

    (tmp_path / "b").mkdir()
    killed = make_config(tmp_path / "b", tiny_model, data, **settings)
    r = run_cli("train", str(killed), env={"RELAYTUNE_CRASH_AT": "step:end:5"})
    assert r.returncode == -9, r.stderr  # SIGKILL
    r = run_cli("train", str(killed))
    assert r.returncode == 0, r.stderr
    assert "tokenized data loaded from the cache" in r.stderr  # the new session did not tokenize

    a = (tmp_path / "a" / "run" / "final" / "adapter_model.safetensors").read_bytes()
    b = (tmp_path / "b" / "run" / "final" / "adapter_model.safetensors").read_bytes()
    assert a == b
