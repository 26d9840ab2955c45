"""Read rows from data files and recognise their shape.

Every row keeps its origin (file and line) so that any later error can name it.
Rows are normalised to one of three shapes:
  {"text": str}
  {"messages": [{"role", "content"}, ...]}
  {"prompt": str, "completion": str}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


@dataclass
class Row:
    origin: str  # "path:line" or "path:row N"
    data: dict = field(default_factory=dict)


class BadRow(Exception):
    """A row that cannot be used; the message names the field."""


def read_rows(source: str) -> list[Row]:
    """All rows of a file or of every data file in a folder, in a stable order."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"`dataset`: the folder {path} holds no {'/'.join(SUFFIXES)} files")
    elif path.is_file():
        files = [path]
    else:
        return _read_hub(source)
    rows: list[Row] = []
    for f in files:
        rows += _read_file(f)
    return rows


def _read_file(path: Path) -> list[Row]:
    if path.suffix == ".jsonl":
        return list(_read_jsonl(path))
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: not valid JSON: {e}") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise UserError(f"{path}: a .json data file must hold a list of rows")
        return [Row(f"{path}:row {i + 1}", r if isinstance(r, dict) else {"__invalid__": r})
                for i, r in enumerate(data)]
    return _read_table(path)


def _read_jsonl(path: Path):
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            origin = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(origin, {"__invalid__": f"not UTF-8 (byte {e.start})"})
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                yield Row(origin, {"__invalid__": f"not valid JSON ({e.msg}, column {e.colno})"})
                continue
            yield Row(origin, value if isinstance(value, dict) else {"__invalid__": "not a JSON object"})


def _read_table(path: Path) -> list[Row]:
    try:
        if path.suffix == ".csv":
            import pyarrow.csv as pacsv
            table = pacsv.read_csv(path)
            first = 2  # line 1 is the header
        else:
            import pyarrow.parquet as pq
            table = pq.read_table(path)
            first = 1
    except Exception as e:  # pyarrow raises its own error types for malformed files
        raise UserError(f"{path}: cannot read: {e}") from None
    label = "" if path.suffix == ".csv" else "row "
    return [Row(f"{path}:{label}{i + first}", r) for i, r in enumerate(table.to_pylist())]


def _read_hub(source: str) -> list[Row]:
    name, _, split = source.partition(":")
    try:
        import datasets
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline, missing, or malformed: all end here
        raise UserError(f"`dataset`: {source} is neither a file nor a loadable dataset: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return [Row(f"{source}:row {i + 1}", dict(r)) for i, r in enumerate(ds)]


def normalise(row: Row, text_field: str = "text") -> dict:
    """The row as one of the three shapes, or BadRow naming what is wrong."""
    d = row.data
    if "__invalid__" in d:
        raise BadRow(str(d["__invalid__"]))
    if "messages" in d:
        return {"messages": _messages(d["messages"], "messages")}
    if "conversations" in d:
        convo = d["conversations"]
        if not isinstance(convo, list):
            raise BadRow("`conversations` must be a list")
        msgs = []
        for i, turn in enumerate(convo):
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise BadRow(f"`conversations[{i}]` needs `from` and `value`")
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise BadRow(f"`conversations[{i}].from` is {turn['from']!r}; expected human, gpt or system")
            msgs.append({"role": role, "content": turn["value"]})
        return {"messages": _messages(msgs, "conversations")}
    if "instruction" in d and "output" in d:
        instruction = _text(d, "instruction")
        extra = d.get("input") or ""
        if not isinstance(extra, str):
            raise BadRow("`input` must be text")
        msgs = []
        if d.get("system"):
            msgs.append({"role": "system", "content": _text(d, "system")})
        msgs.append({"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction})
        msgs.append({"role": "assistant", "content": _text(d, "output")})
        return {"messages": msgs}
    if "prompt" in d and "completion" in d:
        return {"prompt": _text(d, "prompt", allow_empty=True), "completion": _text(d, "completion")}
    if text_field in d:
        return {"text": _text(d, text_field)}
    keys = ", ".join(sorted(map(str, d))) or "none"
    raise BadRow(f"no known shape: expected `{text_field}`, `messages`, `conversations`, "
                 f"`instruction`+`output` or `prompt`+`completion`; the row has {keys}")


def _text(d: dict, key: str, allow_empty: bool = False) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise BadRow(f"`{key}` must be text, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise BadRow(f"`{key}` is empty")
    return v


def _messages(msgs, key: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise BadRow(f"`{key}` must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRow(f"`{key}[{i}]` must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRow(f"`{key}[{i}].role` is {role!r}; expected system, user or assistant")
        if not isinstance(content, str):
            raise BadRow(f"`{key}[{i}].content` must be text, got {type(content).__name__}")
        if role == "system" and i != 0:
            raise BadRow(f"`{key}[{i}]`: a system message may only come first")
        if role == "assistant" and not content.strip():
            raise BadRow(f"`{key}[{i}].content`: the assistant turn is empty")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow(f"`{key}` has no assistant turn to learn from")
    for prev, cur in zip(out, out[1:]):
        if prev["role"] == cur["role"]:
            raise BadRow(f"`{key}`: two {cur['role']} turns in a row")
    return out
