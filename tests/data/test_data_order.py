"""Data order and loss normalisation: what exact resume rests on.

- The global batch of step s is a pure function of (seed, s): a resumed run trains the very
  batches an uninterrupted one would (torchtitan's test: 40 batches, save, reload, the next 8
  are identical), also across epoch boundaries and through the real training loop.
- The micro-batch size only decides how a global batch is cut: same rows, same order, and the
  accumulated gradient of one optimizer step is the same for micro-batch 1, 2, 4 and 8.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import chat_rows, lora_model_with_gradients, make_config, write_jsonl
from row_tokens import tokenize

from relaytune.data import IGNORE, TokenRow
from relaytune.data.batches import DataOrder, count_targets, micro_batches, to_device
from relaytune.data.formats import RawRow, normalise
from relaytune.tiny import make_tokenizer
from relaytune.training import recipe as loop
from relaytune.training import trainer as trainer_module
from relaytune.training.step import StepParts, optimizer_step

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the order as a pure function --------------------------------------------------------------

def test_order_is_a_pure_function_of_seed_and_step():
    a, b = DataOrder(42, 4, seed=7), DataOrder(42, 4, seed=7)
    steps = list(range(60))
    shuffled = steps[:]
    random.Random(0).shuffle(shuffled)
    from_a = {s: a.batch_rows(s) for s in steps}
    from_b = {s: b.batch_rows(s) for s in shuffled}  # any access order, any instance
    assert from_a == from_b
    assert DataOrder(42, 4, seed=8).batch_rows(0) != a.batch_rows(0)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    order = DataOrder(42, 4, seed=3)
    assert order.steps_per_epoch == 11  # 10 full batches and one of 2 rows
    epochs = []
    for e in range(3):
        rows = [r for s in range(e * 11, (e + 1) * 11) for r in order.batch_rows(s)]
        assert sorted(rows) == list(range(42)), f"epoch {e} must hold every row once"
        assert len(order.batch_rows(e * 11 + 10)) == 2
        epochs.append(rows)
    assert epochs[0] != epochs[1] != epochs[2]


def test_resumed_order_gives_the_next_8_batches_after_40():
    """torchtitan style: iterate 40 batches, save the cursor, reload, compare the next 8."""
    n_rows, batch, seed = 42, 4, 1234  # 11 steps per epoch: steps 40..47 cross epoch 3 -> 4
    uninterrupted = DataOrder(n_rows, batch, seed)
    seen = [uninterrupted.batch_rows(s) for s in range(48)]
    state = json.dumps(uninterrupted.cursor(40).as_dict())  # what a checkpoint holds
    assert json.loads(state) == {"epoch": 3, "batch": 7}
    resumed = DataOrder(n_rows, batch, seed)  # a new process: nothing cached carries over
    cursor = json.loads(state)
    start = cursor["epoch"] * resumed.steps_per_epoch + cursor["batch"]
    assert [resumed.batch_rows(start + k) for k in range(8)] == seen[40:48]


def test_resumed_training_loop_trains_the_same_next_batches(tmp_path, tiny_model, monkeypatch):
    """Through the real loop: stop after step 41 (checkpoint at 40), re-run; steps 40..47 of the
    resumed session get exactly the rows of the uninterrupted run, in the same order."""
    data = write_jsonl(tmp_path / "data.jsonl", chat_rows(42, seed=5))
    seen: dict[str, dict[int, list]] = {"ref": {}, "a": {}, "b": {}}
    current = {"name": "ref", "stop_at": None}

    def recording_step(parts, rows, micro_batch_size, step):
        if step == current["stop_at"]:
            raise KeyboardInterrupt("simulated kill")
        seen[current["name"]][step] = [r.input_ids.tolist() for r in rows]
        return optimizer_step(parts, rows, micro_batch_size, step)

    monkeypatch.setattr(trainer_module, "optimizer_step", recording_step)
    settings = dict(max_steps=48, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    save_steps=40, lora_r=4, lora_dropout=0.0, logging_steps=8)
    loop.train(str(make_config(tmp_path / "ref", tiny_model, data, **settings)))
    cfg = make_config(tmp_path / "cut", tiny_model, data, **settings)
    current.update(name="a", stop_at=42)
    with pytest.raises(KeyboardInterrupt):
        loop.train(str(cfg))
    current.update(name="b", stop_at=None)
    loop.train(str(cfg))
    assert sorted(seen["b"]) == list(range(40, 48)), "the resume starts at the checkpoint's step"
    assert [seen["b"][s] for s in range(40, 48)] == [seen["ref"][s] for s in range(40, 48)]
    assert [len(seen["ref"][s]) for s in range(40, 48)] == [4, 4, 4, 2, 4, 4, 4, 4], \
        "42 rows in batches of 4: step 43, the last of epoch 3, holds 2"
    assert (tmp_path / "cut" / "run" / "final" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "ref" / "run" / "final" / "adapter_model.safetensors").read_bytes()


# --- micro-batches --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def rows(tok) -> list[TokenRow]:
    """Eight rows of different lengths and different numbers of target tokens."""
    samples = [
        {"messages": [{"role": "user", "content": "3 plus 4"}, {"role": "assistant", "content": "7"}]},
        {"text": "the quick brown fox jumps over the lazy dog"},
        {"prompt": "what is the capital of france?", "completion": " the capital of france is paris."},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "2 plus 2"},
                      {"role": "assistant", "content": "4"}]},
        {"text": "0 1 2"},
        {"instruction": "Translate to JSON", "output": '{"name": "ada", "age": 36}'},
        {"prompt": "1 plus 1", "completion": " 2"},
        {"text": "user assistant system question answer reply hello world"},
    ]
    out = []
    for s in samples:
        ids, labels = tokenize(normalise(RawRow("t:1", s)), tok)
        out.append(TokenRow(ids, labels))
    assert len({r.targets for r in out}) > 3 and len({len(r.input_ids) for r in out}) > 3
    return out


@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_micro_batches_keep_rows_and_order(rows, tok, micro):
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches = list(micro_batches(rows, micro, pad))
    assert len(batches) == math.ceil(len(rows) / micro)
    got_ids, got_labels = [], []
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape
        for i in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][i].sum())
            assert b["attention_mask"][i, :n].eq(1).all() and b["attention_mask"][i, n:].eq(0).all()
            assert b["input_ids"][i, n:].eq(pad).all() and b["labels"][i, n:].eq(IGNORE).all()
            got_ids.append(b["input_ids"][i, :n].tolist())
            got_labels.append(b["labels"][i, :n].tolist())
    assert got_ids == [r.input_ids.tolist() for r in rows]
    assert got_labels == [r.labels.tolist() for r in rows]


# --- loss normalisation ---------------------------------------------------------------------------

class GradRecorder(torch.optim.Optimizer):
    """An 'optimizer' whose step keeps a copy of the accumulated (clipped) gradients."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads: list[torch.Tensor] | None = None

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


@pytest.fixture(scope="module")
def lora_model(tiny_model, tmp_path_factory):
    return lora_model_with_gradients(tiny_model, tmp_path_factory.mktemp("norm"))


def test_gradient_is_the_same_for_every_micro_batch_size(lora_model, rows, tok):
    model, cfg, precision = lora_model
    pad = tok.eos_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    results = {}
    for micro in (1, 2, 4, 8):
        optimizer = GradRecorder(params)
        parts = StepParts(model, optimizer, None, precision, pad, cfg.max_grad_norm)
        result = optimizer_step(parts, rows, micro, step=0)
        loss, norm, updated = result.loss, result.grad_norm, result.updated
        assert updated and math.isfinite(loss)
        assert all(p.grad is None for p in params), "gradients are cleared after the step"
        assert all(torch.equal(p, s) for p, s in zip(params, start)), "the recorder changes nothing"
        results[micro] = (loss, norm, optimizer.grads)
    ref_loss, ref_norm, ref_grads = results[8]
    assert any(g.abs().sum() > 0 for g in ref_grads)
    for micro in (1, 2, 4):
        loss, norm, grads = results[micro]
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0)
        assert norm == pytest.approx(ref_norm, rel=1e-5, abs=0)
        for g, r in zip(grads, ref_grads):  # float32 summation order differs: near-zero entries
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()))

    # The loss is the mean token loss over the target tokens of the whole global batch ...
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r.input_ids.tolist())[None]
            logits = model(input_ids=ids).logits[0, :-1].float()
            labels = torch.tensor(r.labels.tolist())[1:]
            total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE,
                                                       reduction="sum").item()
            count += int((labels != IGNORE).sum())
    assert count == count_targets(rows)
    assert ref_loss == pytest.approx(total / count, rel=1e-5)
    # ... which is not the mean of per-micro-batch means (the common gradient-accumulation bug):
    # these rows have different target counts, so this test would notice that mistake.
    naive = np.mean([sum(_row_loss(model, r) for r in pair) / sum(r.targets for r in pair)
                     for pair in (rows[i:i + 2] for i in range(0, 8, 2))])
    assert abs(naive - ref_loss) > 1e-3


def _row_loss(model, r: TokenRow) -> float:
    with torch.no_grad():
        ids = torch.tensor(r.input_ids.tolist())[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        labels = torch.tensor(r.labels.tolist())[1:]
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum").item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned, non-blocking copy is the GPU's path"))])
def test_a_micro_batch_reaches_the_device_unchanged(device):
    rows = [TokenRow([5, 6, 7, 8], [IGNORE, 6, 7, 8], segments=(2, 2)), TokenRow([9, 10], [IGNORE, 10])]
    host = next(micro_batches(rows, 2, pad_id=0, width=6))
    moved = to_device(host, torch.device(device))
    assert list(moved) == list(host) == ["input_ids", "labels", "position_ids"]
    for key, tensor in moved.items():
        assert tensor.device.type == device and tensor.dtype == torch.long
        assert torch.equal(tensor.cpu(), host[key]), key  # .cpu() waits for a non-blocking copy on its stream
    # The padding after a row is a sample of its own, with positions of its own (`collate`).
    assert moved["position_ids"].cpu().tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3]]
