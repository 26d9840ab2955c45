"""What the decoder-layer tests share: a tiny LoRA model as the trainer loads it, one fixed batch, and
its loss and adapter gradients."""

from __future__ import annotations

import torch

from relaytune.config.schema import TrainConfig
from relaytune.model import choose_precision, load_model
from relaytune.training.loss import causal_lm_loss

BATCH, SEQ = 2, 24


def layer_model(tiny_model, tmp_path, **kw):
    """The tiny model as the trainer loads it (LoRA with dropout 0 unless `kw` says otherwise, and the
    config's other fields from `kw`), seeded, in training mode."""
    cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                      **{"lora_dropout": 0.0, **kw})
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    model.train()
    return model


def layer_batch(vocab: int) -> dict:
    """One fixed batch: BATCH rows of SEQ token ids, the labels the inputs."""
    ids = torch.randint(10, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grads(model):
    """The loss of layer_batch and the gradient of every trainable parameter, by name."""
    batch = layer_batch(model.config.vocab_size)
    loss = causal_lm_loss(model, batch, BATCH * (SEQ - 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

