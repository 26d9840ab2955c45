"""Recognise a row's format and turn it into one of three checked shapes.

  {"text": str}
  {"prompt": str, "completion": str}
  {"messages": [{"role", "content"}, ...]}   (+ "train": [bool] when not every
                                               assistant turn is a target)

Formats: plain text, alpaca (instruction/input/output, optional system),
OpenAI messages, ShareGPT conversations (from/value) and prompt/completion
(strings, or lists of messages as TRL writes them). A column mapping renames
the standard fields. Every problem is a BadRow whose message names the field
as the user's data spells it; the caller adds the file:line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from relaytune.config.datasets import COLUMNS

# Messages per row. Finding which characters a chat template's rendering makes targets renders every
# prefix of the conversation (any Jinja template, exactly), which is quadratic in the messages: one
# row of 100k messages took hours. Real conversations stay far below this.
MAX_MESSAGES = 10_000

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
                "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}


@dataclass
class RawRow:
    """One row as read from a data file or dataset, before any checks."""

    origin: str  # "path:line", "path:row N" or "hub-id:row N"
    data: dict = field(default_factory=dict)
    error: str | None = None  # set when the row could not even be read (bad JSON, bad bytes)


class NotJson(ValueError):
    """JSON text that cannot be read: why, and the 1-based line where known."""

    def __init__(self, reason: str, line: int | None = None):
        super().__init__(reason)
        self.reason, self.line = reason, line


class _LongNumber(Exception):
    def __init__(self, literal: str):
        super().__init__(literal)
        self.literal = literal


def _int_or_refuse(literal: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(literal.lstrip("-")) > limit:
        raise _LongNumber(literal)
    return int(literal)


def load_json(text: str):
    """json.loads, with every way untrusted text makes it fail raised as NotJson.

    Python refuses to convert an integer of more than sys.get_int_max_str_digits() digits (a
    guard against quadratic-time parsing) with a bare ValueError; that case is parsed again
    to find the number, so that the message can say which line holds it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise NotJson(f"{e.msg}, column {e.colno}", e.lineno) from None
    except RecursionError:
        raise NotJson("nested too deep") from None
    except ValueError:
        pass  # only the integer digit limit raises a plain ValueError here
    try:
        json.loads(text, parse_int=_int_or_refuse)
    except _LongNumber as e:
        at = text.find(e.literal)
        raise NotJson(f"a number with {len(e.literal.lstrip('-')):,} digits, more than the "
                      f"{sys.get_int_max_str_digits():,} that can be read as an integer",
                      text.count("\n", 0, at) + 1 if at >= 0 else None) from None
    except (ValueError, RecursionError) as e:
        raise NotJson(str(e) or type(e).__name__) from None
    raise NotJson("a value that cannot be read")


class BadRow(Exception):
    """A row that cannot be used; the message names the field."""


class Fields:
    """Standard field name -> the name in the user's data."""

    def __init__(self, text_field: str = "text", columns: dict[str, str] | None = None):
        self.names = {c: c for c in COLUMNS}
        self.names["text"] = text_field
        self.names.update(columns or {})

    def __getitem__(self, key: str) -> str:
        return self.names[key]


def detect(d: dict, f: Fields) -> str | None:
    """The format a row looks like, by which fields it has; None if none fits."""
    if f["messages"] in d:
        return "messages"
    if f["conversations"] in d:
        return "sharegpt"
    if f["instruction"] in d:
        return "alpaca"
    if f["prompt"] in d:
        return "prompt_completion"
    if f["text"] in d:
        return "text"
    return None


def parse(row: RawRow, f: Fields, fmt: str = "auto", hint: str | None = None) -> tuple[str, dict]:
    """(format, normalised sample) of a row, or BadRow.

    `hint` is the format most rows of the source have: a row that fits no
    format is checked as that one, so the message says which field is missing.
    """
    if row.error:
        raise BadRow(row.error)
    d = row.data
    kind = detect(d, f) if fmt == "auto" else fmt
    if kind is not None:
        return kind, PARSERS[kind](d, f)
    if hint is None:
        keys = ", ".join(f"`{k}`" for k in sorted(map(str, d))[:8]) or "no fields"
        raise BadRow(f"no known format: expected `{f['text']}`, `{f['messages']}`, "
                     f"`{f['conversations']}`, `{f['instruction']}`+`{f['output']}` or "
                     f"`{f['prompt']}`+`{f['completion']}`; the row has {keys}")
    return hint, PARSERS[hint](d, f)  # e.g. "`messages` is missing", as the other rows have it


def normalise(row: RawRow, text_field: str = "text", columns: dict | None = None, fmt: str = "auto") -> dict:
    """The row as one of the three shapes, or BadRow naming what is wrong."""
    return parse(row, Fields(text_field, columns), fmt)[1]


def _text_row(d: dict, f: Fields) -> dict:
    return {"text": _text(d, f["text"])}


def _alpaca(d: dict, f: Fields) -> dict:
    instruction = _text(d, f["instruction"])
    extra = _text(d, f["input"], optional=True)
    msgs = []
    system = _text(d, f["system"], optional=True)
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction})
    msgs.append({"role": "assistant", "content": _text(d, f["output"])})
    return {"messages": msgs}


def _messages(d: dict, f: Fields) -> dict:
    return _chat(_messages_list(d, f["messages"], f), f["messages"])


def _sharegpt(d: dict, f: Fields) -> dict:
    return _chat(_messages_list(d, f["conversations"], f), f["conversations"])


def _prompt_completion(d: dict, f: Fields) -> dict:
    pk, ck = f["prompt"], f["completion"]
    if isinstance(d.get(pk), list) or isinstance(d.get(ck), list):
        # Conversational prompt/completion (TRL): only the completion's turns are targets.
        prompt = _messages_list(d, pk, f, allow_empty=True)
        if isinstance(d.get(ck), str):
            completion = [{"role": "assistant", "content": _text(d, ck)}]
        else:
            completion = _messages_list(d, ck, f)
        train = [False] * len(prompt) + [m["role"] == "assistant" for m in completion]
        return _chat(prompt + completion, f"{pk}+{ck}", train)
    return {"prompt": _text(d, pk, allow_empty=True), "completion": _text(d, ck)}


PARSERS = {"text": _text_row, "alpaca": _alpaca, "messages": _messages, "sharegpt": _sharegpt,
           "prompt_completion": _prompt_completion}


def _text(d: dict, key: str, allow_empty: bool = False, optional: bool = False) -> str:
    if key not in d or d[key] is None:
        if optional:
            return ""
        raise BadRow(f"`{key}` is missing")
    v = d[key]
    if not isinstance(v, str):
        raise BadRow(f"`{key}` must be text, got {type(v).__name__}")
    _check_unicode(v, key)
    if not (allow_empty or optional) and not v.strip():
        raise BadRow(f"`{key}` is empty")
    return v


def _check_unicode(v: str, where: str) -> None:
    # A lone surrogate (JSON "\ud800", or undecodable CSV bytes) cannot become UTF-8 tokens.
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow(f"`{where}` is not valid UTF-8 text (bad character at position {e.start})") from None


def _messages_list(d: dict, key: str, f: Fields, allow_empty: bool = False) -> list[dict]:
    if key not in d or d[key] is None:
        raise BadRow(f"`{key}` is missing")
    value = d[key]
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:  # CSV and some parquet exports store the message list as JSON text
            value = load_json(value)
        except NotJson as e:
            raise BadRow(f"`{key}` holds text that is not a valid JSON list ({e.reason})") from None
    if not isinstance(value, list) or (not value and not allow_empty):
        raise BadRow(f"`{key}` must be a non-empty list of messages, got {_kind(value)}")
    if len(value) > MAX_MESSAGES:
        raise BadRow(f"`{key}` has {len(value)} messages, more than the {MAX_MESSAGES:,} relaytune takes per "
                     "row (rendering a chat template costs time quadratic in the messages of a row); "
                     "split the conversation into several rows")
    out = []
    for i, m in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise BadRow(f"`{where}` must be an object with {f['role']} and {f['content']}, got {_kind(m)}")
        role_key = f["role"] if f["role"] in m else f["from"] if f["from"] in m else None
        content_key = f["content"] if f["content"] in m else f["value"] if f["value"] in m else None
        if role_key is None:
            raise BadRow(f"`{where}` has no `{f['role']}` (or `{f['from']}`)")
        if content_key is None:
            raise BadRow(f"`{where}` has no `{f['content']}` (or `{f['value']}`)")
        raw_role = m[role_key]
        role = ROLE_ALIASES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise BadRow(f"`{where}.{role_key}` is {raw_role!r}; expected system, user or assistant "
                         "(or human, gpt)")
        out.append({"role": role, "content": _content(m[content_key], f"{where}.{content_key}")})
    return out


def _content(v, where: str) -> str:
    if isinstance(v, list):  # OpenAI content parts: keep the text ones, refuse others
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type", "text") != "text" \
                    or not isinstance(part.get("text"), str):
                raise BadRow(f"`{where}[{j}]`: only text content parts are supported")
            texts.append(part["text"])
        v = "".join(texts)
    if not isinstance(v, str):
        raise BadRow(f"`{where}` must be text, got {_kind(v)}")
    _check_unicode(v, where)
    return v


def _chat(msgs: list[dict], key: str, train: list[bool] | None = None) -> dict:
    """Check the conversation's structure; the assistant turns are targets unless `train` says."""
    if train is None:
        train = [m["role"] == "assistant" for m in msgs]
    keep = [(m, t, i) for i, (m, t) in enumerate(zip(msgs, train))
            if not (m["role"] == "system" and not m["content"].strip())]  # an empty system prompt: none
    for n, (m, _, i) in enumerate(keep):
        if m["role"] == "system" and n != 0:
            raise BadRow(f"`{key}[{i}]`: a system message may only come first")
        if not m["content"].strip():
            raise BadRow(f"`{key}[{i}]`: the {m['role']} turn is empty")
        if n and keep[n - 1][0]["role"] == m["role"]:
            raise BadRow(f"`{key}[{i}]`: two {m['role']} turns in a row (roles must alternate)")
    if not any(t and m["role"] == "assistant" for m, t, _ in keep):
        raise BadRow(f"`{key}` has no assistant turn to learn from")
    out = {"messages": [m for m, _, _ in keep]}
    flags = [t for _, t, _ in keep]
    if flags != [m["role"] == "assistant" for m, _, _ in keep]:
        out["train"] = flags
    return out


def _kind(v) -> str:
    if isinstance(v, list):
        return "an empty list" if not v else "a list"
    return type(v).__name__
