"""Normalised samples -> token ids and labels, in batches.

Labels are the token ids where the model should learn, IGNORE elsewhere:
  chat:              the assistant turns (with the template's end-of-turn token);
  prompt/completion: the completion plus eos;
  text:              everything plus eos;
  train_on_inputs:   everything.
The tokenizer is called once per kind of text per chunk of rows, not once per
row: its batch path runs in Rust on all cores, and the per-call overhead of
transformers is paid once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relaytune.data.formats import BadRow
from relaytune.data.rows import IGNORE
from relaytune.data.templates import Renderer, Template

CHUNK = 4096  # rows tokenized per batch: bounds memory, keeps the batch path fast


@dataclass(frozen=True)
class _Setup:
    """How every sample of one call is tokenized."""

    tokenizer: object
    renderer: Renderer | None  # None: the plain "### Role:" format
    eos: list[int]  # appended after text, completions and plain-format replies
    train_on_inputs: bool


def tokenize_samples(samples: list[dict], tokenizer, template: Template, train_on_inputs: bool):
    """Yield, for each sample in order, (ids, labels) as int32 arrays, or a BadRow."""
    renderer = Renderer(template, tokenizer) if template.text is not None else None
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    setup = _Setup(tokenizer, renderer, eos, train_on_inputs)
    for start in range(0, len(samples), CHUNK):
        yield from _chunk(samples[start:start + CHUNK], setup)


def _chunk(samples, setup: _Setup):
    tokenizer, renderer, eos, train_on_inputs = setup.tokenizer, setup.renderer, setup.eos, setup.train_on_inputs
    out: list = [None] * len(samples)
    chats, texts, pcs, plains = [], [], [], []
    for k, s in enumerate(samples):
        if "messages" in s:
            if renderer is None:
                plains.append(k)
                continue
            try:
                text, spans = renderer.render_with_spans(s["messages"], s.get("train"))
                chats.append((k, text, spans))
            except BadRow as e:
                out[k] = e
        elif "prompt" in s:
            pcs.append(k)
        else:
            texts.append(k)
    if chats:
        _chat(chats, setup, out)
    if texts:
        for k, ids in zip(texts, _encode(tokenizer, [samples[k]["text"] for k in texts], True)):
            ids = ids + eos
            out[k] = (ids, ids)
    if pcs:
        prompts = _encode(tokenizer, [samples[k]["prompt"] for k in pcs], True)
        completions = _encode(tokenizer, [samples[k]["completion"] for k in pcs], False)
        for k, p, c in zip(pcs, prompts, completions):
            ids = p + c + eos
            out[k] = (ids, ids if train_on_inputs else [IGNORE] * len(p) + c + eos)
    if plains:
        _plain([(k, samples[k]) for k in plains], setup, out)
    for item in out:
        if isinstance(item, BadRow):
            yield item
        else:
            yield np.asarray(item[0], dtype=np.int32), np.asarray(item[1], dtype=np.int32)


def _chat(chats, setup: _Setup, out):
    tokenizer, train_on_inputs = setup.tokenizer, setup.train_on_inputs
    texts = [t for _, t, _ in chats]
    try:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets: encode piece by piece
        for k, text, spans in chats:
            out[k] = _pieces_by_span(text, spans, setup)
        return
    for (k, _, spans), ids, offsets in zip(chats, enc["input_ids"], enc["offset_mapping"]):
        ids = np.asarray(ids, dtype=np.int32)
        if train_on_inputs:
            out[k] = (ids, ids)
            continue
        off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        a, b = off[:, 0], off[:, 1]
        inside = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            # a token belongs to the span its first character is in (zero-width: its position)
            inside |= ((a >= s) & (a < e)) | ((a == b) & (a > s) & (a <= e))
        out[k] = (ids, np.where(inside, ids, IGNORE))


def _pieces_by_span(text, spans, setup: _Setup):
    tokenizer, train_on_inputs = setup.tokenizer, setup.train_on_inputs
    ids, labels, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for piece, target in ((text[pos:s], False), (text[s:e], True)):
            if piece:
                p = _encode(tokenizer, [piece], False)[0]
                ids += p
                labels += p if (target or train_on_inputs) else [IGNORE] * len(p)
        pos = e
    return ids, labels


def _plain(items, setup: _Setup, out):
    """Base models without a template: "### Role:\\n" + content + "\\n\\n", eos after replies."""
    tokenizer, eos, train_on_inputs = setup.tokenizer, setup.eos, setup.train_on_inputs
    pieces = []
    for _, s in items:
        for m in s["messages"]:
            pieces += [f"### {m['role'].capitalize()}:\n", m["content"] + "\n\n"]
    encoded = iter(_encode(tokenizer, pieces, False))
    for k, s in items:
        ids, labels = [], []
        train = s.get("train") or [m["role"] == "assistant" for m in s["messages"]]
        for m, target in zip(s["messages"], train):
            head, body = next(encoded), next(encoded)
            if m["role"] == "assistant":
                body = body + eos
            ids += head + body
            labels += (head if train_on_inputs else [IGNORE] * len(head)) + \
                      (body if target or train_on_inputs else [IGNORE] * len(body))
        out[k] = (ids, labels)


def _encode(tokenizer, texts: list[str], specials: bool) -> list[list[int]]:
    return [list(x) for x in tokenizer(texts, add_special_tokens=specials)["input_ids"]]
