"""The tokenization cache: `output_dir/data-cache/<key>/`, written like a checkpoint.

The key is a hash of everything tokenization depends on: the content of the
data (file bytes, or the `datasets` fingerprint), the tokenizer (its full
serialised vocabulary, merges and specials), the chat template, the mask
setting, the format and column settings, and the library versions. What is
stored is per-row tokens *before* truncation, packing, weighting and splitting:
those are cheap and redone on every load, so max_seq_length, packing, seed or
weights can change without tokenizing again.

Files: tokens.safetensors (flat uint16/int32 ids, the target mask as bits, int64
row offsets, int32 source index), table.json (bad rows, counts), origins.json
(file:line of each row, read only for messages) and manifest.json
(sha256 and size of each, in the checkpoint format, so `atomic.verify` checks
it). Written by `atomic.commit_folder` (tmp folder, fsync, rename; fault points
`cache:*`); a damaged entry is rebuilt; an entry whose key differs explains what
changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relaytune import atomic
from relaytune.atomic import MANIFEST, read_manifest, verify
from relaytune.data.read import source_digest
from relaytune.log import info, notice, warn

VERSION = 3  # bump when tokenization changes in a way the key does not capture
KEEP = 3  # entries kept: the current one and the two most recently used others
FILES = ("tokens.safetensors", "table.json", "origins.json")

_sources: list[Path] = []  # other runs' data-cache folders to read on a miss (a relay), never written


@contextlib.contextmanager
def reading_from(roots: list[Path]):
    """Within: a missing entry is looked up in these caches (another run's, perhaps read-only) and,
    found intact, copied into this run's own cache instead of tokenizing again."""
    before = list(_sources)
    _sources[:] = [Path(r) for r in roots]
    try:
        yield
    finally:
        _sources[:] = before


@dataclass
class TokenTable:
    """Tokenized rows of every source, flat. A label is always the token itself or IGNORE,
    so a boolean target mask stores it: with uint16 ids (vocabularies up to 65,536) that is
    3 bytes per token instead of 8, and a cache hit reads and checks a third as much."""

    ids: np.ndarray  # uint16 or int32, all rows concatenated
    mask: np.ndarray  # bool, same length: is this token a target
    offsets: np.ndarray  # int64, row r is [offsets[r], offsets[r+1])
    source: np.ndarray  # int32, index of the row's source
    meta: dict = field(default_factory=dict)  # bad rows, counts per source and format, digest
    origins_file: Path | None = None  # where each row came from, read only when needed
    _origins: list[str] | None = None

    def __len__(self) -> int:
        return len(self.source)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def origins(self) -> list[str]:
        if self._origins is None:
            self._origins = json.loads(self.origins_file.read_text()) if self.origins_file else []
        return self._origins

    @origins.setter
    def origins(self, value: list[str]) -> None:
        self._origins = value

    def digest(self) -> str:
        h = hashlib.sha256(str(self.ids.dtype).encode())
        for a in (self.ids, self.mask, self.offsets, self.source):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


def key_parts(cfg, sources, tokenizer, template) -> dict:
    """Everything tokenization depends on, as the key's parts (see the module docstring)."""
    import tokenizers
    import transformers

    return {
        "sources": [{"path": spec.path, "role": role, "content": source_digest(spec),
                     "format": spec.format or cfg.dataset_format,
                     "columns": spec.columns if spec.columns is not None else cfg.dataset_columns,
                     "text_field": cfg.dataset_text_field} for spec, role in sources],
        "tokenizer": tokenizer_digest(tokenizer),
        "template": {"name": template.name, "digest": template.digest},
        "settings": {"train_on_inputs": cfg.train_on_inputs},
        "versions": {"relaytune-data": VERSION, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides how the tokenizer splits text."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())  # vocab, merges, normalizer, pre/post-processing
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {"specials": tokenizer.special_tokens_map, "eos": tokenizer.eos_token_id,
             "bos": tokenizer.bos_token_id, "add_bos": getattr(tokenizer, "add_bos_token", None),
             "add_eos": getattr(tokenizer, "add_eos_token", None)}
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(parts: dict) -> str:
    """Paths do not count, only content: a moved data file still hits."""
    keyed = {**parts, "sources": [{k: v for k, v in s.items() if k != "path"} for s in parts["sources"]],
             "template": parts["template"]["digest"]}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:20]


def load_or_build(root: Path, parts: dict, build) -> tuple[TokenTable, bool]:
    """(table, hit): the cached table for `parts`, or a freshly built (and cached) one.

    Only an entry that `atomic.verify` proves damaged is removed. A folder that cannot be written
    (a read-only run folder) is no damage: an intact entry is used read-only, and a missing one is
    tokenized in memory without caching, with a notice."""
    key = cache_key(parts)
    entry = root / key
    try:
        atomic.clean_tmp(root, quiet=True)  # a kill mid-write leaves only a tmp folder
    except OSError:
        pass  # a read-only folder: the tmp entry stays, and is never read
    if entry.is_dir():
        if not _readable(entry):
            notice(f"cannot read the data cache {entry} (permissions); tokenizing in memory, leaving it as it is")
            return _built(build), False
        reason = verify(entry)
        if reason is None:
            try:
                table = _read(entry)
            except Exception as e:  # intact bytes that still do not parse: rebuild as well
                reason = f"unreadable ({type(e).__name__}: {e})"
            else:
                try:
                    os.utime(entry / MANIFEST)  # marks it recently used, for retention
                except OSError:
                    pass  # a read-only run folder: the entry is used as it is
                info(f"tokenized data loaded from the cache ({len(table)} rows, {entry})")
                return table, True
        warn(f"the data cache {entry.name} is damaged ({reason}); tokenizing again")
        try:
            atomic.remove_folder(entry)  # known damaged: commit_folder would only set it aside
        except OSError as e:
            notice(f"cannot remove the damaged data cache {entry} ({e.strerror or e}); tokenizing in "
                   "memory without caching")
            return _built(build), False
    else:
        found = _from_sources(key, entry)
        if found is not None:
            return found, True
        info(f"tokenizing the data: {why_miss(root, parts)}")
    table = _built(build)
    try:
        _write(entry, table, parts)
        _prune(root, keep_name=key)
    except OSError as e:  # a full or read-only disk must not stop training; the next run tokenizes again
        notice(f"could not write the data cache in {root} ({e.strerror or e}); tokenized in memory, "
               "continuing without the cache")
    return table, False


def _from_sources(key: str, entry: Path) -> TokenTable | None:
    """The entry from the cache of the run this one continues: read there (nothing written beside it),
    then committed here too, so later sessions find it in their own folder."""
    for root in _sources:
        src = root / key
        try:
            if not src.is_dir() or not _readable(src) or verify(src) is not None:
                continue
            files = {name: (src / name).read_bytes() for name in FILES}
            table = _read(src)
        except Exception:  # a damaged or vanishing source entry is no reason to stop: tokenize
            continue
        try:
            atomic.commit_folder(files, entry, {"kind": "data-cache", "version": VERSION}, points="cache")
            table.origins_file = entry / "origins.json"
        except OSError as e:
            notice(f"could not copy the data cache into {entry.parent} ({e.strerror or e}); using {src} as is")
        info(f"tokenized data loaded from the cache of the run this one continues ({len(table)} rows, {src})")
        return table
    return None


def _built(build) -> TokenTable:
    table = build()
    table.meta["digest"] = table.digest()
    return table


def _readable(entry: Path) -> bool:
    """Whether every file of the entry can be opened for reading (so a failed check means damage)."""
    try:
        return os.access(entry, os.R_OK | os.X_OK) and all(
            os.access(f, os.R_OK) for f in entry.iterdir() if f.is_file())
    except OSError:
        return False


def why_miss(root: Path, parts: dict) -> str:
    """What differs from the most recently used cache entry, in words."""
    previous = _newest_parts(root)
    if previous is None:
        return "no cache yet"
    changes = []
    old_s, new_s = previous.get("sources", []), parts["sources"]
    if len(old_s) != len(new_s):
        changes.append(f"the number of data sources changed ({len(old_s)} -> {len(new_s)})")
    for old, new in zip(old_s, new_s):
        for k in sorted(set(old) | set(new)):
            if k != "path" and old.get(k) != new.get(k):
                what = "content" if k == "content" else f"{k} {old.get(k)!r} -> {new.get(k)!r}"
                changes.append(f"{new['path']}: {what} changed")
    if previous.get("tokenizer") != parts["tokenizer"]:
        changes.append("the tokenizer changed")
    if previous.get("template", {}).get("digest") != parts["template"]["digest"]:
        changes.append(f"the chat template changed ({previous.get('template', {}).get('name')} -> "
                       f"{parts['template']['name']})")
    for group in ("settings", "versions"):
        old, new = previous.get(group, {}), parts[group]
        changes += [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                    if old.get(k) != new.get(k)]
    return "; ".join(changes) if changes else "the cache entry is missing"


def _newest_parts(root: Path) -> dict | None:
    entries = _entries(root)
    for entry in reversed(entries):
        try:
            return json.loads((entry / "table.json").read_text())["parts"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def _entries(root: Path) -> list[Path]:
    """Committed entries, least recently used first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: (p / MANIFEST).stat().st_mtime)


def _read(entry: Path) -> TokenTable:
    from safetensors.numpy import load_file

    arrays = load_file(str(entry / "tokens.safetensors"))
    meta = json.loads((entry / "table.json").read_text())
    mask = np.unpackbits(arrays["mask_bits"], count=len(arrays["ids"])).astype(bool)
    return TokenTable(arrays["ids"], mask, arrays["offsets"], arrays["source"], meta["table"],
                      origins_file=entry / "origins.json")


def _write(entry: Path, table: TokenTable, parts: dict) -> None:
    from safetensors.numpy import save

    files = {
        "tokens.safetensors": save({"ids": table.ids, "mask_bits": np.packbits(table.mask),
                                    "offsets": table.offsets, "source": table.source}),
        "table.json": json.dumps({"parts": parts, "table": table.meta}, sort_keys=True).encode(),
        "origins.json": json.dumps(table.origins, ensure_ascii=False).encode(),
    }
    atomic.commit_folder(files, entry, {"kind": "data-cache", "version": VERSION}, points="cache")


def _prune(root: Path, keep_name: str) -> None:
    others = [p for p in _entries(root) if p.name != keep_name]
    for p in others[: max(0, len(others) - (KEEP - 1))]:
        try:
            ours = read_manifest(p).get("kind") == "data-cache"
        except (OSError, ValueError):  # a damaged manifest is not proof that the folder is ours to delete
            continue
        if ours:
            atomic.remove_folder(p)
