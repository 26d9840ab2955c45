"""From the tokenized table to the rows a run trains on: cut, quarantine, split, weigh, pack.

Everything here is cheap and a pure function of (table, settings, seed), so it is
redone on every run, after the cache: a resumed run gets the very same rows, in the
very same packed sequences, and max_seq_length, packing, seed or weights can change
without tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relaytune import atomic
from relaytune.config.datasets import DatasetSource
from relaytune.config.schema import TrainConfig
from relaytune.data import packing
from relaytune.data.cache import TokenTable
from relaytune.data.rows import IGNORE, TokenRow
from relaytune.errors import UserError
from relaytune.log import info, warn
from relaytune.run_dir import RunDir

EVAL_QUARANTINE = "quarantine-eval_dataset.jsonl"  # beside RunDir.quarantine, for `eval_dataset`


class TokenRows(Sequence):
    """The rows of a split, built on access from the table: nothing is copied up front, so a
    cache hit costs no time per row, and packed sequences cost no memory until trained."""

    def __init__(self, table: TokenTable, idx: np.ndarray, kept_len: np.ndarray, bins: list | None = None):
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
    train: TokenRows
    eval: TokenRows
    fingerprint: str  # content hash of the rows and their packing, for exact-resume checks
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """The tokenized table, what each of its sources is for, and the run's settings."""

    table: TokenTable
    sources: list[tuple[DatasetSource, str]]  # (source, "train" or "eval"), in table order
    cfg: TrainConfig

    def members(self, role: str) -> list[int]:
        """Indices of the sources that play `role`."""
        return [i for i, (_, r) in enumerate(self.sources) if r == role]

    @property
    def roles(self) -> np.ndarray:
        """The role of every row of the table."""
        if not len(self.table):
            return np.zeros(0, str)
        return np.array([role for _, role in self.sources])[self.table.source]


@dataclass
class Cut:
    """What max_seq_length does to the rows, and which rows are unusable, each as
    (source index, origin, reason)."""

    kept_len: np.ndarray  # tokens kept of each row of the table
    usable: np.ndarray  # bool per row of the table
    bad: list[tuple] = field(default_factory=list)  # unusable rows (quarantined)
    dropped: list[tuple] = field(default_factory=list)  # too long, on_long_rows: drop
    truncated: int = 0  # too long, cut to max_seq_length


def assemble(table: TokenTable, sources: list, cfg: TrainConfig) -> Prepared:
    inputs = Inputs(table, sources, cfg)
    cut = cut_long_rows(inputs)
    for role in ("train", "eval"):
        quarantine(inputs, cut, role)
    train_idx, eval_idx = select(inputs, cut)
    if cut.truncated:
        info(f"{cut.truncated} of {len(table)} rows were longer than max_seq_length={cfg.max_seq_length} "
             "and were truncated")
    train = pack(TokenRows(table, train_idx, cut.kept_len), cfg, announce=True)
    evals = pack(TokenRows(table, eval_idx, cut.kept_len), cfg, announce=False)
    return Prepared(train, evals, fingerprint(inputs, train), _stats(inputs, cut, train, evals))


def cut_long_rows(inputs: Inputs) -> Cut:
    """Apply `on_long_rows` to the rows longer than max_seq_length."""
    table, cfg = inputs.table, inputs.cfg
    limit, lengths = cfg.max_seq_length, table.lengths
    long = np.flatnonzero(lengths > limit)
    if long.size and cfg.on_long_rows == "error":
        shown = "\n  ".join(f"{table.origins[r]}: {lengths[r]} tokens" for r in long[:5])
        raise UserError(f"{long.size} rows are longer than max_seq_length={limit} (on_long_rows: error):"
                        f"\n  {shown}\nRaise max_seq_length, or set on_long_rows to truncate or drop.")
    cut = Cut(np.minimum(lengths, limit), np.ones(len(table), dtype=bool), [tuple(b) for b in table.meta["bad"]])
    for r in long.tolist():
        where = (int(table.source[r]), table.origins[r])
        if cfg.on_long_rows == "drop":
            cut.usable[r] = False
            cut.dropped.append((*where, f"{lengths[r]} tokens, longer than max_seq_length={limit} (dropped)"))
        elif not np.any(table.mask[table.offsets[r] + 1: table.offsets[r] + limit]):
            cut.usable[r] = False
            cut.bad.append((*where, f"no target tokens left within max_seq_length={limit}"))
    if cfg.on_long_rows == "truncate":
        cut.truncated = int(np.count_nonzero(cut.usable[long]))
    return cut


def quarantine(inputs: Inputs, cut: Cut, role: str) -> None:
    """List the unusable and dropped rows of `role` with their reasons; stop if too many are unusable."""
    members = inputs.members(role)
    if not members:
        return
    bad = [b for b in cut.bad if b[0] in members]
    dropped = [d for d in cut.dropped if d[0] in members]
    qpath = quarantine_path(inputs.cfg, role)
    _write_listed(qpath, bad + dropped)
    key = "dataset" if role == "train" else "eval_dataset"
    if dropped:
        info(f"{len(dropped)} rows of `{key}` longer than max_seq_length={inputs.cfg.max_seq_length} were "
             f"dropped (listed in {qpath})")
    if bad:
        _judge_bad(bad, sum(inputs.table.meta["read"][i] for i in members), inputs.cfg, role)


def quarantine_path(cfg: TrainConfig, role: str) -> Path:
    run = RunDir(Path(cfg.output_dir).expanduser())
    return run.quarantine if role == "train" else run.root / EVAL_QUARANTINE


def _write_listed(qpath: Path, listed: list[tuple]) -> None:
    """Replace the list whole (atomically), so a torn file from a crash is never appended to."""
    try:
        if not listed:
            if qpath.is_file():
                qpath.unlink()  # ours, from an earlier run whose data has since been fixed
            return
        qpath.parent.mkdir(parents=True, exist_ok=True)
        atomic.replace_file(qpath, "".join(json.dumps({"where": origin, "reason": reason}, ensure_ascii=False)
                                           + "\n" for _, origin, reason in listed))
    except OSError as e:  # a read-only run folder: the list is informational, the rows are judged anyway
        warn(f"cannot write {qpath} ({e.strerror or e}); the unusable rows are not listed there")


def _judge_bad(bad: list[tuple], total: int, cfg: TrainConfig, role: str) -> None:
    """Warn about the unusable rows, or stop if they are more than max_bad_fraction of `total`."""
    key, qpath = ("dataset" if role == "train" else "eval_dataset"), quarantine_path(cfg, role)
    shown = "\n  ".join(f"{o}: {r}" for _, o, r in bad[:5])
    more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
    if len(bad) > cfg.max_bad_fraction * total:
        kinds = Counter(re.sub(r"\[\d+\]", "[i]", re.sub(r"column \d+", "column N", r)) for _, _, r in bad)
        summary = "\n  ".join(f"{n} x {k}" for k, n in kinds.most_common(5))
        suggestion = _suggest_columns(bad) if len(bad) > 0.5 * total else None
        if suggestion:
            mapping, columns = suggestion
            advice = (f"The rows have none of the fields relaytune knows (their columns: {', '.join(columns)}). "
                      f"Say which column is which with `dataset_columns`, for example:\n"
                      f"  dataset_columns: {mapping}\nand run again (all rows are listed in {qpath}).")
        else:
            advice = f"All are listed in {qpath}. Fix or remove them (or raise max_bad_fraction) and run again."
        raise UserError(
            f"`{key}`: {len(bad)} of {total} rows are unusable (more than max_bad_fraction="
            f"{cfg.max_bad_fraction:g}):\n  {shown}{more}\nBy reason:\n  {summary}\n{advice}")
    warn(f"{len(bad)} of {total} rows of `{key}` skipped (listed in {qpath}):\n  {shown}{more}")


# Usual names of the fields relaytune knows, in other datasets (lower case), and the field they are.
_ALIASES = {
    "instruction": ("question", "query", "prompt", "input", "instruction", "problem", "user", "human", "context"),
    "output": ("answer", "response", "output", "completion", "target", "solution", "reply", "assistant", "gpt",
               "label"),
    "system": ("system", "system_prompt"),
}
_UNKNOWN = re.compile(r"^no known format: .*; the row has (.*)$")


def _suggest_columns(bad: list[tuple]) -> tuple[str, list[str]] | None:
    """(a `dataset_columns` mapping, the columns found) when most bad rows failed for unknown columns."""
    found: Counter = Counter()
    unknown = 0
    for _, _, reason in bad:
        m = _UNKNOWN.match(reason)
        if m:
            unknown += 1
            found.update(re.findall(r"`([^`]+)`", m.group(1)))
    if unknown <= len(bad) / 2 or not found:
        return None
    columns = [c for c, _ in found.most_common()]
    mapping: dict[str, str] = {}
    for name, aliases in _ALIASES.items():
        hit = next((c for a in aliases for c in columns if c.lower() == a and c not in mapping.values()), None)
        if hit is not None:
            mapping[name] = hit
    for name, placeholder in (("instruction", "YOUR_PROMPT_COLUMN"), ("output", "YOUR_ANSWER_COLUMN")):
        if name not in mapping:
            mapping[name] = next((c for c in columns if c not in mapping.values()), placeholder)
    body = ", ".join(f"{k}: {mapping[k]}" for k in ("instruction", "output", "system") if k in mapping)
    return "{" + body + "}", columns


def select(inputs: Inputs, cut: Cut) -> tuple[np.ndarray, np.ndarray]:
    """Table indices of the training rows (split off and weighed) and of the evaluation rows."""
    cfg, roles = inputs.cfg, inputs.roles
    train_idx = np.flatnonzero(cut.usable & (roles == "train"))
    eval_idx = np.flatnonzero(cut.usable & (roles == "eval"))
    if not train_idx.size:
        raise UserError(f"`dataset`: no usable training rows in {cfg.dataset}")
    if not cfg.eval_dataset and cfg.val_set_size > 0:
        train_idx, eval_idx = split(train_idx, cfg)
    return weigh(inputs, train_idx), eval_idx


def split(idx: np.ndarray, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """A fixed split by seed, so a resumed run sees the same training rows."""
    n_eval = int(cfg.val_set_size) if cfg.val_set_size >= 1 else max(1, round(cfg.val_set_size * len(idx)))
    if n_eval >= len(idx):
        raise UserError(f"`val_set_size` ({cfg.val_set_size}) leaves no training rows out of {len(idx)}")
    perm = np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(idx))
    held = np.zeros(len(idx), dtype=bool)
    held[perm[:n_eval]] = True
    return idx[~held], idx[held]


def weigh(inputs: Inputs, idx: np.ndarray) -> np.ndarray:
    """Each source's rows `weight` times: whole copies, then a seeded share of the rest."""
    if all(spec.weight == 1 for spec, role in inputs.sources if role == "train"):
        return idx
    out = []
    for si, (spec, role) in enumerate(inputs.sources):
        mine = idx[inputs.table.source[idx] == si]
        if role != "train" or not mine.size:
            continue
        whole, frac = int(spec.weight), spec.weight - int(spec.weight)
        out += [mine] * whole
        extra = round(frac * len(mine))
        if extra:
            pick = np.random.default_rng([inputs.cfg.seed, 0x3E1, si]).choice(len(mine), extra, replace=False)
            out.append(mine[np.sort(pick)])
    if not out or not sum(len(o) for o in out):
        raise UserError("`dataset`: the weights select no training rows (every weight rounds to 0 rows)")
    return np.concatenate(out)


def pack(rows: TokenRows, cfg: TrainConfig, announce: bool) -> TokenRows:
    """The rows in best-fit-decreasing bins when packing (a pure function of the lengths and
    the seed, so a resumed run packs exactly as before); `announce` says how full they are."""
    if not cfg.packing or not rows.idx.size:
        return rows
    lens = rows.kept[rows.idx]
    bins = packing.best_fit_decreasing(lens, cfg.max_seq_length, cfg.seed)
    if announce:
        eff = packing.efficiency(int(lens.sum()), len(bins), cfg.max_seq_length)
        info(f"packed {len(rows.idx)} rows into {len(bins)} sequences of up to {cfg.max_seq_length} "
             f"tokens ({eff:.1%} of token slots hold real tokens)")
    return TokenRows(rows.table, rows.idx, rows.kept, bins)


def fingerprint(inputs: Inputs, train: TokenRows) -> str:
    """What the training rows are (table content, cut, selection, order, packing), not how they
    were made. Evaluation rows do not change training, so eval_dataset may change on resume."""
    cfg = inputs.cfg
    used = [d for d, (_, role) in zip(inputs.table.meta["source_digests"], inputs.sources) if role == "train"]
    h = hashlib.sha256(f"{used}|{cfg.max_seq_length}|{cfg.packing}".encode())
    h.update(train.idx.astype(np.int64).tobytes() + train.kept[train.idx].astype(np.int64).tobytes())
    h.update(json.dumps(train.bins).encode())
    return h.hexdigest()[:16]


def _stats(inputs: Inputs, cut: Cut, train: TokenRows, evals: TokenRows) -> dict:
    table, cfg, members = inputs.table, inputs.cfg, inputs.members("train")
    formats: Counter = Counter()
    for i in members:
        formats.update(table.meta["formats"][i])
    raw = table.lengths[train.idx] if train.idx.size else np.zeros(1, dtype=np.int64)
    tokens = int(cut.kept_len[train.idx].sum())
    stats = {
        "rows_read": sum(table.meta["read"][i] for i in members),
        "rows_by_format": dict(sorted(formats.items())), "quarantined": len(cut.bad), "dropped": len(cut.dropped),
        "truncated": cut.truncated, "train_rows": int(train.idx.size), "eval_rows": int(evals.idx.size),
        "train_sequences": len(train), "train_tokens": tokens,
        "length_percentiles": {f"p{q}": int(np.percentile(raw, q)) for q in (50, 90, 99)} | {"max": int(raw.max())},
    }
    if cfg.packing:
        stats["packing_efficiency"] = round(packing.efficiency(tokens, len(train), cfg.max_seq_length), 4)
    return stats
