"""Turn a YAML file plus `key=value` overrides into a validated TrainConfig.

Every error names where the bad value came from (file and line, or the
override) and what would be valid, and is raised as UserError (exit 2).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relaytune.config.checks import odd_settings
from relaytune.config.origins import remember
from relaytune.config.paths import absolute, resolve_paths, resolve_value
from relaytune.config.schema import ALIASES, TrainConfig
from relaytune.config.urls import config_path_url, refuse_urls
from relaytune.config.yaml_source import NumberTooLong, parse_value, read_config_file
from relaytune.errors import UserError
from relaytune.log import warn
from relaytune.redact import redact_url, scrub, secrets_in


def load_config(source: str | os.PathLike | dict | TrainConfig | None = None,
                overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """Build a TrainConfig from a YAML path, a dict, or an existing config, then apply overrides.

    Relative paths written in a file resolve against the file's folder; those in a dict, an
    existing config or an override resolve against the working directory.
    """
    # Each message redacts the URLs it shows; this catches any that quotes a secret another way
    # (a URL typed as a key, a library's text), since a refusal is printed and often pasted.
    secrets: list[str] = []
    try:
        return _load(source, overrides, secrets)
    except UserError as e:
        given = source.model_dump() if isinstance(source, TrainConfig) else source
        secrets += secrets_in(overrides) + secrets_in(given)
        clean = scrub(str(e), secrets)
        if clean == str(e):
            raise
        raise UserError(clean) from None


def _load(source, overrides, secrets: list[str]) -> TrainConfig:
    if isinstance(source, TrainConfig) and not overrides:
        return source
    here = Path.cwd()
    where: dict[str, str] = {}
    folder = here
    if isinstance(source, TrainConfig):
        raw = source.model_dump(exclude_unset=True)
        where = {k: "the given config" for k in raw}
    elif isinstance(source, dict):
        raw = dict(source)
        where = {k: "the given settings" for k in raw}
    elif source is None:
        raw = {}
    else:
        config_path_url(source)
        raw, where = read_config_file(Path(source))
        folder = Path(os.path.abspath(os.path.expanduser(source))).parent
    secrets += secrets_in(raw)
    raw, where = _apply_aliases(raw, where)
    written = raw.get("output_dir")
    raw = resolve_paths(raw, folder)
    given = {ALIASES.get(k, k): v for k, v in parse_overrides(overrides).items()}
    if "output_dir" not in given and folder != here:
        _check_moved_output_dir(written, raw, where, here)
    for key, value in given.items():
        raw[key] = resolve_value(key, value, here)
        shown = redact_url(value if isinstance(value, str) else _repr(value))
        where[key] = f"the override {key}={_clip(shown)}"
    refuse_urls(raw, where)
    _reject_unknown(raw, where)
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(_explain(e, raw, where)) from None
    remember(raw, where)
    for message in odd_settings(cfg):
        warn(message)
    return cfg


def _check_moved_output_dir(written: Any, raw: dict, where: dict[str, str], here: Path) -> None:
    """A relative output_dir in a file used to mean "from the working directory": when the run
    is there and nothing is beside the config, say so rather than silently start a new run."""
    if not isinstance(written, str) or os.path.isabs(os.path.expanduser(written)):
        return
    now, before = Path(raw["output_dir"]), Path(absolute(written, here))
    if before != now and (before / "checkpoints").is_dir() and not now.exists():
        raise UserError(
            f"{_at(where, 'output_dir')}`output_dir` now resolves against the config file's folder "
            f"({now}), but the run is in {before}, where it resolved from the working directory "
            f"before. Write output_dir: {before} in the config, or pass output_dir={written} from {here}")


def _apply_aliases(raw: dict, where: dict[str, str]) -> tuple[dict, dict[str, str]]:
    out, out_where, written = {}, {}, {}
    for key, value in raw.items():
        canonical = ALIASES.get(key, key)
        if canonical in out:
            raise UserError(
                f"{where.get(key, key)}: `{written[canonical]}` and `{key}` name the same setting; keep one")
        out[canonical] = value
        out_where[canonical] = where.get(key, "")
        written[canonical] = key
    return out, out_where


def parse_overrides(overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    parsed = {}
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {_clip(redact_url(item))!r} is not key=value (e.g. learning_rate=1e-4)")
        key, text = item.split("=", 1)
        try:
            parsed[key.strip()] = parse_value(text)
        except NumberTooLong as e:
            named = NumberTooLong(key.strip(), e.digits, None)  # a bare value knows no key
            raise UserError(f"the override {_clip(redact_url(item), 60)}: {named}") from None
    return parsed


# Hugging Face keys that configs copied from TRL / Trainer scripts carry, with what to do instead.
HF_ONLY_KEYS = {
    "evaluation_strategy": "evaluation runs every `eval_steps` when there is eval data; remove it",
    "eval_strategy": "evaluation runs every `eval_steps` when there is eval data; remove it",
    "save_strategy": "checkpoints are committed every `save_steps` and every `save_every_seconds`; remove it",
    "logging_strategy": "`logging_steps` sets the interval; remove it",
    "auto_find_batch_size": "an out-of-memory error halves the micro-batch in place, always; remove it",
    "per_device_eval_batch_size": "evaluation uses the training micro-batch; remove it",
    "output_dir_overwrite": "relaytune never overwrites a run; use a new output_dir",
    "overwrite_output_dir": "relaytune never overwrites a run; use a new output_dir",
}


def _reject_unknown(raw: dict, where: dict[str, str]) -> None:
    valid = list(TrainConfig.model_fields) + list(ALIASES)
    for key in raw:
        if key in TrainConfig.model_fields:
            continue
        if key in HF_ONLY_KEYS:
            raise UserError(f"{_at(where, key)}`{key}` is not a key: {HF_ONLY_KEYS[key]}")
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"; did you mean `{ALIASES.get(close[0], close[0])}`?" if close else \
            "; `relaytune train --help` lists the keys"
        raise UserError(f"{_at(where, key)}`{key}` is not a key{hint}")


def _at(where: dict[str, str], key: str) -> str:
    return f"{where[key]}: " if where.get(key) else ""


def _explain(error: ValidationError, raw: dict, where: dict[str, str]) -> str:
    lines = []
    items = error.errors()
    # A union (e.g. dataset: str | list) reports one error per alternative; the deepest is the real one.
    deepest: dict[str, int] = {}
    for item in items:
        loc = item.get("loc") or ()
        deepest[str(loc[0]) if loc else ""] = max(deepest.get(str(loc[0]) if loc else "", 0), len(loc))
    for item in items:
        loc = item.get("loc") or ()
        key = str(loc[0]) if loc else ""
        if len(loc) < deepest.get(key, 0):
            continue
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden" and len(loc) > 1:
            lines.append(_nested_unknown_key(loc, where))
            continue
        if item["type"] == "missing":
            lines.append(f"`{key}` is required: {TrainConfig.model_fields[key].description}")
            continue
        if key in TrainConfig.model_fields:
            allowed = _allowed(key) if "literal" in item["type"] else ""
            if allowed:  # pydantic's own text already lists the choices; list them once
                msg = "not one of the allowed values"
            suffix = f" (allowed: {allowed})" if allowed else ""
            # An item of a list (liger_kernels: [rms_norm, rope]) is shown alone, so the bad one stands out.
            got = item["input"] if allowed and isinstance(loc[-1], int) else raw.get(key)
            lines.append(f"{_at(where, key)}`{key}`: {msg}; got {_shown(got)}{suffix}")
        else:  # settings that contradict each other: point at the first key the message names
            named = sorted((m.start(), k) for k in where if (m := re.search(rf"\b{re.escape(k)}\b", msg)))
            lines.append(f"{_at(where, named[0][1])}{msg}" if named else msg)
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _shown(value: Any) -> str:
    """A value as an error message may show it: credentials out of URLs, and short."""
    return _clip(redact_url(_repr(value)))


def _repr(value: Any) -> str:
    """repr(), which raises ValueError for an int past Python's digit limit (a dict or a
    TrainConfig can hold one)."""
    try:
        return repr(value)
    except ValueError:
        return f"a number of about {int(math.log10(abs(value))) + 1:,} digits" if isinstance(value, int) \
            else f"a {type(value).__name__} too large to show"


def _clip(text: str, limit: int = 200) -> str:
    """At most `limit` characters: a message must stay readable whatever was pasted in."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _nested_unknown_key(loc: tuple, where: dict[str, str]) -> str:
    """`wieght` inside a `dataset:` list entry: name the entry and suggest the field."""
    from relaytune.config.datasets import DatasetSource

    key, bad = str(loc[0]), str(loc[-1])
    index = next((p for p in loc[1:] if isinstance(p, int)), 0)
    fields = list(DatasetSource.model_fields)
    close = difflib.get_close_matches(bad, fields, n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else f"; an entry takes {', '.join(fields)}"
    return f"{_at(where, key)}`{key}[{index}]`: `{bad}` is not a key{hint}"


def _allowed(key: str) -> str:
    annotation = TrainConfig.model_fields[key].annotation
    options: list[str] = []
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Literal:
            options += [repr(a) for a in typing.get_args(arg)]
    if typing.get_origin(annotation) is typing.Literal:
        options += [repr(a) for a in typing.get_args(annotation)]
    return ", ".join(options)


def field_help() -> list[tuple[str, str, str]]:
    """(key, default, docstring) for every field, in declaration order, for --help."""
    rows = []
    for name, field in TrainConfig.model_fields.items():
        default = "required" if field.is_required() else repr(field.default)
        rows.append((name, default, " ".join((field.description or "").split())))
    return rows
