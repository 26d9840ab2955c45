"""The workers of bench/vs_trl.py: one system, one micro-batch, in a fresh process.

`python bench/vs_trl.py --worker SYSTEM ...` runs `worker(args)`, which trains relaytune (in-process,
`relaytune.train`) or TRL's SFTTrainer (with or without Liger) on the model and data the parent built,
and prints one result line (RESULT + JSON) for the parent to read. How each system's peak memory and
tokens/s are taken is in vs_trl.py's docstring.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

RESULT = "VS_TRL_RESULT "  # prefix of the worker's result line on stdout
GIB = 2**30


def _cap(args) -> float | None:
    import torch

    if not (args.cap_gib and torch.cuda.is_available()):
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, args.cap_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def relaytune_config(args, out: Path) -> dict:
    """relaytune's config for this case, as TRL's arguments are built in worker_trl (also used by
    step_profile.py and memory_snapshot.py). `--relaytune-liger` sets relaytune's own `liger_kernels`;
    `--relaytune-offload-stream compute` moves offload_activations' copies onto the compute stream."""
    import torch

    cfg = dict(
        model=args.model, dataset=args.data, output_dir=str(out), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        max_seq_length=args.seq, packing=args.packing, gradient_checkpointing=True,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim=args.optim, seed=42,
        lora_r=16, lora_alpha=32, lora_dropout=args.lora_dropout, lora_target_modules="all-linear",
        logging_steps=1, save_steps=args.save_steps or 10**6, save_every_seconds=0,
        report_to="none", dataset_cache=False, num_gpus=1,  # TRL's runs use one GPU too
    )
    if torch.cuda.is_available():
        cfg["bf16"] = True
    if args.quant == "4bit":
        cfg.update(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    cfg["adapter_dtype"] = relaytune_adapter_dtype(args)
    for item in args.relaytune_set or []:  # A/B of relaytune's own settings, e.g. torch_compile=false
        key, _, value = item.partition("=")
        cfg[key.strip()] = __import__("yaml").safe_load(value)  # "false" -> False, "8" -> 8
    if args.relaytune_liger:
        cfg["liger_kernels"] = list(args.relaytune_liger)
    if getattr(args, "relaytune_offload_stream", "side") == "compute":
        from relaytune import activation_offload

        # This process's offload copies on the compute stream, as before 6c76cf5 (the prefetch kept), so that
        # one invocation measures what the side stream's overlap gives.
        activation_offload.side_stream = torch.cuda.current_stream
    return cfg


def liger_kernels(text: str) -> tuple[str, ...]:
    """`--relaytune-liger`'s value: a comma list of relaytune's `liger_kernels` names, in their order."""
    from relaytune.liger import KERNELS

    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(KERNELS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(KERNELS)}")
    return tuple(k for k in KERNELS if k in names)


def halved_micro_batch(oom_event: dict) -> bool:
    """Whether relaytune redid an OOM'd step at a smaller micro-batch (else at the same one, having
    given up CUDA graphs or the compiled checkpoint: that micro-batch still fits)."""
    return oom_event.get("micro_batch_size", 0) < oom_event.get("was", 1)


def worker_relaytune(args) -> dict:
    import torch
    from gpu_bench import RELAYTUNE_SRC, cuda_graphs_held

    import relaytune

    cuda = torch.cuda.is_available()
    out = Path(args.run_dir)
    shutil.rmtree(out, ignore_errors=True)
    notes = []
    reserved_at_log: list[int] = []
    graphs_at_log: list[int | None] = []
    # Observation only, guarded: relaytune is being refactored, and train(dict) is the stable API.
    try:
        from relaytune.training import trainer as _tr

        if cuda and hasattr(_tr, "load_model"):
            _load = _tr.load_model

            def load_then_reset(*a, **k):
                model = _load(*a, **k)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                return model
            _tr.load_model = load_then_reset
            notes.append("peak reset after load_model (and again by relaytune after the optimizer is built)")
        from relaytune.training import step_log as _log

        if cuda and hasattr(_log, "peak_memory"):
            _peak = _log.peak_memory

            def peak_and_reserved():
                reserved_at_log.append(torch.cuda.max_memory_reserved())
                graphs_at_log.append(cuda_graphs_held())
                return _peak()
            # step_log calls it for every logged step; the trainer's own name, for an OOM's event.
            _log.peak_memory = peak_and_reserved
            if hasattr(_tr, "peak_memory"):
                _tr.peak_memory = peak_and_reserved
    except Exception as e:  # noqa: BLE001
        notes.append(f"could not hook relaytune internals ({e!r}); relying on its own peak reset")
    cfg = relaytune_config(args, out)
    t0 = time.time()
    error = None
    try:
        relaytune.train(cfg)
    except BaseException as e:  # noqa: BLE001
        error = e
    wall = time.time() - t0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    ooms = [r for r in records if r.get("event") == "oom"]
    if error is not None and not (ooms or _is_oom(error)):
        raise error
    halved = [r for r in ooms if halved_micro_batch(r)]
    notes += [f"OOM at step {r['step'] + 1}: redone at the same micro-batch without {', '.join(r['released'])}"
              for r in ooms if r.get("released")]
    steps = [r for r in records if "loss" in r and "event" not in r]
    timed = steps[args.warmup:]
    if ooms and not halved:  # redone at this micro-batch: time and measure what ran after the last OOM
        after = [r for r in steps if r["step"] > ooms[-1]["step"] + 1]  # +1: the redone step recompiles
        if after:
            steps, timed = after, after
            notes.append("tokens/s and peak from the steps after the OOM's redone step (the peak was reset there)")
    res = dict(system="relaytune", batch=args.batch, wall_seconds=round(wall, 1), steps=len(steps),
               fits=not halved and error is None, oom_events=ooms, notes=notes,
               relaytune_src=RELAYTUNE_SRC)
    if error is not None:
        res["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    if timed:
        res["tokens_per_second"] = round(statistics.median(r["tokens_per_second"] for r in timed), 1)
        seen = [r["tokens_seen"] for r in steps]
        res["tokens_per_step"] = sorted({b - a for a, b in zip([0] + seen, seen)})
        res["first_loss"], res["last_loss"] = steps[0]["loss"], steps[-1]["loss"]
        for key in ("mfu", "mfu_lora"):  # 6N + attention, and the LoRA-honest 4N + attention
            if all(key in r for r in timed):
                res[key] = round(statistics.median(r[key] for r in timed), 4)
    res["adapter_dtype"] = cfg["adapter_dtype"]
    if args.relaytune_set:
        res["relaytune_set"] = list(args.relaytune_set)
    if any(n is not None for n in graphs_at_log):  # one per logged step: growth means graphs recorded again
        res["cuda_graphs_held_per_step"] = graphs_at_log
    if args.relaytune_liger:
        res["liger_kernels"] = ", ".join(args.relaytune_liger)
    if cuda and steps:
        res["peak_allocated_gib"] = max(r.get("peak_memory_gib", 0) for r in steps)
        res["peak_allocated_incl_final_save_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        res["peak_reserved_incl_final_save_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        if reserved_at_log:
            res["peak_reserved_gib"] = round(max(reserved_at_log) / GIB, 3)
        else:
            res["peak_reserved_gib"] = res["peak_reserved_incl_final_save_gib"]
            notes.append("peak reserved includes the final adapter save")
    return res


def worker_trl(args, liger: bool) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    out = Path(args.run_dir)
    shutil.rmtree(out, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:  # as relaytune does
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    # No Hub kernels, as relaytune loads it: transformers 5.25 fetches them by default, which raises offline.
    kwargs: dict = {"dtype": torch.bfloat16 if cuda else torch.float32, "use_kernels": False}
    if args.quant == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if cuda else torch.float32)
        kwargs["device_map"] = {"": 0 if cuda else "cpu"}
    t_load = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    if args.quant != "4bit" and cuda:
        model.to("cuda")
    model.config.use_cache = False
    dataset = load_dataset("json", data_files=args.data, split="train")
    sft = SFTConfig(
        output_dir=str(out), max_length=args.seq, packing=args.packing, dataset_text_field="text",
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=cuda, learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim=trl_optim(args.optim, cuda), seed=42, max_steps=args.warmup + args.steps,
        logging_steps=1, save_strategy="no", report_to="none", use_liger_kernel=liger,
        dataloader_num_workers=0, use_cpu=not cuda, disable_tqdm=True,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=args.lora_dropout, target_modules="all-linear",
                      bias="none", task_type="CAUSAL_LM")

    tokens = {"micro": 0}

    class CountingTrainer(SFTTrainer):
        def training_step(self, model, inputs, *a, **k):
            if "attention_mask" in inputs:
                tokens["micro"] += int(inputs["attention_mask"].sum())
            else:
                tokens["micro"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *a, **k)

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[float, int, float]] = []  # (seconds, tokens, step end time)
            self.peak_alloc = self.peak_reserved = 0

        def _sync(self):
            if cuda:
                torch.cuda.synchronize()

        def on_step_begin(self, a, state, control, **kw):
            self._sync()
            self.t0 = time.perf_counter()
            tokens["micro"] = 0

        def on_step_end(self, a, state, control, **kw):
            self._sync()
            now = time.perf_counter()
            self.steps.append((now - self.t0, tokens["micro"], now))
            if cuda:
                self.peak_alloc = torch.cuda.max_memory_allocated()
                self.peak_reserved = torch.cuda.max_memory_reserved()

    timer = Timer()
    trainer = CountingTrainer(model=model, args=sft, train_dataset=dataset, processing_class=tok,
                              peft_config=lora, callbacks=[timer])
    load_seconds = time.time() - t_load
    adapter_dtypes = sorted({str(p.dtype)[6:] for p in trainer.model.parameters() if p.requires_grad})
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # after model load + adapter, before the first step
    t0 = time.time()
    error = None
    try:
        trainer.train()
    except BaseException as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        error = e
    wall = time.time() - t0
    name = "trl-liger" if liger else "trl"
    res = dict(system=name, batch=args.batch, wall_seconds=round(wall, 1), load_seconds=round(load_seconds, 1),
               steps=len(timer.steps), fits=error is None, adapter_dtypes=adapter_dtypes, notes=[])
    if error is not None:
        res["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    timed = timer.steps[args.warmup:]
    if timed:
        res["tokens_per_second"] = round(statistics.median(n / s for s, n, _ in timed), 1)
        ends = [e for _, _, e in timer.steps[args.warmup - 1:]] if args.warmup else []
        if len(ends) > 1:  # step end to step end: includes data loading and logging between steps
            res["tokens_per_second_end_to_end"] = round(statistics.median(
                n / (b - a) for (_, n, _), a, b in zip(timed, ends, ends[1:])), 1)
        res["tokens_per_step"] = sorted({n for _, n, _ in timer.steps})
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if losses:
        res["first_loss"], res["last_loss"] = losses[0], losses[-1]
    if cuda and timer.steps:
        res["peak_allocated_gib"] = round(timer.peak_alloc / GIB, 3)
        res["peak_reserved_gib"] = round(timer.peak_reserved / GIB, 3)
    return res


def trl_optim(optim: str, cuda: bool) -> str:
    """TRL's name for the optimizer relaytune runs under `optim`: relaytune's adamw_torch is torch's
    fused AdamW on a GPU (training/optim.fusable), which TRL calls adamw_torch_fused (its default there)."""
    return "adamw_torch_fused" if optim == "adamw_torch" and cuda else optim


def relaytune_adapter_dtype(args) -> str:
    """relaytune's adapter_dtype for this case: `match` takes TRL's own choice, which its raw lines
    record as adapter_dtypes (TRL 1.16 casts QLoRA adapters to bf16 and keeps LoRA's in fp32)."""
    if args.adapter_dtype != "match":
        return args.adapter_dtype
    return "bfloat16" if args.quant == "4bit" else "float32"


def worker(args) -> None:
    import torch

    fraction = _cap(args)
    if args.worker == "relaytune":
        res = worker_relaytune(args)
    else:
        res = worker_trl(args, liger=args.worker == "trl-liger")
    res.update(arch=args.arch, quant=args.quant, seq=args.seq, accum=args.accum, optim=args.optim,
               packing=args.packing, warmup=args.warmup, timed_steps=args.steps,
               cap_gib=args.cap_gib if fraction else None,
               device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    print(RESULT + json.dumps(res), flush=True)
