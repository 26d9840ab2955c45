"""Packing: best-fit decreasing is deterministic and valid, and packed samples never see
each other: their logits and their loss are those of the samples run alone."""

import numpy as np
import pytest
import torch

from relaytune.data import IGNORE, TokenRow
from relaytune.data.batches import collate, count_targets
from relaytune.data.packing import best_fit_decreasing, concat, efficiency


def test_best_fit_decreasing_is_valid_deterministic_and_tight():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, size=2000)
    bins = best_fit_decreasing(lengths, 512, seed=7)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every row exactly once
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert bins == best_fit_decreasing(lengths, 512, seed=7)  # a resumed run packs identically
    lower_bound = int(np.ceil(lengths.sum() / 512))
    assert len(bins) <= lower_bound * 1.02  # BFD is within a few percent of the optimum here
    assert efficiency(int(lengths.sum()), len(bins), 512) > 0.97


def test_equal_lengths_are_ordered_by_seed():
    lengths = [10] * 20
    a, b = best_fit_decreasing(lengths, 35, 1), best_fit_decreasing(lengths, 35, 2)
    assert [len(x) for x in a] == [3] * 6 + [2] and a != b


def test_row_longer_than_capacity_is_refused():
    with pytest.raises(ValueError):
        best_fit_decreasing([10, 40], 32, 0)


def test_no_label_across_a_boundary_and_targets_add_up():
    a = TokenRow([1, 2, 3, 4], [1, 2, 3, 4])  # text: every token a target
    b = TokenRow([5, 6, 7], [IGNORE, 6, 7])
    c = TokenRow([8, 9], [8, 9])
    ids, labels, segments = concat([(r.input_ids, r.labels) for r in (a, b, c)])
    packed = TokenRow(ids, labels, segments)
    assert segments == (4, 3, 2)
    # The first token of b and of c would be predicted from the previous sample's last token.
    assert labels.tolist() == [1, 2, 3, 4, IGNORE, 6, 7, IGNORE, 9]
    assert count_targets([packed]) == count_targets([a, b, c]) == 3 + 2 + 1


def test_collate_gives_position_ids_per_sample_and_no_mask():
    r1 = TokenRow(*concat([(np.array([1, 2, 3]), np.array([1, 2, 3])), (np.array([4, 5]), np.array([4, 5]))]))
    r2 = TokenRow(*concat([(np.array([6, 7]), np.array([6, 7]))]))
    batch = collate([r1, r2], pad_id=0)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["labels"][1].tolist() == [6, 7, IGNORE, IGNORE, IGNORE]


def _samples(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 400, size=n) for n in (11, 7, 16, 5, 9)]


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_packed_samples_do_not_attend_to_each_other(tmp_path, arch, attn):
    from transformers import AutoModelForCausalLM

    from relaytune.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()
    # As in training (model.load_model): with a KV cache, transformers ignores packed position_ids.
    model.config.use_cache = False
    samples = _samples()
    # Two packed rows of different widths, so the second one is padded as well.
    rows = [TokenRow(*concat([(s, s) for s in samples[:3]])), TokenRow(*concat([(s, s) for s in samples[3:]]))]
    batch = collate(rows, pad_id=0)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        alone = [model(input_ids=torch.as_tensor(s, dtype=torch.long)[None]).logits[0] for s in samples]
        # Proof that the check can fail: the same row with plain causal attention leaks.
        leaky = model(input_ids=batch["input_ids"][:1], attention_mask=torch.ones_like(batch["input_ids"][:1])).logits
    where = [(0, 0), (0, 11), (0, 18), (1, 0), (1, 5)]
    for (row, start), s, ref in zip(where, samples, alone):
        got = packed[row, start:start + len(s)]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[0, 11:18], alone[1], atol=1e-3)
    # The flat layout (one row, no padding; what flash attention needs) keeps them apart too.
    flat = collate(rows, pad_id=0, flat=True)
    assert flat["input_ids"].shape == (1, sum(len(s) for s in samples))
    with torch.no_grad():
        flat_logits = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits[0]
    start = 0
    for s, ref in zip(samples, alone):
        torch.testing.assert_close(flat_logits[start:start + len(s)], ref, atol=1e-5, rtol=1e-5)
        start += len(s)

    # And the loss: the packed batch's summed token loss is the sum of the samples' own.
    n = count_targets(rows)
    with torch.no_grad():
        packed_loss = model(**batch, num_items_in_batch=n).loss * n
        alone_loss = sum(model(input_ids=torch.as_tensor(s)[None], labels=torch.as_tensor(s)[None],
                               num_items_in_batch=1).loss for s in samples)
    assert n == sum(len(s) - 1 for s in samples)
    torch.testing.assert_close(packed_loss, alone_loss, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        flat_loss = model(**flat, num_items_in_batch=n).loss * n
    assert int((flat["labels"][0, 1:] != IGNORE).sum()) == n
    torch.testing.assert_close(flat_loss, alone_loss, atol=1e-4, rtol=1e-5)


def test_isolation_check_passes_for_training_models_and_catches_a_leak(tiny_model):
    from transformers import AutoModelForCausalLM

    from relaytune.data.packing import check_isolation

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    model.config.use_cache = False  # as model.load_model sets it for training
    model.train()
    assert check_isolation(model) is None
    assert model.training  # the check leaves the mode as it found it
    model.config.use_cache = True  # transformers then ignores packed position_ids
    assert "packed samples see each other" in check_isolation(model)


class NoisyLogits(torch.nn.Module):
    """A model whose logits carry 5% relative noise on every call, as a deep bf16/4-bit model's do."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, **kw):
        out = self.inner(**kw)
        noise = torch.randn(out.logits.shape, generator=self.gen) * 0.05 * out.logits.abs().mean()
        out.logits = out.logits + noise
        return out


def test_isolation_check_tells_rounding_noise_from_a_leak(tiny_model):
    from transformers import AutoModelForCausalLM

    from relaytune.data.packing import check_isolation

    inner = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    inner.config.use_cache = False
    noisy = NoisyLogits(inner)
    assert check_isolation(noisy) is None  # ~7% apart, but a deliberate leak moves them ~70%
    inner.config.use_cache = True
    why = check_isolation(noisy)
    assert why is not None and "when it follows the other sample on purpose" in why
