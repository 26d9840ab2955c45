"""`relaytune eval` and the best checkpoint (best/, load_best_model_at_end, best-kept retention)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.trained_run import copy_run, finished_run, one_thread, train_run

from relaytune.atomic import read_manifest, verify
from relaytune.cli import main
from relaytune.commands import evaluate
from relaytune.training import evaluation


@pytest.fixture
def run(tmp_path_factory, tiny_model, tmp_path):
    return copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")


def direct_loss(model_dir, adapter_dir, rows) -> float:
    """Summed target-token cross-entropy over all rows / target tokens, one unpadded row at a time."""
    import torch
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([list(r.input_ids)], dtype=torch.long)
            target = torch.tensor(list(r.labels), dtype=torch.long)[1:]
            logits = model(input_ids=ids).logits[0, :-1].double()
            keep = target != -100
            total += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
            count += int(keep.sum())
    return total / count


def test_eval_matches_direct_computation_and_training_log(run, tiny_model, monkeypatch):
    calls = []
    real = evaluation.eval_loss
    monkeypatch.setattr(evaluation, "eval_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    with one_thread():
        first = evaluate.evaluate_run(run, checkpoints="step-4")
        results = evaluate.evaluate_run(run)
    by_name = {r.name: r for r in results}
    assert list(by_name) == ["base", "step-4", "step-8", "final"]
    # base and step-4 came from the cache: only step-8 and final were computed the second time
    assert len(calls) == 2 + 2 and by_name["step-4"].cached and by_name["base"].cached
    assert by_name["step-4"].eval_loss == first[1].eval_loss

    from relaytune.data import prepare_data
    from relaytune.model import load_tokenizer
    from relaytune.run_dir import run_config

    cfg = run_config(run)
    rows = prepare_data(cfg, load_tokenizer(cfg)).eval
    with one_thread():
        for name, adapter in (("base", None), ("step-8", run / "checkpoints" / "step-8"), ("final", run / "final")):
            assert by_name[name].eval_loss == pytest.approx(direct_loss(tiny_model, adapter, rows), rel=1e-5)
    import math

    assert by_name["final"].perplexity == pytest.approx(math.exp(by_name["final"].eval_loss))
    # the values training logged at each checkpoint's step
    logged = {r["step"]: r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "eval_loss" in r}
    assert by_name["step-4"].eval_loss == pytest.approx(logged[4], abs=2e-6)
    assert by_name["step-8"].eval_loss == pytest.approx(logged[8], abs=2e-6)
    # nothing was written into committed folders: they still verify
    assert all(verify(p) is None for p in [run / "final", *(run / "checkpoints").iterdir()])
    assert (run / "eval_cache.json").is_file()


def test_eval_cli_table_and_data_file(run, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} times 2"},
                                                       {"role": "assistant", "content": str(2 * i)}]}) + "\n"
                             for i in range(6)))
    with one_thread():
        assert main(["eval", str(run), "--checkpoints", "step-8,final", "--no-base"]) == 0
        table = capsys.readouterr().out
        assert main(["eval", str(run), "--checkpoints", "final", "--data", str(other)]) == 0
        on_file = capsys.readouterr().out
    lines = [ln for ln in table.splitlines() if ln.startswith(("step-8", "final"))]
    assert len(lines) == 2 and sum(ln.rstrip().endswith("*") for ln in lines) == 1
    assert "lowest eval loss" in table
    final_line = next(ln for ln in on_file.splitlines() if ln.startswith("final"))
    assert "(cached)" not in final_line  # other data: another cache key
    assert main(["eval", str(run), "--checkpoints", "step-99"]) == 2  # a UserError, no traceback


def _eval_records(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]


# A high learning rate on a constant schedule overfits the tiny model, so the eval loss is lowest in the
# middle of the 12 steps. Which rate puts it there depends on the numerics of the installed torch and
# transformers (0.05 did at step 8 with one set, at step 10 with another), so it is found, not fixed.
BEST_RUN = {"lr_scheduler_type": "constant", "eval_steps": 2, "save_steps": 2, "save_total_limit": 1}
LEARNING_RATES = (0.05, 0.08, 0.03, 0.1, 0.15, 0.02)


@pytest.fixture(scope="module")
def best_run(tmp_path_factory, tiny_model) -> dict:
    """BEST_RUN with the first learning rate whose lowest eval loss is at step 4, 6 or 8: neither the
    last evaluation nor the newest checkpoint that retention keeps (step 10 after a save at 12)."""
    seen = {}
    for lr in LEARNING_RATES:
        run = train_run(tmp_path_factory.mktemp("best-probe"), tiny_model, learning_rate=lr, **BEST_RUN)
        seen[lr] = min(_eval_records(run), key=lambda r: r["eval_loss"])["step"]
        if seen[lr] in (4, 6, 8):
            return {**BEST_RUN, "learning_rate": lr}
    pytest.fail(f"no learning rate puts the lowest eval loss mid-run (lowest at steps {seen})")


def test_best_is_kept_by_retention_and_written_to_best(tmp_path, tiny_model, best_run):
    run = train_run(tmp_path, tiny_model, **best_run)
    evals = _eval_records(run)
    best = min(evals, key=lambda r: r["eval_loss"])
    assert best["step"] not in (evals[-1]["step"], 10), "the test needs a best that is neither last nor newest"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted({f"step-{best['step']}", "step-10"})  # limit 1, plus the best
    assert verify(run / "best") is None
    manifest = read_manifest(run / "best")
    assert manifest["step"] == best["step"] and manifest["eval_loss"] == pytest.approx(best["eval_loss"], abs=1e-6)
    best_bytes = (run / "checkpoints" / f"step-{best['step']}" / "adapter_model.safetensors").read_bytes()
    assert (run / "best" / "adapter_model.safetensors").read_bytes() == best_bytes
    assert (run / "final" / "adapter_model.safetensors").read_bytes() != best_bytes  # final = last by default


def test_load_best_model_at_end_puts_best_in_final(tmp_path, tiny_model, best_run):
    run = train_run(tmp_path, tiny_model, load_best_model_at_end=True, **best_run)
    best = min(_eval_records(run), key=lambda r: r["eval_loss"])
    assert (run / "final" / "adapter_model.safetensors").read_bytes() == \
        (run / "checkpoints" / f"step-{best['step']}" / "adapter_model.safetensors").read_bytes()
    assert verify(run / "final") is None


def test_best_survives_retention_across_a_kill_and_resume(tmp_path, tiny_model, fork_cli, best_run):
    from conftest import chat_rows, make_config, write_jsonl

    data = write_jsonl(tmp_path / "data.jsonl", chat_rows())
    cfg = make_config(tmp_path, tiny_model, data, max_steps=12, val_set_size=8, **best_run)
    env = {"OMP_NUM_THREADS": "1"}
    killed = fork_cli.run("train", str(cfg), env={**env, "RELAYTUNE_CRASH_AT": "step:end:9"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = fork_cli.run("train", str(cfg), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "run"
    best = min(_eval_records(run), key=lambda r: r["eval_loss"])
    assert best["step"] <= 8  # found before the kill, so protected by the first session only
    assert (run / "checkpoints" / f"step-{best['step']}").is_dir()
    assert read_manifest(run / "best")["step"] == best["step"]


def test_the_quarantine_list_of_a_data_file_outlives_eval(run, tmp_path, capsys):
    """The message named a list in a temporary folder that eval deleted on exit; it now names a file
    in the run folder (RUN/eval-data/...), there after eval ends, listing the bad line."""
    good = [json.dumps({"messages": [{"role": "user", "content": f"{i} times 2"},
                                     {"role": "assistant", "content": str(2 * i)}]}) for i in range(120)]
    data = tmp_path / "nonutf8.jsonl"
    # one bad line in 121: under max_bad_fraction (0.01), so eval warns and goes on
    data.write_bytes("\n".join(good[:3]).encode() + b'\n{"text": "caf\xe9 \xff"}\n' + "\n".join(good[3:]).encode())
    with one_thread():
        assert main(["eval", str(run), "--checkpoints", "final", "--no-base", "--data", str(data)]) == 0
    err = capsys.readouterr().err
    listed = Path(re.search(r"listed in (\S+quarantine-eval_dataset\.jsonl)", err).group(1))
    assert listed.is_file() and run in listed.parents, err
    entries = [json.loads(line) for line in listed.read_text().splitlines()]
    assert len(entries) == 1 and entries[0]["where"].endswith("nonutf8.jsonl:4"), entries
    assert sorted(p.name for p in listed.parent.iterdir()) == [listed.name]  # not the training data's list
    assert not (run / "quarantine-eval_dataset.jsonl").exists()  # the run's own lists untouched


def test_too_many_bad_lines_stop_with_a_list_that_exists(run, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\xff\xfe not json\n" * 4)
    assert main(["eval", str(run), "--checkpoints", "final", "--data", str(data)]) == 2
    err = capsys.readouterr().err
    listed = Path(re.search(r"listed in (\S+quarantine-eval_dataset\.jsonl)", err).group(1))
    assert "Traceback" not in err and listed.is_file() and len(listed.read_text().splitlines()) == 4, err


def test_a_checkpoint_folder_is_evaluated_as_that_checkpoint_of_its_run(run, capsys):
    """`relaytune eval RUN/checkpoints/step-4` said no configuration was found: the folder holds a
    metrics.jsonl, so it passed for a run, and the configuration lives in the run."""
    with one_thread():
        assert main(["eval", str(run / "checkpoints" / "step-4"), "--no-base"]) == 0
    out = capsys.readouterr()
    names = [ln.split()[0] for ln in out.out.splitlines()[1:] if ln and not ln.startswith("*")]
    assert names == ["step-4"] and "is step-4 of the run in" in out.err
    assert main(["eval", str(run / "checkpoints" / "step-4"), "--checkpoints", "step-8"]) == 2
    assert "--checkpoints names step-8" in capsys.readouterr().err


def test_a_url_given_as_data_is_refused_without_its_credentials():
    from relaytune.commands.evaluate import eval_rows
    from relaytune.errors import UserError

    with pytest.raises(UserError) as caught:
        eval_rows(None, None, "https://user:SECRETPW@example.com/d.jsonl?token=SECRETQ")
    assert str(caught.value) == "--data: https://example.com/d.jsonl not found; give a local file"
