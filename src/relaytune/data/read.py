"""Read rows from data files, folders and `datasets` sources, each with its origin.

Every row keeps where it came from ("path:line" for jsonl, json and csv,
"path:row N" for parquet and datasets) so that any later error can name it.
A row that cannot even be read (bad bytes, bad JSON) is still returned, with
`error` set, so that it is quarantined like any other bad row; only a file that
cannot be read at all raises UserError.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relaytune.config.datasets import DatasetSource
from relaytune.config.origins import written_at
from relaytune.config.urls import is_url
from relaytune.data.formats import NotJson, RawRow, load_json
from relaytune.errors import UserError
from relaytune.redact import redact_url

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# A row (a JSONL line, a CSV record) longer than this is quarantined unread: one 50 MB line cost
# 6.2 GB of memory to parse, render and tokenize. Real rows are far below it (a 128k-token
# context is about 0.5 MiB of text).
MAX_ROW_BYTES = 10 * 2**20
METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}  # not rows
# `datasets` sources loaded inside the current `one_load_per_source()` block; None outside one.
_loaded: dict[tuple, object] | None = None
# Folders a data scan skips: the run's own output_dir when it lies inside a dataset folder.
_excluded: tuple[Path, ...] = ()


@contextmanager
def excluding(*folders: str | Path) -> Iterator[None]:
    """Within this block, a dataset folder's scan skips these folders (and what is below them)."""
    global _excluded
    before = _excluded
    _excluded = before + tuple(Path(f).expanduser().resolve() for f in folders)
    try:
        yield
    finally:
        _excluded = before


def _skipped(p: Path) -> bool:
    resolved = p.resolve()
    return any(resolved == e or e in resolved.parents for e in _excluded)


@contextmanager
def one_load_per_source() -> Iterator[None]:
    """Within this block each `datasets` source is loaded once (the cache key and the rows both
    need it); outside, every read loads afresh, so a long-lived process never sees stale data."""
    global _loaded
    if _loaded is not None:  # nested: the outer block's loads count
        yield
        return
    _loaded = {}
    try:
        yield
    finally:
        _loaded = None


def read_rows(source: str | DatasetSource) -> list[RawRow]:
    """All rows of a source, in a stable order."""
    spec = DatasetSource(path=source) if isinstance(source, str) else source
    files = data_files(spec)
    if files is None:
        ds = _load_datasets(spec)
        return [RawRow(f"{spec.path}:row {i + 1}", dict(r)) for i, r in enumerate(ds)]
    rows: list[RawRow] = []
    for f in files:
        rows += read_file(f)
    return rows


def source_digest(spec: DatasetSource) -> str:
    """A content hash of the source: its files' bytes, or the `datasets` fingerprint."""
    files = data_files(spec)
    h = hashlib.sha256()
    if files is None:
        h.update(f"datasets:{_load_datasets(spec)._fingerprint}".encode())
        return h.hexdigest()
    root = Path(spec.path).expanduser()
    for f in files:
        if f != root:  # in a folder, which file holds which rows counts; a single file's name does not
            h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def data_files(spec: DatasetSource) -> list[Path] | None:
    """The data files a source reads, or None for a source that `datasets` loads."""
    named = written_at(spec.path)  # the key (and config line) that named this source
    if is_url(spec.path):
        raise UserError(f"{named}: {redact_url(spec.path.strip())} is a URL; data is read from a local "
                        "file or folder, or a Hub dataset id (org/name): download the file first")
    path = Path(spec.path).expanduser()
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise UserError(f"{named}: {path} is a {path.suffix or 'suffix-less'} file; "
                            f"expected {', '.join(SUFFIXES)}")
        return [path]
    if path.is_dir():
        if spec.split or _is_saved_dataset(path):
            return None  # a Hub-style folder with splits, or datasets' save_to_disk output
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                       and p.name not in METADATA
                       and not any(part.startswith(".") for part in p.relative_to(path).parts)
                       and not (_excluded and _skipped(p)))
        if not files:
            raise UserError(f"{named}: the folder {path} holds no {'/'.join(SUFFIXES)} files")
        return files
    if spec.path.startswith((".", "/", "~")) or Path(spec.path).suffix in SUFFIXES:
        raise UserError(f"{named}: {_where(spec.path)} does not exist")
    return None  # a Hub id


def _where(path: str) -> str:
    """A path as a message should name it: absolute, and for a relative one, the folder it was
    resolved against (the working directory: the config resolves its own relative paths earlier)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    return f"{Path.cwd() / p} ({path!r} is relative: resolved against the working directory {Path.cwd()})"


def read_file(path: Path) -> list[RawRow]:
    if path.suffix == ".jsonl":
        return list(_read_jsonl(path))
    if path.suffix == ".json":
        return _read_json(path)
    if path.suffix == ".csv":
        return _read_csv(path)
    return _read_parquet(path)


def _lines(fh):
    """The file's lines; a line longer than MAX_ROW_BYTES is given as None, never held in memory whole."""
    while True:
        raw = fh.readline(MAX_ROW_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # skip the rest of the line in bounded pieces
            yield None
            continue
        yield raw


def too_long(size: int | None = None) -> str:
    cap = f"{MAX_ROW_BYTES // 2**20} MiB" if MAX_ROW_BYTES % 2**20 == 0 else f"{MAX_ROW_BYTES:,} bytes"
    got = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
    return (f"the row is longer than the {cap} that relaytune reads per row{got}: a cap that keeps one "
            "huge line from exhausting memory; split it into several rows")


def _read_jsonl(path: Path):
    with open(path, "rb") as fh:
        for number, raw in enumerate(_lines(fh), start=1):
            origin = f"{path}:{number}"
            if raw is None or len(raw.rstrip(b"\r\n")) > MAX_ROW_BYTES:
                yield RawRow(origin, error=too_long())
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(origin, error=f"not UTF-8 (bad byte at column {e.start + 1})")
                continue
            try:
                value = load_json(text)
            except NotJson as e:
                yield RawRow(origin, error=f"not valid JSON ({e.reason})")
                continue
            if isinstance(value, dict):
                yield RawRow(origin, value)
            else:
                yield RawRow(origin, error=f"not a JSON object (a {type(value).__name__})")


def _read_json(path: Path) -> list[RawRow]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 (bad byte at offset {e.start})") from None
    try:
        data = load_json(text)
    except NotJson as e:
        raise UserError(f"{path}{f':{e.line}' if e.line else ''}: not valid JSON: {e.reason}") from None
    if isinstance(data, list):
        lines = _element_lines(text, len(data))
        if len(set(lines)) == len(lines):
            return [_row(f"{path}:{line}", r) for line, r in zip(lines, data)]
        return [_row(f"{path}:row {i + 1}", r) for i, r in enumerate(data)]  # rows share lines
    lists = [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
    if len(lists) == 1:  # {"data": [...]} or {"train": [...]}: rows are numbered, not lined
        return [_row(f"{path}:{lists[0]}[{i}]", r) for i, r in enumerate(data[lists[0]])]
    raise UserError(f"{path}: a .json data file must hold a list of rows (or an object with one list)")


def _element_lines(text: str, n: int) -> list[int]:
    """Line number of each element of a top-level JSON array (the text parsed already)."""
    decoder, skip = json.JSONDecoder(), " \t\n\r,"
    lines, i, line, seen = [], text.index("[") + 1, 1, 0
    for _ in range(n):
        while text[i] in skip:
            i += 1
        line += text.count("\n", seen, i)
        seen = i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)
    return lines


def _row(origin: str, value) -> RawRow:
    if isinstance(value, dict):
        return RawRow(origin, value)
    return RawRow(origin, error=f"not a JSON object (a {type(value).__name__})")


def _read_csv(path: Path) -> list[RawRow]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long texts exceed the 128 KiB default
    rows: list[RawRow] = []
    # surrogateescape keeps undecodable bytes visible, so only their rows are rejected
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader, None)
            if header is None:
                return []
            if any(not h.isascii() and _bad_text(h) for h in header):
                raise UserError(f"{path}:1: the header is not UTF-8")
            start = reader.line_num + 1
            for record in reader:
                origin = f"{path}:{start}"
                start = reader.line_num + 1
                if not any(record):
                    continue
                if len(record) > len(header):
                    rows.append(RawRow(origin, error=f"{len(record)} fields, but the header has {len(header)}"))
                elif (size := sum(map(len, record))) > MAX_ROW_BYTES:
                    rows.append(RawRow(origin, error=too_long(size)))
                elif any(not v.isascii() and _bad_text(v) for v in record):
                    rows.append(RawRow(origin, error="not UTF-8 (undecodable bytes)"))
                else:  # a short record leaves the missing fields out, so they read as missing
                    rows.append(RawRow(origin, dict(zip(header, record))))
        except csv.Error as e:
            raise UserError(f"{path}:{reader.line_num}: not valid CSV: {e}") from None
    return rows


def _bad_text(v: str) -> bool:
    try:
        v.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _read_parquet(path: Path) -> list[RawRow]:
    try:
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        records = table.to_pylist()
    except Exception as e:  # pyarrow raises its own error types for malformed files
        raise UserError(f"{path}: cannot read as parquet: {e}") from None
    return [RawRow(f"{path}:row {i + 1}", r) for i, r in enumerate(records)]


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_datasets(spec: DatasetSource):
    """A `datasets` source: a save_to_disk folder, a local folder with a split, or a Hub id."""
    name, split = spec.path, spec.split
    if split is None and not Path(name).expanduser().exists() and ":" in name:
        name, _, split = name.partition(":")  # the short form "org/name:split"
    key = (name, split, spec.subset)
    if _loaded is not None and key in _loaded:
        return _loaded[key]
    try:
        import datasets

        local = Path(name).expanduser()
        if local.is_dir() and _is_saved_dataset(local):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if (split or "train") not in ds:
                    raise UserError(f"`dataset`: {name} has no split {split or 'train'!r}; "
                                    f"it has {', '.join(ds)}")
                ds = ds[split or "train"]
        else:
            ds = datasets.load_dataset(name, spec.subset, split=split or "train")
    except UserError:
        raise
    except Exception as e:  # offline, missing, or malformed: all end here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{written_at(spec.path)}: {spec.path} is neither a data file nor a loadable "
                        f"dataset: {redact_url(first)}") from None
    if _loaded is not None:
        _loaded[key] = ds
    return ds
