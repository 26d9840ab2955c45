"""Training data: read, check, tokenize (cached), then cut, weight, split and pack.

`prepare_data(cfg, tokenizer)` returns the training and evaluation rows as
TokenRows; label -100 marks positions that carry no loss. The steps:

  read + check + tokenize  -> a TokenTable, cached in output_dir/data-cache/
  long rows                -> truncate, drop or error (on_long_rows)
  bad rows                 -> quarantine.jsonl; stop if more than max_bad_fraction
  split, weights, packing  -> pure functions of (table, settings, seed)

Everything after the cache is cheap and deterministic, so a resumed run gets
the very same rows, in the very same packed sequences, without tokenizing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from relaytune.data import cache as data_cache
from relaytune.data import packing
from relaytune.config.schema import TrainConfig
from relaytune.data.cache import TokenTable
from relaytune.data.formats import BadRow, Fields, detect, parse
from relaytune.data.read import data_files, read_rows
from relaytune.config.datasets import DatasetSource, as_sources
from relaytune.data.tokenize import IGNORE, tokenize_samples
from relaytune.errors import UserError
from relaytune.log import info, warn
from relaytune.data.templates import Template, resolve

MAX_BAD_FRACTION = 0.01  # the default of `max_bad_fraction`


@dataclass(eq=False)
class TokenRow:
    """One training sequence; `segments` holds the sample lengths of a packed one."""

    input_ids: np.ndarray  # int32 (lists are converted)
    labels: np.ndarray
    segments: tuple[int, ...] | None = None

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.labels = np.asarray(self.labels, dtype=np.int32)

    @property
    def targets(self) -> int:
        """Tokens that carry loss (the model's loss shifts labels by one; label 0 is never predicted)."""
        return int(np.count_nonzero(self.labels[1:] != IGNORE))


class Rows(Sequence):
    """The rows of a split, built on access from the table: nothing is copied up front, so a
    cache hit costs no time per row, and packed sequences cost no memory until trained."""

    def __init__(self, table: TokenTable, idx: np.ndarray, kept_len: np.ndarray, bins: list | None):
        self.table, self.idx, self.kept, self.bins = table, idx, kept_len, bins

    def __len__(self) -> int:
        return len(self.bins) if self.bins is not None else len(self.idx)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self.bins is None:
            return TokenRow(*self._piece(int(self.idx[i])))
        return TokenRow(*packing.concat([self._piece(int(self.idx[j])) for j in self.bins[i]]))

    def _piece(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.table.offsets[r])
        ids = self.table.ids[start:start + int(self.kept[r])].astype(np.int32)
        return ids, np.where(self.table.mask[start:start + len(ids)], ids, IGNORE).astype(np.int32)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens in each row, without building the rows."""
        if self.bins is None:
            return self.kept[self.idx]
        per = self.kept[self.idx]
        return np.array([int(per[b].sum()) for b in self.bins], dtype=np.int64)


@dataclass
class Prepared:
    train: Rows  # a sequence of TokenRow
    eval: Rows
    fingerprint: str  # content hash of the rows and their packing, for exact-resume checks
    stats: dict = field(default_factory=dict)


def prepare_data(cfg: TrainConfig, tokenizer) -> Prepared:
    sources = [(s, "train") for s in as_sources(cfg.dataset)]
    if cfg.eval_dataset:
        sources.append((DatasetSource(path=cfg.eval_dataset), "eval"))
    template = resolve(cfg.chat_template, tokenizer)

    def build() -> TokenTable:
        return _build(sources, cfg, tokenizer, template)

    if cfg.dataset_cache:
        parts = data_cache.key_parts(cfg, sources, tokenizer, template)
        table, hit = data_cache.load_or_build(Path(cfg.output_dir).expanduser() / "data-cache", parts, build)
        if hit:
            _relocate(table, sources)
    else:
        table = build()
        table.meta["digest"] = table.digest()
    return assemble(table, sources, cfg)


def tokenize(sample: dict, tokenizer, train_on_inputs: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and labels for one normalised row, with the tokenizer's own template."""
    (result,) = tokenize_samples([sample], tokenizer, resolve(None, tokenizer), train_on_inputs)
    if isinstance(result, BadRow):
        raise result
    return result[0].tolist(), result[1].tolist()


# --- read, check, tokenize: the expensive part, cached ---------------------------------------

def _build(sources, cfg: TrainConfig, tokenizer, template: Template) -> TokenTable:
    ids, masks, lengths, source, origins = [], [], [], [], []
    meta: dict = {"read": [], "formats": [], "bad": []}
    for si, (spec, _) in enumerate(sources):
        rows = read_rows(spec)
        columns = spec.columns if spec.columns is not None else cfg.dataset_columns
        fields, fmt = Fields(cfg.dataset_text_field, columns), spec.format or cfg.dataset_format
        hint = _usual_format(rows, fields) if fmt == "auto" else None
        samples, kept = [], []
        for row in rows:
            try:
                kind, sample = parse(row, fields, fmt, hint)
            except BadRow as e:
                meta["bad"].append([si, row.origin, str(e)])
                continue
            samples.append(sample)
            kept.append((row.origin, kind))
        formats: Counter = Counter()
        results = tokenize_samples(samples, tokenizer, template, cfg.train_on_inputs)
        bar = tqdm(total=len(samples), desc=f"tokenize {Path(spec.path).name}", unit="row",
                   mininterval=1.0, disable=None, leave=False)  # None: shown on a terminal only
        for (origin, kind), result in zip(kept, results):
            bar.update(1)
            if isinstance(result, BadRow):
                meta["bad"].append([si, origin, str(result)])
                continue
            if not np.any(result[1][1:] != IGNORE):
                meta["bad"].append([si, origin, "no target tokens (nothing to learn in this row)"])
                continue
            ids.append(result[0])
            masks.append(result[1] != IGNORE)
            lengths.append(len(result[0]))
            source.append(si)
            origins.append(origin)
            formats[kind] += 1
        bar.close()
        meta["read"].append(len(rows))
        meta["formats"].append(dict(formats))
    meta["places"] = [_place(spec) for spec, _ in sources]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    small = not flat.size or (flat.min() >= 0 and flat.max() < 2**16)  # uint16 halves the cache
    table = TokenTable(flat.astype(np.uint16 if small else np.int32),
                       np.concatenate(masks) if masks else np.zeros(0, bool),
                       offsets, np.asarray(source, dtype=np.int32), meta)
    table.origins = origins  # where each kept row came from, for long-row messages
    meta["source_digests"] = [_rows_digest(table, si) for si in range(len(sources))]
    return table


def _rows_digest(table: TokenTable, si: int) -> str:
    """Content hash of one source's rows (they are contiguous in the table)."""
    rows = np.flatnonzero(table.source == si)
    h = hashlib.sha256(str(table.ids.dtype).encode())
    if rows.size:
        a, b = int(table.offsets[rows[0]]), int(table.offsets[rows[-1] + 1])
        for part in (table.ids[a:b], table.mask[a:b], np.diff(table.offsets[rows[0]:rows[-1] + 2])):
            h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def _place(spec: DatasetSource) -> list[str]:
    files = data_files(spec)
    return [spec.path] if files is None else [str(f) for f in files]


def _relocate(table: TokenTable, sources) -> None:
    """Data moved since it was cached (same content, new path): name the rows by the new path."""
    now = [_place(spec) for spec, _ in sources]
    moved = {old: new for was, cur in zip(table.meta.get("places", []), now) if len(was) == len(cur)
             for old, new in zip(was, cur) if old != new}
    if not moved:
        return

    def fix(origin: str) -> str:
        head, sep, tail = origin.rpartition(":")
        return moved.get(head, head) + sep + tail

    table.origins = [fix(o) for o in table.origins]
    table.meta["bad"] = [[si, fix(o), reason] for si, o, reason in table.meta["bad"]]
    table.meta["places"] = now


def _usual_format(rows, fields: Fields) -> str | None:
    """The most common format among the first rows: what a row that fits none is checked as."""
    counts = Counter(k for r in rows[:1000] if not r.error and (k := detect(r.data, fields)))
    return counts.most_common(1)[0][0] if counts else None


# --- cut, check, split, weight, pack: cheap, redone on every run -----------------------------

def assemble(table: TokenTable, sources, cfg: TrainConfig) -> Prepared:
    limit, lengths = cfg.max_seq_length, table.lengths
    roles = np.array([role for _, role in sources])[table.source] if len(table) else np.zeros(0, str)
    bad = [tuple(b) for b in table.meta["bad"]]
    dropped, usable = [], np.ones(len(table), dtype=bool)
    long = np.flatnonzero(lengths > limit)
    if long.size and cfg.on_long_rows == "error":
        shown = "\n  ".join(f"{_origin(table, r)}: {lengths[r]} tokens" for r in long[:5])
        raise UserError(f"{long.size} rows are longer than max_seq_length={limit} (on_long_rows: error):"
                        f"\n  {shown}\nRaise max_seq_length, or set on_long_rows to truncate or drop.")
    for r in long.tolist():
        where = (int(table.source[r]), _origin(table, r))
        if cfg.on_long_rows == "drop":
            usable[r] = False
            dropped.append((*where, f"{lengths[r]} tokens, longer than max_seq_length={limit} (dropped)"))
        elif not np.any(table.mask[table.offsets[r] + 1: table.offsets[r] + limit]):
            usable[r] = False
            bad.append((*where, f"no target tokens left within max_seq_length={limit}"))
    kept_len = np.minimum(lengths, limit)
    truncated = int(np.count_nonzero(usable[long])) if cfg.on_long_rows == "truncate" else 0
    for role in ("train", "eval"):
        members = [i for i, (_, r) in enumerate(sources) if r == role]
        if members:
            _quarantine([b for b in bad if b[0] in members], [d for d in dropped if d[0] in members],
                        sum(table.meta["read"][i] for i in members), cfg, role)

    train_idx = np.flatnonzero(usable & (roles == "train"))
    eval_idx = np.flatnonzero(usable & (roles == "eval"))
    if not train_idx.size:
        raise UserError(f"`dataset`: no usable training rows in {cfg.dataset}")
    if not cfg.eval_dataset and cfg.val_set_size > 0:
        train_idx, eval_idx = _split(train_idx, cfg)
    train_idx = _weigh(train_idx, table, sources, cfg.seed)
    if truncated:
        info(f"{truncated} of {len(table)} rows were longer than max_seq_length={limit} and were truncated")
    train, evals = _rows(table, train_idx, kept_len, cfg, "train"), _rows(table, eval_idx, kept_len, cfg, "eval")
    stats = _stats(table, sources, train_idx, eval_idx, train, kept_len, bad, dropped, truncated, cfg)
    # What the training rows are (table content, cut, selection, order, packing), not how they
    # were made. Evaluation rows do not change training, so eval_dataset may change on resume.
    used = [d for d, (_, role) in zip(table.meta["source_digests"], sources) if role == "train"]
    h = hashlib.sha256(f"{used}|{limit}|{cfg.packing}".encode())
    h.update(train.idx.astype(np.int64).tobytes() + kept_len[train.idx].astype(np.int64).tobytes())
    h.update(json.dumps(train.bins).encode())
    return Prepared(train, evals, h.hexdigest()[:16], stats)


def _origin(table: TokenTable, r: int) -> str:
    return table.origins[r]


def _split(idx: np.ndarray, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """A fixed split by seed, so a resumed run sees the same training rows."""
    n_eval = int(cfg.val_set_size) if cfg.val_set_size >= 1 else max(1, round(cfg.val_set_size * len(idx)))
    if n_eval >= len(idx):
        raise UserError(f"`val_set_size` ({cfg.val_set_size}) leaves no training rows out of {len(idx)}")
    perm = np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(idx))
    held = np.zeros(len(idx), dtype=bool)
    held[perm[:n_eval]] = True
    return idx[~held], idx[held]


def _weigh(idx: np.ndarray, table: TokenTable, sources, seed: int) -> np.ndarray:
    """Each source's rows `weight` times: whole copies, then a seeded share of the rest."""
    if all(spec.weight == 1 for spec, role in sources if role == "train"):
        return idx
    out = []
    for si, (spec, role) in enumerate(sources):
        mine = idx[table.source[idx] == si]
        if role != "train" or not mine.size:
            continue
        whole, frac = int(spec.weight), spec.weight - int(spec.weight)
        out += [mine] * whole
        extra = round(frac * len(mine))
        if extra:
            pick = np.random.default_rng([seed, 0x3E1, si]).choice(len(mine), extra, replace=False)
            out.append(mine[np.sort(pick)])
    if not out or not sum(len(o) for o in out):
        raise UserError("`dataset`: the weights select no training rows (every weight rounds to 0 rows)")
    return np.concatenate(out)


def _rows(table: TokenTable, idx: np.ndarray, kept_len: np.ndarray, cfg: TrainConfig, what: str) -> Rows:
    """The split's rows; when packing, best-fit-decreasing bins of them (a pure function of
    the lengths and the seed, so a resumed run packs exactly as before)."""
    if not cfg.packing or not idx.size:
        return Rows(table, idx, kept_len, None)
    lens = kept_len[idx]
    bins = packing.best_fit_decreasing(lens, cfg.max_seq_length, cfg.seed)
    if what == "train":
        eff = packing.efficiency(int(lens.sum()), len(bins), cfg.max_seq_length)
        info(f"packed {len(idx)} rows into {len(bins)} sequences of up to {cfg.max_seq_length} "
             f"tokens ({eff:.1%} of token slots hold real tokens)")
    return Rows(table, idx, kept_len, bins)


def _quarantine(bad: list, dropped: list, total: int, cfg: TrainConfig, role: str) -> None:
    """Write the bad rows with their reasons; stop if there are too many of them."""
    key = "dataset" if role == "train" else "eval_dataset"
    out = Path(cfg.output_dir).expanduser()
    qpath = out / ("quarantine.jsonl" if role == "train" else "quarantine-eval_dataset.jsonl")
    listed = bad + dropped
    if not listed:
        if qpath.is_file():
            qpath.unlink()  # ours, from an earlier run whose data has since been fixed
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = qpath.with_name(f".{qpath.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for _, origin, reason in listed:
            fh.write(json.dumps({"where": origin, "reason": reason}, ensure_ascii=False) + "\n")
    os.replace(tmp, qpath)
    if dropped:
        info(f"{len(dropped)} rows of `{key}` longer than max_seq_length={cfg.max_seq_length} were "
             f"dropped (listed in {qpath})")
    if not bad:
        return
    shown = "\n  ".join(f"{o}: {r}" for _, o, r in bad[:5])
    more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
    if len(bad) > cfg.max_bad_fraction * total:
        kinds = Counter(re.sub(r"\[\d+\]", "[i]", re.sub(r"column \d+", "column N", r)) for _, _, r in bad)
        summary = "\n  ".join(f"{n} x {k}" for k, n in kinds.most_common(5))
        raise UserError(
            f"`{key}`: {len(bad)} of {total} rows are unusable (more than max_bad_fraction="
            f"{cfg.max_bad_fraction:g}):\n  {shown}{more}\nBy reason:\n  {summary}\n"
            f"All are listed in {qpath}. Fix or remove them (or raise max_bad_fraction) and run again.")
    warn(f"{len(bad)} of {total} rows of `{key}` skipped (listed in {qpath}):\n  {shown}{more}")


def _stats(table, sources, train_idx, eval_idx, train, kept_len, bad, dropped, truncated, cfg) -> dict:
    formats: Counter = Counter()
    for i, (_, role) in enumerate(sources):
        if role == "train":
            formats.update(table.meta["formats"][i])
    raw = table.lengths[train_idx] if train_idx.size else np.zeros(1, dtype=np.int64)
    tokens = int(kept_len[train_idx].sum())
    stats = {
        "rows_read": sum(n for n, (_, r) in zip(table.meta["read"], sources) if r == "train"),
        "rows_by_format": dict(sorted(formats.items())), "quarantined": len(bad), "dropped": len(dropped),
        "truncated": truncated, "train_rows": int(train_idx.size), "eval_rows": int(eval_idx.size),
        "train_sequences": len(train), "train_tokens": tokens,
        "length_percentiles": {f"p{q}": int(np.percentile(raw, q)) for q in (50, 90, 99)} | {"max": int(raw.max())},
    }
    if cfg.packing:
        stats["packing_efficiency"] = round(packing.efficiency(tokens, len(train), cfg.max_seq_length), 4)
    return stats


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
