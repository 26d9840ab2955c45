"""Benchmark: data preparation for 100k chat rows, cold and from the tokenization cache.

    python bench/data_prep.py [--rows 100000] [--tokenizers tiny,smollm2] [--max-seq-length 2048]

Each measurement runs in a fresh child process, as a new session would: cold (empty
output_dir), then a cache hit (same output_dir), then a hit with packing on (packing is
applied after the cache, so it must not tokenize either). The time is that of
`prepare_data` alone; loading the tokenizer and importing are reported apart. The
reference: TRL's SFTTrainer takes 39 s for 100k chat rows on this machine, every time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is that it for on with as was at by be this from or have an they which one "
         "you had not but what all were when we there can more if no out so said time up about than into "
         "them only new some could these two may first then do any like my now over such our man me even "
         "most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three").split()


def make_rows(n: int, seed: int = 0):
    """Chat rows with a realistic spread: 1-3 turns, an optional system prompt, long-tailed lengths."""
    rng = random.Random(seed)

    def text(mean: float) -> str:
        k = max(1, min(int(rng.lognormvariate(0, 0.8) * mean), int(mean * 12)))
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    for _ in range(n):
        msgs = [{"role": "system", "content": text(12)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            msgs += [{"role": "user", "content": text(25)}, {"role": "assistant", "content": text(60)}]
        yield {"messages": msgs}


def child(args) -> None:
    """One measurement in this process: load the tokenizer, time prepare_data, print JSON."""
    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    from relaytune.config.loader import load_config
    from relaytune.data.prepare import prepare_data

    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    calls = {"n": 0}
    original = type(tok).__call__

    def counting(self, *a, **k):
        calls["n"] += 1
        return original(self, *a, **k)

    type(tok).__call__ = counting
    t1 = time.perf_counter()
    cfg = load_config({"dataset": args.data, "output_dir": args.out, "max_seq_length": args.max_seq_length,
                       "packing": args.packing, "max_bad_fraction": 1})
    data = prepare_data(cfg, tok)
    t2 = time.perf_counter()
    print(json.dumps({"prepare_s": round(t2 - t1, 3), "setup_s": round(t1 - t0, 3),
                      "tokenizer_calls": calls["n"], "stats": data.stats}))


def child_trl(args) -> None:
    """TRL's SFTTrainer on the same file and tokenizer, with a fresh datasets cache (a new
    session): the time from constructing the trainer to its tokenized dataset, minus the model."""
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hf-datasets-")
    import datasets
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=args.data, split="train")
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, args=SFTConfig(
        output_dir=args.out, max_length=args.max_seq_length, packing=args.packing, report_to=[], bf16=False,
        use_cpu=True))
    n = sum(len(x) for x in trainer.train_dataset["input_ids"])
    print(json.dumps({"prepare_s": round(time.perf_counter() - t0, 3), "tokens": n}))


def measure(tok_dir: Path, data: Path, out: Path, packing: bool, max_len: int, trl: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--tokenizer-dir", str(tok_dir), "--data", str(data),
           "--out", str(out), "--max-seq-length", str(max_len)] + (["--packing"] if packing else []) \
        + (["--trl"] if trl else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--tokenizers", default="tiny,smollm2")
    p.add_argument("--max-seq-length", type=int, default=2048)
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--trl", action="store_true", help="also time TRL's SFTTrainer data preparation")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_trl(args) if args.trl else child(args)

    import tokenizers
    import transformers

    from relaytune.tiny import make_tokenizer

    work = Path(args.work or tempfile.mkdtemp(prefix="relaytune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "chat.jsonl"
    with open(data, "w") as fh:
        for row in make_rows(args.rows):
            fh.write(json.dumps(row) + "\n")
    sources = {}
    if "tiny" in args.tokenizers:
        make_tokenizer().save_pretrained(work / "tiny-tok")
        sources["tiny (relaytune.tiny, vocab 402)"] = work / "tiny-tok"
    smol = Path(os.path.expanduser("~/.cache/relaytune/SmolLM2-135M-Instruct"))
    if "smollm2" in args.tokenizers and (smol / "tokenizer.json").is_file():
        sources["SmolLM2-135M-Instruct (vocab 49152)"] = smol
    print(f"# data preparation, {args.rows} chat rows ({data.stat().st_size / 1e6:.1f} MB jsonl), "
          f"max_seq_length {args.max_seq_length}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, transformers {transformers.__version__}, tokenizers "
          f"{tokenizers.__version__}")
    print("| tokenizer | run | prepare_data s | tokenizer calls | tokens | packing efficiency |")
    print("|---|---|---|---|---|---|")
    for name, tok_dir in sources.items():
        out = work / f"run-{tok_dir.name}"
        for label, packing in (("cold (no cache)", False), ("cache hit", False), ("cache hit, packing on", True)):
            m = measure(tok_dir, data, out, packing, args.max_seq_length)
            s = m["stats"]
            eff = f"{s['packing_efficiency']:.1%}" if "packing_efficiency" in s else "-"
            print(f"| {name} | {label} | {m['prepare_s']:.2f} | {m['tokenizer_calls']} | "
                  f"{s['train_tokens']} | {eff} |", flush=True)
        if args.trl:
            m = measure(tok_dir, data, work / f"trl-{tok_dir.name}", False, args.max_seq_length, trl=True)
            print(f"| {name} | TRL 1.16 SFTTrainer, fresh datasets cache | {m['prepare_s']:.2f} | - | "
                  f"{m['tokens']} | - |", flush=True)


if __name__ == "__main__":
    main()
