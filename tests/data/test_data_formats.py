"""Every format in every file type, folders, `datasets` sources, column mapping, mixing."""

import json

import pytest

from relaytune.config.loader import load_config
from relaytune.data import prepare_data
from relaytune.errors import UserError
from relaytune.tiny import make_tokenizer

ROWS = {
    "text": [{"text": f"the quick brown fox {i}"} for i in range(6)],
    "alpaca": [{"instruction": f"add {i} and 1", "input": "" if i % 2 else "quickly", "output": str(i + 1),
                **({"system": "be brief"} if i % 3 == 0 else {})} for i in range(6)],
    "messages": [{"messages": [{"role": "user", "content": f"{i} plus 1"},
                               {"role": "assistant", "content": str(i + 1)}]} for i in range(6)],
    "sharegpt": [{"conversations": [{"from": "system", "value": "hi"}, {"from": "human", "value": f"{i}?"},
                                    {"from": "gpt", "value": str(i)}]} for i in range(6)],
    "prompt_completion": [{"prompt": f"{i} plus 1 =", "completion": f" {i + 1}"} for i in range(6)],
}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def write(path, rows):
    """Write rows as jsonl, json, csv or parquet (nested values as JSON text in csv)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif path.suffix == ".csv":
        import csv
        keys = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(keys)
            for r in rows:
                w.writerow([json.dumps(r[k]) if isinstance(r.get(k), list) else r.get(k, "") for k in keys])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prep(tmp_path, tok, dataset, **settings):
    cfg = load_config({"dataset": dataset, "output_dir": str(tmp_path / "run"), **settings})
    return prepare_data(cfg, tok)


def tokens(data):
    return [r.input_ids.tolist() for r in data.train], [r.labels.tolist() for r in data.train]


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_each_format_in_each_file_type(tmp_path, tok, fmt):
    reference = None
    for suffix in (".jsonl", ".json", ".csv", ".parquet"):
        path = write(tmp_path / f"d-{fmt}{suffix}", ROWS[fmt])
        data = prep(tmp_path / suffix[1:], tok, str(path), dataset_cache=False)
        assert data.stats["rows_by_format"] == {fmt: 6}, suffix
        assert data.stats["quarantined"] == 0
        reference = reference or tokens(data)
        assert tokens(data) == reference, suffix  # the file type never changes the tokens
        forced = prep(tmp_path / f"{suffix[1:]}-forced", tok, str(path), dataset_format=fmt, dataset_cache=False)
        assert tokens(forced) == reference


def test_column_mapping_and_forced_format(tmp_path, tok):
    rows = [{"question": f"add {i}", "answer": str(i), "body": "x"} for i in range(5)]
    path = write(tmp_path / "q.jsonl", rows)
    data = prep(tmp_path, tok, str(path), dataset_columns={"instruction": "question", "output": "answer"})
    assert data.stats["rows_by_format"] == {"alpaca": 5}
    text = prep(tmp_path / "t", tok, str(path), dataset_text_field="body")
    assert text.stats["rows_by_format"] == {"text": 5}
    renamed = [{"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "bot", "text": "yo"}]}]
    path = write(tmp_path / "r.jsonl", renamed)
    data = prep(tmp_path / "r", tok, str(path),
                dataset_columns={"messages": "dialog", "role": "speaker", "content": "text"})
    assert data.stats["rows_by_format"] == {"messages": 1}
    with pytest.raises(UserError, match="did you mean `instruction`"):
        load_config({"dataset": "x.jsonl", "output_dir": "o", "dataset_columns": {"instructions": "q"}})


def test_messages_variants_are_accepted(tmp_path, tok):
    rows = [
        {"messages": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},  # sharegpt inside
        {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                      {"role": "assistant", "content": "b"}]},  # OpenAI content parts
        {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}]},  # an empty system prompt is none
    ]
    data = prep(tmp_path, tok, str(write(tmp_path / "v.jsonl", rows)), dataset_cache=False)
    assert data.stats["quarantined"] == 0 and len({tuple(r.input_ids) for r in data.train}) == 1


def test_folder_of_mixed_files(tmp_path, tok):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    write(folder / "a.jsonl", ROWS["messages"])
    write(folder / "sub" / "b.parquet", ROWS["alpaca"])
    write(folder / "c.csv", ROWS["text"])
    (folder / "notes.txt").write_text("ignored")
    (folder / "dataset_info.json").write_text('{"description": "metadata, not rows"}')
    data = prep(tmp_path, tok, str(folder))
    assert data.stats["rows_by_format"] == {"alpaca": 6, "messages": 6, "text": 6}


def test_datasets_saved_folder_and_local_load_dataset(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_list(ROWS["messages"])
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    assert prep(tmp_path / "a", tok, str(tmp_path / "saved")).stats["rows_by_format"] == {"messages": 6}
    assert prep(tmp_path / "b", tok, [{"path": str(tmp_path / "dd"), "split": "test"}]).stats["train_rows"] == 2
    hub_like = tmp_path / "hub"
    hub_like.mkdir()
    write(hub_like / "train.jsonl", ROWS["text"])
    write(hub_like / "test.jsonl", ROWS["text"][:3])
    data = prep(tmp_path / "c", tok, [{"path": str(hub_like), "split": "test"}])
    assert data.stats["rows_by_format"] == {"text": 3}
    with pytest.raises(UserError, match="no split 'validation'"):
        prep(tmp_path / "d", tok, [{"path": str(tmp_path / "dd"), "split": "validation"}])


def test_missing_source_is_a_user_error(tmp_path, tok, monkeypatch):
    import datasets
    import huggingface_hub.constants

    with pytest.raises(UserError, match="does not exist"):
        prep(tmp_path, tok, str(tmp_path / "nope.jsonl"))
    # No network here: say so, as a user offline would, rather than wait for timeouts.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="neither a data file nor a loadable dataset"):
        prep(tmp_path, tok, "no-such-org/no-such-dataset-xyz", dataset_cache=False)


def test_weighted_mix_is_deterministic(tmp_path, tok):
    a = write(tmp_path / "a.jsonl", ROWS["messages"])  # 6 rows
    b = write(tmp_path / "b.jsonl", [{"text": f"row {i}"} for i in range(10)])
    mix = [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.3}]
    one, two = prep(tmp_path / "1", tok, mix, seed=1), prep(tmp_path / "2", tok, mix, seed=1)
    assert one.stats["train_rows"] == 6 * 2 + 3
    assert tokens(one) == tokens(two) and one.fingerprint == two.fingerprint
    other = prep(tmp_path / "3", tok, mix, seed=2)
    assert other.fingerprint != one.fingerprint  # another seed picks another 30% of b
    with pytest.raises(UserError, match="select no training rows"):
        prep(tmp_path / "4", tok, [{"path": str(a), "weight": 0}])
