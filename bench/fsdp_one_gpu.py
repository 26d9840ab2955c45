"""relaytune's FSDP path on one GPU, each case beside the same run unsharded.

With one GPU, relaytune trains unsharded; this script makes the process a rank of a one-process
NCCL group that counts as distributed, so the whole FSDP path runs through `relaytune.train`:
fully_shard on CUDA bf16 and fp16 weights and on bitsandbytes 4-bit weights with float storage,
compiled layers under fully_shard, the gradient scaler, SIGTERM with a checkpoint, and the resume.
Nothing is really split over one GPU, so memory and speed say nothing about two; the loss curves
say whether the sharded path computes the same thing.

    python bench/fsdp_one_gpu.py --out fsdp.jsonl bf16 4bit fp16 compile compile-auto resume
    ARCH=tiny STEPS=6 python bench/fsdp_one_gpu.py --out /tmp/f.jsonl bf16   # CPU smoke test (gloo)
"""
import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as G  # noqa: E402

import relaytune  # noqa: E402
from relaytune.distributed import world as W  # noqa: E402

G.ARCHS["qwen2.5-0.5b"] = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                               tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
ORIG = W.from_env


class OneRank(W.World):
    """Rank 0 of one, counted as distributed, so that the trainer takes the multi-process path."""

    @property
    def distributed(self):
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(name: str, sharded: bool, env: dict | None = None, **cfg) -> dict:
    """One run through relaytune.train; `env` set: continue the run in place (no fresh folder)."""
    out = G.WORK / "runs" / name
    if not env:
        shutil.rmtree(out, ignore_errors=True)
    base = dict(model=str(MODEL), dataset=str(DATA), output_dir=str(out), logging_steps=1, save_every_seconds=0,
                save_steps=5, learning_rate=2e-4, lora_r=16, lora_alpha=32, lora_dropout=0.0,
                max_steps=int(os.environ.get("STEPS", 30)), per_device_train_batch_size=4,
                gradient_accumulation_steps=2, max_seq_length=512, gradient_checkpointing=True, **cfg)
    saved = dict(os.environ)
    if sharded:
        base["fsdp"] = True
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        W.from_env = lambda env=None: OneRank(0, 1, 0, False)
    os.environ.update(env or {})
    t0, err = time.time(), None
    try:
        relaytune.train(base)
    except BaseException as e:  # noqa: BLE001  (a stop with exit 75 is one of the cases)
        err = f"{type(e).__name__}: {e}"[:500]
    finally:
        os.environ.clear()
        os.environ.update(saved)
        W.from_env = ORIG
    return record(name, sharded, out, err, time.time() - t0)


def record(name: str, sharded: bool, out: Path, err: str | None, seconds: float) -> dict:
    metrics = out / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in recs if "loss" in r and "event" not in r]
    warm = sorted(r["tokens_per_second"] for r in steps[3:])
    res = {"case": name, "sharded": sharded, "error": err, "seconds": round(seconds, 1),
           "losses": [r["loss"] for r in steps], "grad_norms": [r["grad_norm"] for r in steps],
           "peak_gib": max((r.get("peak_memory_gib", 0) for r in steps), default=None),
           "tok_s_median": warm[len(warm) // 2] if warm else None,
           "events": [r for r in recs if r.get("event") not in (None, "checkpoint")][:10]}
    ckpts = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    if ckpts:
        state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
        res["strategy"], res["world_size"] = state.get("strategy"), state.get("world_size")
    with open(ARGS.out, "a") as fh:
        fh.write(json.dumps(res) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("losses", "grad_norms")}), flush=True)
    return res


def diff(a: dict, b: dict) -> None:
    n = min(len(a["losses"]), len(b["losses"]))
    d = max(abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n])) if n else None
    print(f"DIFF {a['case']} vs {b['case']}: {n} steps, max |loss diff| {d}, "
          f"last {a['losses'][-1:]} {b['losses'][-1:]}", flush=True)


def resume_case():
    """SIGTERM after step 12 of the sharded 4-bit run, then the same command again: compared with
    the uninterrupted sharded run (`4bit` must have run first)."""
    run = G.WORK / "runs" / "4bit-fsdp-resume"

    def stopper():
        while True:
            time.sleep(0.05)
            try:
                lines = (run / "metrics.jsonl").read_text().splitlines()
            except OSError:
                continue
            if sum(1 for ln in lines if '"loss"' in ln and "event" not in ln) >= 12:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=stopper, daemon=True).start()
    train("4bit-fsdp-resume", True, torch_compile=False, load_in_4bit=True)
    second = train("4bit-fsdp-resume", True, env={"RELAYTUNE_BENCH_RESUME": "1"}, torch_compile=False,
                   load_in_4bit=True)
    ref = next(json.loads(ln) for ln in open(ARGS.out) if json.loads(ln)["case"] == "4bit-fsdp")
    diff(second, ref)
    import safetensors.torch as st

    a = st.load_file(run / "final/adapter_model.safetensors")
    b = st.load_file(G.WORK / "runs/4bit-fsdp/final/adapter_model.safetensors")
    print("RESUME adapter max abs diff", max((a[k].float() - b[k].float()).abs().max().item() for k in a),
          "identical", all(bool((a[k] == b[k]).all()) for k in a), flush=True)


PAIRS = {
    "bf16": dict(torch_compile=False),
    "4bit": dict(torch_compile=False, load_in_4bit=True),
    "fp16": dict(torch_compile=False, load_in_4bit=True, fp16=True),
    "compile": dict(torch_compile=True, load_in_4bit=True),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON lines, one per run (appended)")
    p.add_argument("cases", nargs="+", choices=[*PAIRS, "compile-auto", "resume"])
    ARGS = p.parse_args()
    import bitsandbytes  # noqa: F401
    import peft
    import torch
    import transformers

    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}), flush=True)
    MODEL = G.build_model(os.environ.get("ARCH", "qwen2.5-0.5b"))
    DATA = G.pattern_data(400, 512)
    for case in ARGS.cases:
        if case in PAIRS:
            diff(train(f"{case}-plain", False, **PAIRS[case]), train(f"{case}-fsdp", True, **PAIRS[case]))
        elif case == "compile-auto":  # auto means off under FSDP: the speed-ups line must not name compile
            train("compile-auto-fsdp", True, torch_compile="auto", load_in_4bit=True)
        else:
            resume_case()
