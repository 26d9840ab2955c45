"""Row checks: every bad row is named by file:line and field, quarantined with its reason,
and training stops only above max_bad_fraction; long rows truncate, drop or error."""

import json

import pytest
from conftest import chat_rows, make_config, run_cli, write_jsonl
from support.prepared import prep, quarantine

from relaytune.errors import UserError
from relaytune.tiny import make_tokenizer

GOOD = chat_rows(1)[0]
BAD_LINES = [  # (raw jsonl line, what the reason must mention)
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
     '{"role": "assistant", "content": "c"}]}', "`messages[1]`: two user turns in a row"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, '
     '{"role": "assistant", "content": "c"}]}', "`messages[1]`: a system message may only come first"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}',
     "`messages[1]`: the assistant turn is empty"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "c"}]}',
     "`messages[1].role` is 'robot'"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "c"}]}',
     "`messages[0].content` must be text, got int"),
    ('{"instruction": "do", "output": ""}', "`output` is empty"),
    ('{"instruction": "do"}', "`output` is missing"),
    ('{"instruction": ["x"], "output": "y"}', "`instruction` must be text, got list"),
    ('{"prompt": "p"}', "`completion` is missing"),
    ('{"text": "\\ud800 lone surrogate"}', "`text` is not valid UTF-8"),
    ('{"messages": "not a list"}', "`messages` must be a non-empty list"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "`conversations[0].from` is 'alien'"),
    ('{"foo": 1}', "`messages` is missing"),  # checked as the file's usual format
    ('[1, 2]', "not a JSON object"),
    ('{"messages": [', "not valid JSON"),
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_every_bad_row_is_named_by_line_and_field(tmp_path, tok):
    lines = []
    for raw, _ in BAD_LINES:
        lines += [json.dumps(GOOD), raw]
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff byte"}\n')
    with pytest.raises(UserError) as err:
        prep(tmp_path, tok, path)
    assert "17 of 33 rows are unusable" in str(err.value) and "By reason" in str(err.value)
    got = quarantine(tmp_path)
    assert [q["where"] for q in got] == [f"{path}:{2 * i + 2}" for i in range(len(BAD_LINES))] + [f"{path}:33"]
    for q, (_, why) in zip(got, BAD_LINES):
        assert why in q["reason"], q
    assert "not UTF-8" in got[-1]["reason"]
    # The same data is fine when the threshold allows it.
    data = prep(tmp_path, tok, path, max_bad_fraction=0.6)
    assert data.stats["quarantined"] == 17 and data.stats["train_rows"] == 16


def test_origins_in_json_csv_and_parquet(tmp_path, tok):
    rows = [GOOD, {"instruction": "x", "output": ""}, GOOD]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    with open(tmp_path / "b.csv", "w") as fh:
        fh.write('instruction,output\n"multi\nline",ok\nx,\ny,z\n')
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": None}]), tmp_path / "c.parquet")
    for name, where in (("a.json", ":14"), ("b.csv", ":4"), ("c.parquet", ":row 2")):
        prep(tmp_path / f"out-{name}", tok, tmp_path / name, max_bad_fraction=1)
        (q,) = quarantine(tmp_path / f"out-{name}")
        assert q["where"] == f"{tmp_path / name}{where}", q


def test_long_rows_truncate_drop_or_error(tmp_path, tok):
    rows = chat_rows(20) + [{"messages": [{"role": "user", "content": "long " * 60},
                                          {"role": "assistant", "content": "ok"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = prep(tmp_path, tok, path, max_seq_length=40, max_bad_fraction=0.1)
    # Truncated at 40 tokens, the long row has no reply left: quarantined, not trained on.
    assert data.stats["quarantined"] == 1 and data.stats["truncated"] == 0
    rows[-1]["messages"] = list(reversed([{"role": "assistant", "content": "answer " * 30},
                                          {"role": "user", "content": "q"}]))
    write_jsonl(path, rows)
    data = prep(tmp_path, tok, path, max_seq_length=40)
    assert data.stats["truncated"] == 1 and max(len(r.input_ids) for r in data.train) == 40
    data = prep(tmp_path, tok, path, max_seq_length=40, on_long_rows="drop")
    assert data.stats["dropped"] == 1 and data.stats["train_rows"] == 20
    assert "dropped" in quarantine(tmp_path)[0]["reason"]
    with pytest.raises(UserError, match=rf"{path}:21: \d+ tokens"):
        prep(tmp_path, tok, path, max_seq_length=40, on_long_rows="error")


def test_unreadable_files_are_user_errors_with_place(tmp_path, tok):
    (tmp_path / "a.json").write_text('[\n{"text": "a"},\n{"text": }\n]')
    with pytest.raises(UserError, match=r"a\.json:3: not valid JSON"):
        prep(tmp_path, tok, tmp_path / "a.json")
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match="cannot read as parquet"):
        prep(tmp_path, tok, tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(UserError, match="expected .jsonl"):
        prep(tmp_path, tok, tmp_path / "c.txt")


def test_data_command_prints_statistics_and_exits_2_on_unusable_data(tmp_path, tiny_model):
    rows = chat_rows(30) + [{"messages": []}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = make_config(tmp_path, tiny_model, data, packing=True, max_seq_length=64, max_bad_fraction=0.05)
    ok = run_cli("data", str(cfg))
    assert ok.returncode == 0, ok.stderr
    for label in ("rows by format     messages 30", "quarantined        1", "token lengths      p50",
                  "packing            on:", "truncated          0"):
        assert label in ok.stdout, ok.stdout
    bad = run_cli("data", str(cfg), "max_bad_fraction=0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{data}:31" in bad.stderr and "1 of 31 rows are unusable" in bad.stderr
