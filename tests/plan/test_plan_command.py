"""`relaytune plan`: the verdict it prints for a config, what it offers when nothing fits, bad input,
and the bench's dry run."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from support.plan_cases import LLAMA8B, QWEN3B, REPO, run_plan, write_config

from relaytune.errors import UserError
from relaytune.plan import (
    FITS,
    estimate_eta,
    format_plan,
    make_plan,
    parse_gpu,
)
from relaytune.plan.gpus import TABLE as GPUS

# --- the command -------------------------------------------------------------------------------------


def test_plan_on_the_demo_config_prints_a_verdict(tmp_path, capsys):
    from relaytune.commands import plan

    cfg = write_config(tmp_path, model="builtin:SmolLM2-135M-Instruct", max_seq_length=96, num_train_epochs=1,
                       per_device_train_batch_size=8, gradient_accumulation_steps=1, lora_dropout=0.0)
    plan.run(argparse.Namespace(config=str(cfg), overrides=[], gpu="T4", rows=None, mean_tokens=None))
    out = capsys.readouterr().out
    assert "relaytune plan: builtin:SmolLM2-135M-Instruct on T4" in out
    assert "no bf16: fp16 with a gradient scaler" in out
    assert re.search(r"^verdict: FITS: \d+\.\d+ GiB of 15 GiB", out, re.M)
    assert "micro-batch 8 is the largest that fits at global batch 8" in out
    assert "50 steps x 8 rows" in out  # 400 rows of the shipped demo data, counted, one epoch
    parts = re.findall(r"^  (frozen weights|LoRA parameters|loss)\s+\d+\.\d+ GiB", out, re.M)
    # fp16 computes the head's gradient in forward too (6 bytes per logit): the loss is not the peak
    assert parts == ["frozen weights", "LoRA parameters"]
    assert re.search(r"^  not at the same moment: loss \d+\.\d+ GiB", out, re.M)


def test_plan_for_llama3_8b_qlora_on_a_t4(tmp_path, capsys):
    cfg = write_config(tmp_path, model=LLAMA8B, load_in_4bit=True, optim="paged_adamw_8bit",
                       gradient_checkpointing=True, max_seq_length=2048, per_device_train_batch_size=4,
                       gradient_accumulation_steps=4, max_steps=1000)
    out = run_plan(capsys, str(cfg), "--gpu", "T4")
    assert "QLoRA (NF4, double quant)" in out and "fp16" in out
    assert re.search(r"^verdict: FITS", out, re.M)
    assert "micro-batch 4 is the largest that fits at global batch 16" in out
    assert "gradient checkpointing must stay on" in out
    assert re.search(r"^checkpoints  about 24\d\.\d MiB each; 4 on disk at once", out, re.M)
    assert re.search(r"about \d+(\.\d)? h: about \d Kaggle sessions? of 12 h; about 1 week of Kaggle's 30 h", out)
    assert "an estimate" in out and "65 vs 989 TFLOP/s" in out


def test_plan_when_nothing_fits_says_what_to_change(tmp_path, capsys):
    cfg = write_config(tmp_path, model=LLAMA8B, gradient_checkpointing=False, max_seq_length=2048,
                       per_device_train_batch_size=2, gradient_accumulation_steps=8)
    out = run_plan(capsys, str(cfg), "max_seq_length=4096")
    assert re.search(r"^verdict: DOES NOT FIT", out, re.M)
    assert "nothing fits, not even micro-batch 1" in out
    changes = dict(re.findall(r"^    - (.+): (\d+\.\d+ GiB \(.+\))$", out, re.M))
    assert set(changes) >= {"load_in_4bit: true", "optim: paged_adamw_8bit", "gradient_checkpointing: true",
                            "offload_activations: true (with gradient_checkpointing: true)",
                            "liger_kernels: [swiglu] (pip install liger-kernel)", "all of the above"}
    assert changes["all of the above"].endswith("(fits)")
    at_one = float(re.search(r"nothing fits, not even micro-batch 1 \((\d+\.\d+) GiB", out).group(1))
    assert float(changes["liger_kernels: [swiglu] (pip install liger-kernel)"].split()[0]) < at_one


@pytest.mark.parametrize("model,overrides", [
    ("google/gemma-2-9b", ()),  # Liger's patch for Gemma is not one relaytune applies
    (LLAMA8B, ("torch_compile=false",)),  # the saving was measured in compiled layers only
    (LLAMA8B, ("liger_kernels=[swiglu]",)),
])
def test_plan_offers_liger_swiglu_only_where_relaytune_runs_it_and_counts_it(tmp_path, capsys, model, overrides):
    cfg = write_config(tmp_path, model=model, gradient_checkpointing=False, max_seq_length=4096,
                       per_device_train_batch_size=2, gradient_accumulation_steps=8)
    out = run_plan(capsys, str(cfg), *overrides)
    assert "nothing fits, not even micro-batch 1" in out
    assert "liger_kernels: [swiglu]" not in out.split("what would help")[1]


def test_plan_offers_offloading_when_it_fits_a_larger_micro_batch(tmp_path, capsys):
    """Llama-3-8B QLoRA at seq 2048 on a T4: 4 fits, and 8 with offloading, as an H200 capped at 14.5 GiB
    measured (bench/results/vs-trl-h200.md)."""
    settings = dict(model=LLAMA8B, load_in_4bit=True, gradient_checkpointing=True, max_seq_length=2048,
                    per_device_train_batch_size=8, gradient_accumulation_steps=2)
    out = run_plan(capsys, str(write_config(tmp_path, **settings)), "--gpu", "T4")
    assert "largest micro-batch that fits at global batch 16: 4:" in out
    assert "with offload_activations: true, micro-batch 8 fits" in out
    (tmp_path / "on").mkdir()
    on = run_plan(capsys, str(write_config(tmp_path / "on", **settings, offload_activations=True)), "--gpu", "T4")
    assert re.search(r"^verdict: FITS", on, re.M) and "with offload_activations" not in on
    assert "layer inputs are in pinned CPU memory" in on


def test_plan_gives_a_smaller_micro_batch_and_accepts_custom_cards(tmp_path, capsys):
    cfg = write_config(tmp_path, model=QWEN3B, load_in_4bit=True, optim="paged_adamw_8bit",
                       gradient_checkpointing=True, max_seq_length=2048, per_device_train_batch_size=32,
                       gradient_accumulation_steps=1)
    out = run_plan(capsys, str(cfg), "--gpu", "T4")
    assert re.search(r"^verdict: DOES NOT FIT", out, re.M)
    # 16 would use 94% of the T4 at the old loss chunk and ran out of memory under a 14.5 GiB cap on an H200.
    assert re.search(r"largest micro-batch that fits at global batch 32: 8: per_device_train_batch_size: 8, "
                     r"gradient_accumulation_steps: 4", out)
    out = run_plan(capsys, str(cfg), "--gpu", "MYCARD:80")
    assert "on MYCARD (80 GiB, bf16" in out and "speed        not estimated" in out
    out = run_plan(capsys, str(cfg), "--gpu", "all")
    assert all(name in out for name in GPUS) and "largest mb" in out


def test_plan_rejects_bad_input(tmp_path, capsys):
    cfg = write_config(tmp_path, model=QWEN3B)
    with pytest.raises(UserError, match="unknown GPU"):
        run_plan(capsys, str(cfg), "--gpu", "GTX480")
    with pytest.raises(UserError, match="--rows"):
        run_plan(capsys, str(cfg), "--rows", "0")
    with pytest.raises(UserError, match="is not a key"):
        run_plan(capsys, str(cfg), "lora_rank=8")
    with pytest.raises(UserError, match="planner does not know"):
        run_plan(capsys, str(write_config(tmp_path, model="acme/NoSuchModel")))


def test_eta_in_platform_sessions():
    eta = estimate_eta(tokens=25 * 3600 * 1000, tokens_per_second=1000)
    assert (eta.hours, eta.kaggle_sessions, eta.kaggle_weeks, eta.colab_sessions) == (25, 3, 1, 3)
    text = eta.describe()
    assert "about 3 Kaggle sessions of 12 h" in text and "about 1 week of Kaggle's 30 h weekly GPU quota" in text
    assert "free tier often ends sooner" in text


def test_make_plan_from_a_train_config():
    from relaytune.config import TrainConfig

    cfg = TrainConfig(model=QWEN3B, dataset="data.jsonl", output_dir="run", load_in_4bit=True, bf16=True,
                      gradient_checkpointing=True, max_seq_length=2048, per_device_train_batch_size=4,
                      gradient_accumulation_steps=4, max_steps=100, optim="paged_adamw_8bit")
    plan = make_plan(cfg, parse_gpu("T4"))
    assert plan.settings.compute_dtype == "fp16"  # bf16 asked for, but a T4 has none
    assert (plan.status, plan.global_batch, plan.accumulation, plan.best_micro_batch) == (FITS, 16, 4, 8)
    assert plan.steps == 100 and plan.tokens == 100 * 16 * 2048
    text = format_plan(plan)
    assert "T4 has no bf16: relaytune trains in fp16 with a gradient scaler" in text
    assert "largest micro-batch that fits at global batch 16: 8 (faster)" in text


def test_bench_dry_run_lists_enough_cases():
    r = subprocess.run([sys.executable, str(REPO / "bench/planner_accuracy.py"), "--dry-run"], capture_output=True,
                       text=True, timeout=60, check=True)
    cases = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(cases) >= 10
    names = " ".join(c["case"] for c in cases)
    for part in ("q05-", "q3-", "q7-", "l8-", "-lora-", "-qlora-", "-s512-", "-s2048-", "-b1-", "-b16-", "-gc",
                 "-nogc"):
        assert part in names, part
    verdicts = {c["verdict_under_cap"] for c in cases}
    assert {"fits", "does not fit"} <= verdicts
    assert all(abs(sum(c["predicted_parts_gib"].values()) - c["predicted_gib"]) < 0.01 for c in cases)


