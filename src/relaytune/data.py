"""Training data: read, validate, tokenize with loss masks, split off evaluation rows.

`prepare_data(cfg, tokenizer)` returns token rows; label -100 marks positions
that carry no loss. Chat rows go through the tokenizer's chat template and, by
default, only assistant tokens (with the template's end-of-turn token) are
targets. Bad rows are quarantined with their file:line and reason; too many of
them stop the run before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import TrainConfig
from .data_read import BadRow, Row, normalise, read_rows
from .errors import UserError
from .log import info, warn

IGNORE = -100
MAX_BAD_FRACTION = 0.01


@dataclass
class TokenRow:
    input_ids: list[int]
    labels: list[int]

    @property
    def targets(self) -> int:
        return sum(1 for t in self.labels[1:] if t != IGNORE)


@dataclass
class Prepared:
    train: list[TokenRow]
    eval: list[TokenRow]
    fingerprint: str  # content hash of what was read, for exact-resume checks
    stats: dict = field(default_factory=dict)


def prepare_data(cfg: TrainConfig, tokenizer) -> Prepared:
    rows = read_rows(cfg.dataset)
    if not rows:
        raise UserError(f"`dataset`: {cfg.dataset} holds no rows")
    train, bad, truncated = _tokenize_all(rows, cfg, tokenizer)
    _handle_bad(bad, len(rows), cfg)
    eval_rows: list[TokenRow] = []
    if cfg.eval_dataset:
        eval_rows, eval_bad, _ = _tokenize_all(read_rows(cfg.eval_dataset), cfg, tokenizer)
        _handle_bad(eval_bad, len(eval_rows) + len(eval_bad), cfg, "eval_dataset")
    elif cfg.val_set_size > 0:
        n_eval = int(cfg.val_set_size) if cfg.val_set_size >= 1 else max(1, round(cfg.val_set_size * len(train)))
        if n_eval >= len(train):
            raise UserError(f"`val_set_size` ({cfg.val_set_size}) leaves no training rows out of {len(train)}")
        # A fixed split by seed, so a resumed run sees the same training rows.
        perm = np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(train))
        held = set(perm[:n_eval].tolist())
        eval_rows = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
    if not train:
        raise UserError(f"`dataset`: no usable training rows in {cfg.dataset}")
    if truncated:
        info(f"{truncated} of {len(rows)} rows were longer than max_seq_length={cfg.max_seq_length} "
             "and were truncated")
    stats = {"rows": len(rows), "train_rows": len(train), "eval_rows": len(eval_rows),
             "quarantined": len(bad), "truncated": truncated,
             "train_tokens": sum(len(r.input_ids) for r in train)}
    return Prepared(train, eval_rows, _fingerprint(cfg, train, eval_rows), stats)


def _tokenize_all(rows: list[Row], cfg: TrainConfig, tokenizer):
    out, bad, truncated = [], [], 0
    for row in rows:
        try:
            ids, labels = tokenize(normalise(row, cfg.dataset_text_field), tokenizer, cfg.train_on_inputs)
        except BadRow as e:
            bad.append((row.origin, str(e)))
            continue
        if len(ids) > cfg.max_seq_length:
            ids, labels = ids[: cfg.max_seq_length], labels[: cfg.max_seq_length]
            truncated += 1
        if not any(t != IGNORE for t in labels[1:]):
            bad.append((row.origin, f"no target tokens left within max_seq_length={cfg.max_seq_length}"))
            continue
        out.append(TokenRow(ids, labels))
    return out, bad, truncated


def _handle_bad(bad: list[tuple[str, str]], total: int, cfg: TrainConfig, key: str = "dataset") -> None:
    if not bad:
        return
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    qpath = out / ("quarantine.jsonl" if key == "dataset" else f"quarantine-{key}.jsonl")
    with open(qpath, "w", encoding="utf-8") as fh:
        for origin, reason in bad:
            fh.write(json.dumps({"where": origin, "reason": reason}, ensure_ascii=False) + "\n")
    shown = "\n  ".join(f"{o}: {r}" for o, r in bad[:5])
    more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
    if len(bad) > MAX_BAD_FRACTION * total:
        raise UserError(
            f"`{key}`: {len(bad)} of {total} rows are unusable (more than {MAX_BAD_FRACTION:.0%}):\n  "
            f"{shown}{more}\nAll are listed in {qpath}. Fix them, or remove them, and run again.")
    warn(f"{len(bad)} of {total} rows skipped (listed in {qpath}):\n  {shown}{more}")


def tokenize(sample: dict, tokenizer, train_on_inputs: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and labels for one normalised row."""
    if "text" in sample:
        ids = _encode(tokenizer, sample["text"], specials=True) + _eos(tokenizer)
        return ids, list(ids)
    if "prompt" in sample:
        prompt = _encode(tokenizer, sample["prompt"], specials=True)
        completion = _encode(tokenizer, sample["completion"], specials=False) + _eos(tokenizer)
        ids = prompt + completion
        return ids, (list(ids) if train_on_inputs else [IGNORE] * len(prompt) + completion)
    return _tokenize_chat(sample["messages"], tokenizer, train_on_inputs)


def _tokenize_chat(messages: list[dict], tokenizer, train_on_inputs: bool):
    if not getattr(tokenizer, "chat_template", None):
        return _tokenize_chat_plain(messages, tokenizer, train_on_inputs)
    full = _render(tokenizer, messages, False)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        through = _render(tokenizer, messages[: i + 1], False).rstrip()
        if full.startswith(through) and through.startswith(before):
            spans.append((len(before), len(through)))
        else:  # a template that rewrites earlier turns: find the reply text itself
            start = full.find(m["content"], cursor)
            if start < 0:
                raise BadRow(f"`messages[{i}]`: the chat template drops this assistant turn")
            spans.append((start, start + len(m["content"])))
        cursor = spans[-1][1]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on_inputs:
        return ids, list(ids)
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"]):
        inside = any(s <= a < e or (a == b and s < a <= e) for s, e in spans)
        labels.append(tok if inside else IGNORE)
    return ids, labels


def _tokenize_chat_plain(messages, tokenizer, train_on_inputs):
    """For base models without a chat template: a plain, documented prompt format."""
    ids, labels = [], []
    for m in messages:
        head = _encode(tokenizer, f"### {m['role'].capitalize()}:\n", specials=False)
        body = _encode(tokenizer, m["content"] + "\n\n", specials=False)
        if m["role"] == "assistant":
            body = body + _eos(tokenizer)
        target = m["role"] == "assistant" or train_on_inputs
        ids += head + body
        labels += (head if train_on_inputs else [IGNORE] * len(head)) + (body if target else [IGNORE] * len(body))
    return ids, labels


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _encode(tokenizer, text: str, specials: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=specials)["input_ids"])


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _fingerprint(cfg: TrainConfig, train: list[TokenRow], eval_rows: list[TokenRow]) -> str:
    h = hashlib.sha256()
    for rows in (train, eval_rows):
        for r in rows:
            h.update(np.asarray(r.input_ids, dtype=np.int64).tobytes())
            h.update(np.asarray(r.labels, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
