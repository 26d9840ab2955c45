"""Read a config file (or one override value) as YAML, checked before anything walks the data.

safe_load semantics (no Python tags), plus what a config never needs and an attacker would use:
no anchors or aliases (an alias bomb expands to gigabytes as soon as anything walks it), no
nesting deeper than MAX_DEPTH, no key set twice, and no file over MAX_BYTES. A timestamp
stays the text that was written, so `deadline: 2026-12-01T06:00:00Z` needs no quotes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from yaml.events import AliasEvent

from relaytune.errors import UserError

MAX_BYTES = 1 << 20  # a flat config is a few KiB; 1 MiB leaves room for long column maps and lists
MAX_DEPTH = 20  # the deepest real setting (a dataset entry's column map) is 3 levels down

_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_INT = "tag:yaml.org,2002:int"


class YamlProblem(Exception):
    """A structural refusal, with the 0-based line it refers to (or None)."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


class NumberTooLong(YamlProblem):
    """An integer with more digits than Python converts (sys.get_int_max_str_digits())."""

    def __init__(self, key: str, digits: int, line: int | None):
        limit = sys.get_int_max_str_digits()
        super().__init__(f"`{key}`: the number has {digits:,} digits, too large for any setting "
                         f"(at most {limit:,} digits can be read as an integer)", line)
        self.digits = digits


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors, aliases and deep nesting while composing."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None):
            raise YamlProblem("YAML anchors and aliases (&name, *name) are not accepted in a "
                              "config; write the value out", event.start_mark.line)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlProblem(f"nested more than {MAX_DEPTH} levels deep; a config is a flat "
                                  "list of key: value lines", event.start_mark.line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# Timestamps stay text: no field takes a datetime, and `deadline` parses ISO text itself.
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def duplicate_keys(node: yaml.Node) -> tuple[str, int, int] | None:
    """(key, first line, second line), 1-based, of the first key set twice in any mapping."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in current.value:
                key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
                line = key_node.start_mark.line + 1
                if key is not None and key in seen:
                    return key, seen[key], line
                if key is not None:
                    seen[key] = line
                stack.append(value_node)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
    return None


def _decimal_digits(text: str) -> int:
    """Digits that YAML's int constructor hands to int() in base 10 (the only base Python limits)."""
    digits = text.replace("_", "").lstrip("+-")
    if digits.startswith("0") and len(digits) > 1 and ":" not in digits:
        return 0  # 0b, 0x and octal: power-of-two bases convert in linear time, without a limit
    return max(len(part) for part in digits.split(":"))


def long_number(node: yaml.Node) -> NumberTooLong | None:
    """The first integer too long to convert, found before construction (where int() would raise a
    bare ValueError that names neither line nor key), with the top-level key that holds it."""
    limit = sys.get_int_max_str_digits()
    stack: list[tuple[yaml.Node, str]] = [(node, "")]
    while limit and stack:
        current, key = stack.pop()
        if isinstance(current, yaml.MappingNode):
            for key_node, value_node in reversed(current.value):
                name = key or (str(key_node.value)[:100] if isinstance(key_node, yaml.ScalarNode) else "a key")
                stack += [(value_node, name), (key_node, key or "a key")]
        elif isinstance(current, yaml.SequenceNode):
            stack += [(item, key) for item in reversed(current.value)]
        elif current.tag == _INT and (digits := _decimal_digits(str(current.value))) > limit:
            return NumberTooLong(key or "the value", digits, current.start_mark.line)
    return None


def _load(text: str, name: str) -> tuple[object, yaml.Node | None]:
    """Compose the node tree once, check it, and only then build Python values from it."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and (twice := duplicate_keys(node)):
            key, first, second = twice
            raise UserError(f"`{key}` is set twice: {name}:{first} and {name}:{second}; keep one")
        if node is not None and (too_long := long_number(node)):
            raise too_long
        return (loader.construct_document(node) if node is not None else None), node
    finally:
        loader.dispose()


def parse(text: str, name: str) -> tuple[object, yaml.Node | None]:
    """(data, node tree) of YAML `text`; errors are UserError naming `name` and the line."""
    try:
        return _load(text, name)
    except YamlProblem as e:
        at = f":{e.line + 1}" if e.line is not None else ""
        raise UserError(f"{name}{at}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{name}{at}: not valid YAML: {problem}") from None
    except RecursionError:
        raise UserError(f"{name}: nested too deeply to read; a config is a flat list of key: value lines") from None


def read_config_file(path: Path) -> tuple[dict, dict[str, str]]:
    """The top-level mapping of a config file, and `key -> "file:line"` for each key."""
    if path.is_dir():
        raise UserError(f"{path}: this is a folder, not a config file; name the .yaml file in it")
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise UserError(f"{path}: {size:,} bytes is too large for a config file "
                            f"(at most {MAX_BYTES:,}); is it the right file?")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    data, node = parse(text, str(path))
    if data is None:
        return {}, {}
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise UserError(f"{path}: the config must be a flat mapping of key: value lines")
    where = {str(k.value): f"{path}:{k.start_mark.line + 1}" for k, _ in node.value}
    return {str(k): v for k, v in data.items()}, where


def parse_value(text: str):
    """One `key=value` override's value, typed as YAML would type it in the file; text that
    YAML refuses (or that uses anchors, aliases or deep nesting) stays the literal text."""
    if not text.strip():
        return ""
    if len(text) > MAX_BYTES:
        return text
    try:
        return _load(text, "the override")[0]
    except NumberTooLong:
        raise  # the text is a number, just not one any setting can hold: say so, with the key
    except (YamlProblem, yaml.YAMLError, UserError, RecursionError):
        return text
