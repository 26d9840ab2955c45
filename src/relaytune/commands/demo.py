"""`relaytune demo`: fine-tune the built-in model on the built-in data, then show before/after.

The task (data made by scripts/make_demo_data.py, shipped in demo_data/): rewrite a
date spelled out in English ("Friday, March 5, 2021") as ISO 8601 ("2021-03-05") and
nothing else. SmolLM2-135M-Instruct cannot: it echoes the date or rambles. The demo
trains through `relaytune.train` (training/recipe.py), the same function users call, and then
measures exact match on held-out prompts, greedy, for the base model and base + adapter.

Re-running on a finished run skips training (train() returns at once) and still
prints the comparison.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from relaytune import atomic
from relaytune.config import BUILTIN_MODEL, load_config, parse_overrides
from relaytune.log import info
from relaytune.run_dir import RunDir

DATA = Path(__file__).resolve().parent / "demo_data"
# The demo's own files in its run folder, beside what training writes there.
EVAL_FILE = "demo-eval.jsonl"
CONFIG_FILE = "demo.yaml"
TRAIN_RECORD = "demo-train.json"
PROMPTS_FILE = "demo-prompts.jsonl"
COMPARE_REPORT = "compare.md"
N_EVAL_LOSS = 16  # held-out rows also scored for eval_loss in metrics.jsonl; few, so it costs ~1 s
MAX_NEW_TOKENS = 16  # an answer is 10 digit/dash tokens + <|im_end|>; more only lets a rambler ramble
GEN_BATCH = 50

# Tuned on a 2-core CPU (bench/results/demo.md). Rows are ~70 tokens, so max_seq_length 96
# cuts nothing; a high learning rate suits a tiny adapter trained for a few dozen steps.
DEMO_SETTINGS = {
    "model": BUILTIN_MODEL,
    "dataset": str(DATA / "train.jsonl"),
    "max_seq_length": 96,
    "num_train_epochs": 1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 3,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "logging_steps": 5,
    "seed": 42,
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="fine-tune the built-in model on the built-in data and show before/after")
    p.add_argument("--output-dir", default="runs/demo", help="where the demo run goes (default: runs/demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override demo config keys")
    return p


def run(args: argparse.Namespace) -> None:
    run_demo(args.output_dir, args.overrides)


def run_demo(output_dir: str, overrides: list[str]) -> dict:
    """Train (or find the finished run) in output_dir, evaluate, print the table; returns the figures."""
    import yaml

    from relaytune.data.formats import normalise
    from relaytune.data.read import read_rows
    from relaytune.training.recipe import train

    began = time.monotonic()
    cfg = load_config({**DEMO_SETTINGS, "output_dir": output_dir},
                      parse_overrides(overrides))  # bad overrides fail here, before any work
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    heldout = [normalise(r)["messages"] for r in read_rows(str(DATA / "heldout.jsonl"))]
    if cfg.eval_dataset is None:
        # A small slice of the held-out rows as eval data, so metrics.jsonl shows an eval_loss.
        cfg.eval_dataset = str(out / EVAL_FILE)
        _write_jsonl(Path(cfg.eval_dataset), [{"messages": m} for m in heldout[:N_EVAL_LOSS]])
    # The config as a file too: `relaytune train <it>` continues or repeats this very run.
    # Not rewritten once the run is finished: it must keep describing what was trained.
    if not RunDir(out).final.exists():
        atomic.replace_file(out / CONFIG_FILE,
                            yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False))

    t0 = time.monotonic()
    result = train(cfg)
    record = out / TRAIN_RECORD
    if result.status == "finished":
        train_seconds = time.monotonic() - t0
        atomic.replace_file(record, json.dumps({"train_seconds": round(train_seconds, 1), "steps": result.step}))
    else:  # an earlier demo trained it; report that run's time
        train_seconds = json.loads(record.read_text())["train_seconds"] if record.is_file() else float("nan")

    info("evaluating the base model and the fine-tuned adapter on the held-out prompts")
    prompts = [m[:-1] for m in heldout]
    answers = [m[-1]["content"].strip() for m in heldout]
    model, tokenizer, device = _load_base(cfg)
    before = greedy_replies(model, tokenizer, prompts, device)
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(result.final_adapter)).eval()
    after = greedy_replies(model, tokenizer, prompts, device)
    figures = {
        "before": _exact(before, answers), "after": _exact(after, answers), "n": len(answers),
        "train_seconds": train_seconds, "total_seconds": time.monotonic() - began,
        "train_status": result.status,
    }
    print(_report(figures, prompts, answers, before, after, out))
    _show_run(out, heldout)
    figures["total_seconds"] = time.monotonic() - began
    return figures


def _show_run(out: Path, heldout: list) -> None:
    """End as a user would look at a run: `relaytune status`, its plot, and a compare report."""
    from relaytune.commands.compare import Decoding, compare_run
    from relaytune.commands.status import format_status, run_status

    prompts = out / PROMPTS_FILE
    _write_jsonl(prompts, [{"messages": m[:-1], "reference": m[-1]["content"]} for m in heldout[:5]])
    comparison = compare_run(out, prompts, "final", Decoding(max_new_tokens=16), out / COMPARE_REPORT,
                             config=str(out / CONFIG_FILE))
    print(format_status(run_status(out)))
    print(f"compare report: {comparison.report}")


def _load_base(cfg):
    """The base model, its tokenizer (left padding, for batched generation) and device."""
    from transformers import AutoModelForCausalLM

    from relaytune.model import choose_precision, load_pretrained, load_tokenizer, resolve_source

    precision = choose_precision(cfg)
    tokenizer = load_tokenizer(cfg)
    # Left padding: generation appends after the last position, so prompts must end there.
    tokenizer.padding_side = "left"
    model = load_pretrained(AutoModelForCausalLM, resolve_source(cfg), cfg, dtype=precision.dtype)
    return model.to(precision.device).eval(), tokenizer, precision.device


def greedy_replies(model, tokenizer, conversations: list[list[dict]], device) -> list[str]:
    """Greedy replies to each conversation, batched."""
    import torch

    replies = []
    for start in range(0, len(conversations), GEN_BATCH):
        # Rendered exactly as in training: chat template, then no extra special tokens.
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations[start:start + GEN_BATCH]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                 temperature=None, top_p=None, top_k=None)
        replies += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [r.strip() for r in replies]


def _exact(outputs: list[str], answers: list[str]) -> int:
    return sum(o == a for o, a in zip(outputs, answers))


def _report(f: dict, prompts, answers, before, after, out: Path) -> str:
    n = f["n"]
    width = 58

    def pct(k: int) -> str:
        return f"{k}/{n} ({100 * k / n:.0f}%)"

    def clip(s: str) -> str:
        s = repr(s)
        return s if len(s) <= width else s[:width - 3] + "..."

    trained = f"{f['train_seconds']:.0f} s (model load included)" + (
        ", in an earlier run" if f["train_status"] != "finished" else "")
    lines = [
        "",
        "relaytune demo: SmolLM2-135M-Instruct learns to write dates as ISO 8601 (YYYY-MM-DD)",
        "",
        f"  {'':<32}{'before':>16}{'after':>16}",
        f"  {'held-out exact match, greedy':<32}{pct(f['before']):>16}{pct(f['after']):>16}",
        "",
        "  examples:",
    ]
    # Show the first few held-out prompts: fixed, so two runs can be compared by eye.
    for p, a, b, c in list(zip(prompts, answers, before, after))[:4]:
        lines += [f"    prompt:   {p[-1]['content']}",
                  f"    expected: {a}",
                  f"    before:   {clip(b)}",
                  f"    after:    {clip(c)}  {'ok' if c == a else 'WRONG'}", ""]
    lines += [f"  training: {trained}; whole demo: {f['total_seconds']:.0f} s",
              f"  adapter: {RunDir(out).final}; config: {out / CONFIG_FILE}", ""]
    return "\n".join(lines)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic.replace_file(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
