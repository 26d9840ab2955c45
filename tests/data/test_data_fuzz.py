"""Fuzz the readers and row checks with hypothesis: well over 10,000 malformed rows in all.

Whatever the bytes, the result is usable rows plus quarantined ones, or a UserError;
never a traceback. Every quarantined row names its own file and line, exactly once.
"""

import csv
import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaytune.config.loader import load_config
from relaytune.data import prepare_data
from relaytune.errors import UserError
from relaytune.tiny import make_tokenizer

TOK = make_tokenizer()
KEYS = ["text", "instruction", "input", "output", "system", "prompt", "completion", "messages",
        "conversations", "role", "content", "from", "value"]
ROLES = ["user", "assistant", "system", "human", "gpt", "tool", "", "USER", " gpt "]
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

# Cheap draws (a fixed list of nasty values, short texts), so 10,000 rows take seconds.
NASTY = [None, True, 0, -1, 1.5, float("nan"), "", "  ", "\ud800", "x" * 400, [], {}, [1], ["a"],
         {"a": 1}, [{}], [{"role": "user"}], [{"type": "image"}], "<|im_end|>", "\x00", "\u2028", "[{]"]
scalars = st.sampled_from(NASTY) | st.text(max_size=8)
texts = st.text(max_size=12) | st.sampled_from(NASTY)
values = scalars | st.dictionaries(st.sampled_from(KEYS + ["", "x"]), scalars, max_size=3) \
    | st.lists(scalars, max_size=3)
message = st.dictionaries(st.sampled_from(["role", "content", "from", "value", "x"]),
                          st.sampled_from(ROLES) | texts, max_size=3)
messages = st.lists(message, max_size=4) | values
rows = st.one_of(
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), values, max_size=4),
    st.builds(lambda m: {"messages": m}, messages),
    st.builds(lambda m: {"conversations": m}, messages),
    st.builds(lambda i, o, x: {"instruction": i, "output": o, **x}, texts, texts,
              st.dictionaries(st.sampled_from(["input", "system"]), texts, max_size=2)),
    st.builds(lambda p, c: {"prompt": p, "completion": c}, texts | messages, texts | messages),
    st.builds(lambda t: {"text": t}, texts),
)
json_line = rows.map(lambda r: json.dumps(r).encode())
lines = st.one_of(
    json_line, json_line, json_line,
    values.map(lambda v: json.dumps(v).encode()),  # valid JSON that is not an object
    json_line.map(lambda b: b[: len(b) // 2]),  # cut short
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),  # any bytes, bad UTF-8 included
    json_line.map(lambda b: b.replace(b"o", b"\xff", 1)),  # one bad byte in an otherwise fine row
)


def check(path: Path, n_rows: int, line_of=None):
    """Prepare the data; assert no traceback, and that every bad row is named once, by its place."""
    out = path.parent / "run"
    cfg = load_config({"dataset": str(path), "output_dir": str(out), "max_bad_fraction": 1,
                       "dataset_cache": False, "max_seq_length": 256})
    try:
        data = prepare_data(cfg, TOK)
    except UserError as e:
        assert str(path) in str(e) or "`dataset`" in str(e)
        return
    q = out / "quarantine.jsonl"
    bad = [json.loads(x) for x in q.read_text().split("\n") if x] if q.is_file() else []
    wheres = [b["where"] for b in bad]
    assert len(set(wheres)) == len(wheres)
    assert all(b["reason"] for b in bad)
    for w in wheres:
        m = re.fullmatch(re.escape(str(path)) + r":(?:row )?(\d+)", w)
        assert m, w
        if line_of is not None:
            assert int(m.group(1)) in line_of, w
    assert len(bad) + data.stats["train_rows"] == n_rows


def test_fuzz_jsonl_rows():
    seen = 0

    @FUZZ
    @given(st.lists(lines, min_size=60, max_size=120))
    def run(raw):
        nonlocal seen
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "data.jsonl"
            path.write_bytes(b"\n".join(raw) + b"\n")
            real = {i + 1 for i, line in enumerate(raw) if line.strip()}
            check(path, len(real), real)
        seen += len(raw)

    run()
    assert seen >= 8000, seen


def test_fuzz_json_and_csv_files():
    seen = 0

    @FUZZ
    @given(st.lists(rows | values, min_size=10, max_size=40), st.sampled_from([None, 1, 2]))
    def as_json(items, indent):
        nonlocal seen
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "data.json"
            path.write_text(json.dumps(items, indent=indent))
            check(path, len(items))
        seen += len(items)

    @FUZZ
    @given(st.lists(st.lists(st.text(max_size=15) | st.sampled_from(['"', ",", "\n", "[", "[{}]"]),
                             min_size=0, max_size=6), min_size=5, max_size=30),
           st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def as_csv(records, header):
        nonlocal seen
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "data.csv"
            with open(path, "w", newline="", encoding="utf-8") as fh:
                w = csv.writer(fh)
                w.writerow(header)
                w.writerows(records)
            check(path, sum(1 for r in records if any(r)))
        seen += len(records)

    as_json()
    as_csv()
    assert seen >= 3000, seen
