"""Planner accuracy on a GPU: predicted vs measured peak memory, and the fit verdict under a memory cap.

For each case a random-init model of the real architecture is trained for a few steps through
`relaytune.train` (bench/gpu_bench.py's helpers: same models, data and run settings: LoRA r16
all-linear, dropout 0.05, bf16, rows that fill max_seq_length, a checkpoint mid-run so the save's
GPU copy overlaps a step as in real runs). The peak is metrics.jsonl's peak_memory_gib
(torch.cuda.max_memory_allocated after the model is loaded); the prediction is
`relaytune.plan.estimate_memory` for the same settings. Cases marked `cap` run under
torch.cuda.set_per_process_memory_fraction(--cap-gib), as on a 16 GB T4, and report whether
relaytune met an OOM (it then halves the micro-batch) against the planner's verdict for a card
with that much memory left to torch. Cases predicted above the cap also run uncapped first, for
the accuracy figure. One JSON line per case; a summary line at the end.

    python bench/planner_accuracy.py                 # on an H200: 7-8 minutes (see --budget-s)
    python bench/planner_accuracy.py --dry-run       # predictions only, on any machine (no torch)
    python bench/planner_accuracy.py --cases q3-qlora-s2048-b16-gc,l8-qlora-s2048-b8-gc
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from relaytune.plan import FITS, GIB, NO_FIT, Gpu, Settings, estimate_memory, fit_status  # noqa: E402
from relaytune.plan.architectures import from_table  # noqa: E402
from relaytune.plan.gpus import CUDA_CONTEXT_GIB  # noqa: E402

# Planner table id and the gpu_bench.ARCHS key its random-init model is built and cached under.
MODELS = {"q05": ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"), "q3": ("Qwen/Qwen2.5-3B", "qwen2.5-3b"),
          "q7": ("Qwen/Qwen2.5-7B", "qwen2.5-7b"), "l8": ("meta-llama/Meta-Llama-3-8B", "llama-3-8b")}
TORCH_COMPILE = {"auto": "auto", "false": False}  # --torch-compile; auto compiles each layer on CUDA
STEPS, SAVE_STEPS = 6, 3  # the save after step 3 overlaps step 4, as a save every 30 s does in a real run
ARGS = argparse.Namespace(torch_compile="auto")


@dataclass(frozen=True)
class Case:
    model: str  # a MODELS key
    quant: str  # "lora" or "qlora"
    seq: int
    micro_batch: int
    gc: bool
    cap: bool = False  # also judge the verdict under the memory cap

    @property
    def name(self) -> str:
        return f"{self.model}-{self.quant}-s{self.seq}-b{self.micro_batch}-{'gc' if self.gc else 'nogc'}"

    def settings(self) -> Settings:
        qlora = self.quant == "qlora"
        return Settings(max_seq_length=self.seq, quantization="nf4" if qlora else "none",
                        optim="paged_adamw_8bit" if qlora else "adamw_torch", lora_r=16, lora_dropout=0.05,
                        compiled_layers=ARGS.torch_compile != "false")  # auto compiles on any card measured here

    def train_config(self) -> dict:
        cfg = dict(max_steps=STEPS, save_steps=SAVE_STEPS, per_device_train_batch_size=self.micro_batch,
                   gradient_accumulation_steps=1, max_seq_length=self.seq, gradient_checkpointing=self.gc,
                   optim="paged_adamw_8bit" if self.quant == "qlora" else "adamw_torch",
                   torch_compile=TORCH_COMPILE[ARGS.torch_compile])
        if self.quant == "qlora":
            cfg["load_in_4bit"] = True
        return cfg


# Grouped by model so each is built and loaded while it is in the page cache; Llama-3-8B before
# Qwen2.5-7B, so that a run over its time budget loses the less telling cases. Seq-2048 micro-batch
# 16 only for the 0.5B model and for Qwen2.5-3B QLoRA with checkpointing (the T4 line). The cap cases
# sit on both sides of 14.5 GiB: Qwen2.5-3B QLoRA b16 just below, Llama-3-8B QLoRA b8 just above.
CASES = [
    Case("q05", "lora", 512, 4, True), Case("q05", "lora", 2048, 16, True),
    Case("q05", "lora", 2048, 4, False, cap=True), Case("q05", "qlora", 512, 16, False),
    Case("q3", "lora", 2048, 4, True), Case("q3", "lora", 512, 1, False),
    Case("q3", "qlora", 2048, 8, True, cap=True), Case("q3", "qlora", 2048, 16, True, cap=True),
    Case("q3", "qlora", 512, 8, False),
    Case("l8", "qlora", 2048, 4, True, cap=True), Case("l8", "qlora", 2048, 8, True, cap=True),
    Case("l8", "qlora", 512, 1, False, cap=True),
    Case("q7", "qlora", 2048, 2, True, cap=True), Case("q7", "lora", 512, 4, True),
]
# Configurations the planner's compiled-layer terms were not derived from (run with --cases NAME):
# other sequence lengths and micro-batches, a 4-bit 7B without checkpointing, a bf16 8B.
HELD_OUT = [
    Case("q05", "qlora", 2048, 8, True), Case("q3", "lora", 1024, 2, False),
    Case("q3", "qlora", 4096, 2, True, cap=True), Case("l8", "qlora", 1024, 4, True),
    Case("l8", "lora", 512, 2, True), Case("q7", "qlora", 1024, 2, False, cap=True),
]


def predict(case: Case, cap_gib: float) -> dict:
    arch = from_table(MODELS[case.model][0])
    estimate = estimate_memory(arch, case.settings(), case.micro_batch, case.gc)
    capped = Gpu(f"cap {cap_gib:g} GiB", cap_gib + CUDA_CONTEXT_GIB, True, None)
    return {"case": case.name, "predicted_gib": round(estimate.total_allocated / GIB, 3),
            "predicted_parts_gib": {k: round(v / GIB, 3) for k, v in estimate.parts.items()},
            "peak_phase": estimate.peak_phase, "predicted_torch_reserved_gib": round(estimate.torch_reserved / GIB, 3),
            "verdict_under_cap": fit_status(estimate, capped)}


def measure(case: Case, cap_gib: float | None) -> dict:
    """Train the case; with cap_gib, under that memory cap. Returns peak, OOM events and speed."""
    import gpu_bench
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    # The model is built (random weights, saved to disk) before the cap: building is not training.
    model = gpu_bench.build_model(MODELS[case.model][1])
    data = gpu_bench.long_text_data(case.micro_batch * (STEPS + 2), case.seq)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total if cap_gib else 1.0)
    try:
        name = f"plan-{case.name}{'-eager' if ARGS.torch_compile == 'false' else ''}{'-cap' if cap_gib else ''}"
        result = gpu_bench.run(name, model, data, **case.train_config())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    ooms = [e for e in result["events"] if e.get("event") == "oom"]
    return {"peak_gib": result["peak_memory_gib"], "oom": bool(ooms),
            "final_micro_batch": ooms[-1]["micro_batch_size"] if ooms else case.micro_batch,
            "released": [what for e in ooms for what in e.get("released", [])], "started_at": case.micro_batch,
            "tokens_per_second": result["tokens_per_second_median"], "wall_seconds": result["wall_seconds"]}


def run_case(case: Case, cap_gib: float) -> dict:
    line = predict(case, cap_gib)
    line["torch_compile"] = ARGS.torch_compile
    above_cap = line["predicted_gib"] > cap_gib
    if not case.cap or above_cap:
        line["measured"] = measure(case, None)
        line["measured_gib"] = line["measured"]["peak_gib"]
    if case.cap:
        capped = measure(case, cap_gib)
        line["under_cap"] = capped
        line["verdict_right"] = _verdict_right(line["verdict_under_cap"], capped["oom"])
        if "measured_gib" not in line and capped["oom"]:
            # An OOM's attempt stays in the peak counter, so the accuracy figure needs an uncapped run.
            line["measured"] = measure(case, None)
        line.setdefault("measured_gib", line["measured"]["peak_gib"] if "measured" in line else capped["peak_gib"])
    if line.get("measured_gib"):
        line["error_pct"] = round(100 * (line["predicted_gib"] / line["measured_gib"] - 1), 1)
    return line


def _verdict_right(verdict: str, oom: bool) -> bool | None:
    """fits must run without an OOM, does-not-fit must meet one; tight makes no claim (None)."""
    if verdict == FITS:
        return not oom
    if verdict == NO_FIT:
        return oom
    return None


def _build_models_if_needed(cases: list[Case]) -> set[Path]:
    """Register the architectures with gpu_bench; returns the model folders this run will create."""
    import gpu_bench

    created = set()
    for key in {c.model for c in cases}:
        hub_id, bench_key = MODELS[key]
        if bench_key not in gpu_bench.ARCHS:
            a = from_table(hub_id)
            gpu_bench.ARCHS[bench_key] = dict(
                model_type=a.model_type, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                vocab_size=a.vocab_size, tie_word_embeddings=a.tied_embeddings, max_position_embeddings=32768)
        folder = gpu_bench.WORK / "models" / bench_key
        if not (folder / "config.json").exists():
            created.add(folder)
    return created


def _capped_outcome(capped: dict) -> str:
    """What the capped run did: ran, or what its OOMs changed (records before the same-micro-batch
    redo have no `released` or `started_at`: they always stepped down)."""
    if not capped["oom"]:
        return "ran"
    gave_up = capped.get("released") or []
    parts = [f"redone without {' and '.join(gave_up)}"] if gave_up else []
    if capped["final_micro_batch"] < capped.get("started_at", capped["final_micro_batch"] + 1):
        parts.append(f"stepped down to {capped['final_micro_batch']}")
    return "OOM, " + ", then ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the predictions only (any machine, no torch)")
    p.add_argument("--cases", help="comma list of case names (default: all); --dry-run lists them")
    p.add_argument("--cap-gib", type=float, default=14.5, help="memory cap for the verdict cases (default 14.5)")
    p.add_argument("--budget-s", type=float, default=420, help="skip the remaining cases after this long")
    p.add_argument("--keep-models", action="store_true", help="keep the model folders this run builds")
    p.add_argument("--torch-compile", default="auto", choices=sorted(TORCH_COMPILE),
                   help="torch_compile of every case (auto: each layer compiled on CUDA; false: eager)")
    p.add_argument("--rescore", nargs="+", metavar="JSONL",
                   help="no GPU: score measured lines of earlier runs against this planner, as a markdown table")
    args = p.parse_args()
    ARGS.torch_compile = args.torch_compile
    if args.rescore:
        return rescore(args.rescore, args.cap_gib)
    chosen = [c for c in CASES + HELD_OUT if c in CASES and not args.cases or args.cases
              and c.name in args.cases.split(",")]
    if args.dry_run:
        for case in chosen:
            print(json.dumps(predict(case, args.cap_gib)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    created = _build_models_if_needed(chosen)
    began, lines = time.time(), []
    for i, case in enumerate(chosen):
        if time.time() - began > args.budget_s:
            print(json.dumps({"case": case.name, "skipped": f"over the {args.budget_s:g} s budget"}), flush=True)
            continue
        lines.append(run_case(case, args.cap_gib))
        print(json.dumps(lines[-1]), flush=True)
        _drop_model_if_done(case, chosen[i + 1:], created, args.keep_models)
    print(json.dumps(summary(lines, time.time() - began)), flush=True)


def _drop_model_if_done(case: Case, rest: list[Case], created: set[Path], keep: bool) -> None:
    """A 7-8B random model takes 15 GB of disk; remove it once its cases are done, if this run built it."""
    import gpu_bench

    folder = gpu_bench.WORK / "models" / MODELS[case.model][1]
    if not keep and folder in created and all(c.model != case.model for c in rest):
        shutil.rmtree(folder, ignore_errors=True)


def rescore(paths: list[str], cap_gib: float) -> None:
    """Today's prediction and verdict against each measured line (its own torch_compile setting)."""
    by_name = {c.name: c for c in CASES + HELD_OUT}
    held = {c.name for c in HELD_OUT}
    lines = []
    print("| case | torch_compile | predicted GiB | measured GiB | error | verdict under "
          f"{cap_gib:g} GiB | under the cap | verdict right |\n|---|---|---|---|---|---|---|---|")
    for path in paths:
        for raw in Path(path).read_text().splitlines():
            old = json.loads(raw)
            if old.get("case") not in by_name or "measured_gib" not in old:
                continue
            ARGS.torch_compile = old.get("torch_compile", "false")
            line = predict(by_name[old["case"]], cap_gib)
            line["error_pct"] = round(100 * (line["predicted_gib"] / old["measured_gib"] - 1), 1)
            capped = old.get("under_cap")
            if capped is not None:
                line["verdict_right"] = _verdict_right(line["verdict_under_cap"], capped["oom"])
            ran = "not capped" if capped is None else _capped_outcome(capped)
            right = {True: "yes", False: "**no**", None: ""}[line.get("verdict_right")] if capped else ""
            name = old["case"] + (" (held out)" if old["case"] in held else "")
            print(f"| {name} | {ARGS.torch_compile} | {line['predicted_gib']:.2f} | {old['measured_gib']:.2f} | "
                  f"{line['error_pct']:+.1f}% | {line['verdict_under_cap']} | {ran} | {right} |")
            lines.append(line)
    print("\n" + json.dumps(summary(lines, 0.0)))


def summary(lines: list[dict], seconds: float) -> dict:
    errors = [abs(line["error_pct"]) for line in lines if "error_pct" in line]
    verdicts = [line["verdict_right"] for line in lines if "verdict_right" in line]
    return {"summary": True, "cases": len(lines), "max_abs_error_pct": max(errors, default=None),
            "within_10pct": sum(e <= 10 for e in errors), "measured": len(errors),
            "verdicts_right": sum(v is True for v in verdicts), "verdicts_wrong": sum(v is False for v in verdicts),
            "verdicts_tight": sum(v is None for v in verdicts), "seconds": round(seconds, 1)}


if __name__ == "__main__":
    main()
