"""Training data: read, check, tokenize (cached), then cut, weight, split and pack.

`prepare_data(cfg, tokenizer)` returns the training and evaluation rows as
TokenRows; label IGNORE marks positions that carry no loss. The steps:

  read + check + tokenize  -> a TokenTable, cached in output_dir/data-cache/   (here)
  long rows                -> truncate, drop or error (on_long_rows)           (assemble.py)
  bad rows                 -> quarantine.jsonl; stop if more than max_bad_fraction
  split, weights, packing  -> pure functions of (table, settings, seed)

Everything after the cache is cheap and deterministic, so a resumed run gets
the very same rows, in the very same packed sequences, without tokenizing.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from relaytune.config.datasets import DatasetSource, as_sources
from relaytune.config.schema import TrainConfig
from relaytune.data import cache as data_cache
from relaytune.data.assemble import Prepared, assemble
from relaytune.data.cache import TokenTable
from relaytune.data.formats import BadRow, Fields, RawRow, detect, parse
from relaytune.data.read import data_files, excluding, one_load_per_source, read_rows
from relaytune.data.rows import IGNORE
from relaytune.data.templates import Template, resolve
from relaytune.data.tokenize import tokenize_samples
from relaytune.log import notice
from relaytune.run_dir import RunDir


def prepare_data(cfg: TrainConfig, tokenizer) -> Prepared:
    sources = [(s, "train") for s in as_sources(cfg.dataset)]
    if cfg.eval_dataset:
        sources.append((DatasetSource(path=cfg.eval_dataset), "eval"))
    template = resolve(cfg.chat_template, tokenizer)

    def build() -> TokenTable:
        return _build(sources, cfg, tokenizer, template)

    out = Path(cfg.output_dir).expanduser().resolve()
    for spec, _ in sources:
        folder = Path(spec.path).expanduser().resolve()
        if folder.is_dir() and folder in out.parents:
            notice(f"output_dir {out} lies inside the dataset folder {folder}; the run's own files there "
                   "are not read as data")
    # the run's own files (metrics, quarantine lists, the cache) are never data, on any resume
    with one_load_per_source(), excluding(out):  # the cache key and the rows both read a `datasets` source
        if cfg.dataset_cache:
            parts = data_cache.key_parts(cfg, sources, tokenizer, template)
            root = RunDir(Path(cfg.output_dir).expanduser()).data_cache
            table, hit = data_cache.load_or_build(root, parts, build)
            if hit:
                _relocate(table, sources)
        else:
            table = build()
            table.meta["digest"] = table.digest()
    return assemble(table, sources, cfg)


# --- read, check, tokenize: the expensive part, cached ---------------------------------------

@dataclass
class _Collected:
    """The usable rows of the sources tokenized so far, flat, and what was read and refused."""

    ids: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    source: list = field(default_factory=list)
    origins: list = field(default_factory=list)
    meta: dict = field(default_factory=lambda: {"read": [], "formats": [], "bad": []})

    def add(self, si: int, origin: str, result) -> bool:
        """Keep one tokenized row (ids, labels) of source `si`, or list it as bad; True if kept."""
        if isinstance(result, BadRow):
            self.meta["bad"].append([si, origin, str(result)])
            return False
        ids, labels = result
        if not np.any(labels[1:] != IGNORE):
            self.meta["bad"].append([si, origin, "no target tokens (nothing to learn in this row)"])
            return False
        self.ids.append(ids)
        self.masks.append(labels != IGNORE)
        self.source.append(si)
        self.origins.append(origin)
        return True

    def table(self, sources) -> TokenTable:
        self.meta["places"] = [_place(spec) for spec, _ in sources]
        offsets = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.cumsum([len(i) for i in self.ids], out=offsets[1:])
        flat = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        small = not flat.size or (flat.min() >= 0 and flat.max() < 2**16)  # uint16 halves the cache
        table = TokenTable(flat.astype(np.uint16 if small else np.int32),
                           np.concatenate(self.masks) if self.masks else np.zeros(0, bool),
                           offsets, np.asarray(self.source, dtype=np.int32), self.meta)
        table.origins = self.origins  # where each kept row came from, for long-row messages
        self.meta["source_digests"] = [_rows_digest(table, si) for si in range(len(sources))]
        return table


def _build(sources, cfg: TrainConfig, tokenizer, template: Template) -> TokenTable:
    found = _Collected()
    for si, (spec, _) in enumerate(sources):
        rows = read_rows(spec)
        samples, kept, refused = _parse_rows(rows, spec, cfg)
        found.meta["bad"] += [[si, origin, reason] for origin, reason in refused]
        formats: Counter = Counter()
        results = tokenize_samples(samples, tokenizer, template, cfg.train_on_inputs)
        bar = tqdm(total=len(samples), desc=f"tokenize {Path(spec.path).name}", unit="row",
                   mininterval=1.0, disable=None, leave=False)  # None: shown on a terminal only
        for (origin, kind), result in zip(kept, results):
            bar.update(1)
            if found.add(si, origin, result):
                formats[kind] += 1
        bar.close()
        found.meta["read"].append(len(rows))
        found.meta["formats"].append(dict(formats))
    return found.table(sources)


def _parse_rows(rows: list[RawRow], spec: DatasetSource, cfg: TrainConfig):
    """(samples, their (origin, format), the refused rows as (origin, reason)) of one source."""
    columns = spec.columns if spec.columns is not None else cfg.dataset_columns
    fields, fmt = Fields(cfg.dataset_text_field, columns), spec.format or cfg.dataset_format
    hint = _usual_format(rows, fields) if fmt == "auto" else None
    samples, kept, refused = [], [], []
    for row in rows:
        try:
            kind, sample = parse(row, fields, fmt, hint)
        except BadRow as e:
            refused.append((row.origin, str(e)))
            continue
        samples.append(sample)
        kept.append((row.origin, kind))
    return samples, kept, refused


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


def _usual_format(rows: list[RawRow], fields: Fields) -> str | None:
    """The most common format among the first rows: what a row that fits none is checked as."""
    counts = Counter(k for r in rows[:1000] if not r.error and (k := detect(r.data, fields)))
    return counts.most_common(1)[0][0] if counts else None
