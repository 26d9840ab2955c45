"""Our training loop computes what TRL's SFTTrainer computes , step for step.

On the tiny model, fp32 on CPU, with identical settings, our per-step training loss matches
TRL 1.16's within 1e-4 relative over 20 steps (in practice ~1e-7: our metrics.jsonl rounds to
6 decimals), and so do the learning rate, the gradient norm and the trained adapter.

What it takes to make the two see the same problem:
- Same global batches in the same order: TRL gets our own tokenized rows (`input_ids` and
  `labels`, -100 where no loss), laid out in our DataOrder order, with
  `skip_prepare_dataset=True` (so TRL adds no EOS/BOS and does not truncate) and a sequential
  sampler. batch 4 x accumulation 2 over 40 rows: 5 steps per epoch, no partial batches.
- Same loss normalisation: both divide the summed token loss by the target tokens of the whole
  accumulation window, counted on the shifted labels (`labels[..., 1:]`, transformers'
  `_get_num_items_in_batch`; our `TokenRow.targets`). The data mixes chat rows (first label
  masked) and plain-text rows (first label a target), so counting unshifted labels on either
  side would show. `average_tokens_across_devices` multiplies by the number of processes: 1.
- Same optimizer and schedule: AdamW (betas, eps, decoupled weight decay on the LoRA matrices),
  linear decay without warmup, clipping at max_grad_norm. TRL's SFTConfig defaults differ from
  TrainingArguments (bf16=True, gradient_checkpointing=True): both are set off here.
- Same start: the LoRA initialisation of both comes from `torch.manual_seed(seed)` then
  `relaytune.model.load_model`; the test checks that it equals the adapter our run started with.
  lora_dropout is 0, so no RNG is drawn during training.
- The learning rate logged for step s is, in both, the one that step used (transformers 5.x
  reads it before `lr_scheduler.step()`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import chat_rows, make_config, step_records, write_jsonl
from safetensors.torch import load_file

from relaytune.config.loader import load_config
from relaytune.data.batches import DataOrder
from relaytune.data.prepare import prepare_data
from relaytune.model import choose_precision, load_model, load_tokenizer
from relaytune.training import recipe as loop
from relaytune.training import trainer as trainer_module

trl = pytest.importorskip("trl")

STEPS = 20
SETTINGS = dict(max_steps=STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0, warmup_ratio=0.0,
                weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                optim="adamw_torch", lora_r=8, lora_alpha=16, lora_dropout=0.0, seed=42, logging_steps=1,
                save_steps=1000, save_every_seconds=0, packing=False, max_seq_length=1024)


def test_per_step_loss_matches_trl_sft_trainer(tmp_path, tiny_model, monkeypatch, one_thread):
    from datasets import Dataset
    from peft.utils import get_peft_model_state_dict
    from torch.utils.data import SequentialSampler

    rows = chat_rows(24, seed=2) + [{"text": t} for t in (
        "the quick brown fox jumps over the lazy dog", "hello world", "0 1 2 3 4 5 6 7 8 9 10",
        "what is the capital of france? the capital of france is paris.",
        "user assistant system question answer reply hello world", "plus minus times equals")] * 2 \
        + chat_rows(4, seed=9)
    assert len(rows) == 40
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    cfg_path = make_config(tmp_path, tiny_model, data, **SETTINGS)

    # --- ours, with the adapter it starts from
    initial: dict[str, torch.Tensor] = {}
    real_load = trainer_module.load_model

    def spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        initial.update({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        return model

    monkeypatch.setattr(trainer_module, "load_model", spy)
    loop.train(str(cfg_path))
    monkeypatch.setattr(trainer_module, "load_model", real_load)
    ours = step_records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))

    # --- TRL, on the same rows in the same order, from the same adapter
    cfg = load_config(str(cfg_path))
    tokenizer = load_tokenizer(cfg)
    prepared = prepare_data(cfg.model_copy(update={"output_dir": str(tmp_path / "trl-data")}), tokenizer)
    assert len(prepared.train) == 40 and any(r.labels[0] != -100 for r in prepared.train)
    order = DataOrder(len(prepared.train), cfg.global_batch_size, cfg.seed)
    sequence = [prepared.train[i] for s in range(STEPS) for i in order.batch_rows(s)]
    assert len(sequence) == STEPS * cfg.global_batch_size, "no partial global batch in 20 steps"
    dataset = Dataset.from_dict({"input_ids": [r.input_ids.tolist() for r in sequence],
                                 "labels": [r.labels.tolist() for r in sequence]})
    torch.manual_seed(cfg.seed)
    model = load_model(cfg, choose_precision(cfg))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(initial)
    assert all(torch.equal(p, initial[n]) for n, p in trainable.items()), "both start from one adapter"

    class InOrder(trl.SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
        max_steps=STEPS, logging_steps=1, save_strategy="no", report_to="none", bf16=False, fp16=False,
        use_cpu=True, gradient_checkpointing=False, dataset_kwargs={"skip_prepare_dataset": True},
        packing=False, padding_free=False, max_length=None, seed=42, disable_tqdm=True,
        average_tokens_across_devices=True)
    trainer = InOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert [h["step"] for h in theirs] == list(range(1, STEPS + 1))

    for a, b in zip(ours, theirs):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["learning_rate"], b["learning_rate"], rel_tol=1e-9), a["step"]
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), a["step"]
    assert ours[-1]["loss"] < ours[0]["loss"], "the comparison is over a run that learns"

    # The adapters they end with agree too.
    final = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    trl_state = get_peft_model_state_dict(trainer.model)
    assert sorted(final) == sorted(trl_state)
    for k, v in final.items():
        torch.testing.assert_close(trl_state[k].detach().cpu(), v, rtol=1e-4, atol=1e-6)
    assert json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())["r"] == 8
    assert Path(tmp_path / "run" / "final").is_dir()
