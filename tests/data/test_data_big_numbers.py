"""A JSON integer past Python's int-string limit (4300 digits) is a bad row like invalid JSON, not a
traceback; in a .json file it is the file-level "not valid JSON" error; and a missing eval_dataset
is named as eval_dataset, at its config line."""

import json
import sys

import pytest
from conftest import chat_rows, make_config, write_jsonl
from support.prepared import prep, quarantine

from relaytune.config.loader import load_config
from relaytune.data import prepare_data
from relaytune.data.formats import NotJson, load_json
from relaytune.errors import UserError
from relaytune.tiny import make_tokenizer

LIMIT = sys.get_int_max_str_digits()
BIG = "1" + "0" * 5000  # 5,001 digits
REASON = f"not valid JSON (a number with 5,001 digits, more than the {LIMIT:,} that can be read as an integer)"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_load_json_names_the_long_number_and_its_line():
    assert load_json('{"a": 12, "b": -3, "c": 1.5}') == {"a": 12, "b": -3, "c": 1.5}
    assert load_json("1" + "0" * (LIMIT - 1)) == 10 ** (LIMIT - 1)  # at the limit: still read
    with pytest.raises(NotJson) as info:
        load_json('{\n"text": "x",\n"n": -' + BIG + "}")
    assert info.value.line == 3
    assert info.value.reason == f"a number with 5,001 digits, more than the {LIMIT:,} that can be read as an integer"
    with pytest.raises(NotJson) as info:
        load_json('{"a": }')
    assert info.value.reason == "Expecting value, column 7" and info.value.line == 1


def test_a_jsonl_row_with_a_huge_integer_is_quarantined_and_the_rest_trains(tmp_path, tok):
    good = [json.dumps(r) for r in chat_rows(20)]
    path = write_lines(tmp_path / "d.jsonl", good[:10] + ['{"text": ' + BIG + "}"] + good[10:]
                       + ['{"messages": [{"role": "user", "content": -' + BIG + "}]}"])
    data = prep(tmp_path, tok, path, max_bad_fraction=0.5)
    assert data.stats["train_rows"] == 20
    assert quarantine(tmp_path) == [{"where": f"{path}:11", "reason": REASON},
                                    {"where": f"{path}:22", "reason": REASON}]
    with pytest.raises(UserError, match=rf"{path}:11") as info:
        prep(tmp_path, tok, path, max_bad_fraction=0)
    assert "Traceback" not in str(info.value)


def test_a_json_file_with_a_huge_integer_is_not_valid_json_at_its_line(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text('[\n{"text": "a"},\n{"text": ' + BIG + "}\n]", encoding="utf-8")
    with pytest.raises(UserError) as info:
        prep(tmp_path, tok, path)
    assert str(info.value) == f"{path}:3: not valid JSON: a number with 5,001 digits, more than the " \
        f"{LIMIT:,} that can be read as an integer"


def test_a_csv_message_list_with_a_huge_integer_is_a_bad_row(tmp_path, tok):
    rows = [json.dumps(r["messages"]) for r in chat_rows(4)] + ["[" + BIG + "]"]
    path = tmp_path / "d.csv"
    path.write_text("messages\n" + "".join('"' + r.replace('"', '""') + '"\n' for r in rows), encoding="utf-8")
    data = prep(tmp_path, tok, path, max_bad_fraction=0.5)
    assert data.stats["train_rows"] == 4
    [bad] = quarantine(tmp_path)
    assert bad["where"] == f"{path}:6" and "a number with 5,001 digits" in bad["reason"], bad


def test_cli_data_and_train_quarantine_the_row_and_go_on(tmp_path, tiny_model, fork_cli):
    good = [json.dumps(r) for r in chat_rows(30)]
    data = write_lines(tmp_path / "d.jsonl", good + ['{"text": ' + BIG + "}"])
    cfg = make_config(tmp_path, tiny_model, data, max_steps=2, max_seq_length=64, max_bad_fraction=0.5)
    checked = fork_cli.run("data", str(cfg))
    assert checked.returncode == 0, checked.stderr
    assert "quarantined        1" in checked.stdout and "Traceback" not in checked.stderr
    trained = fork_cli.run("train", str(cfg))
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    assert {"where": f"{data}:31", "reason": REASON} in quarantine(tmp_path)
    refused = fork_cli.run("data", str(cfg), "max_bad_fraction=0")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and f"{data}:31" in refused.stderr


def test_a_missing_eval_dataset_is_named_with_its_config_line(tmp_path, tok):
    write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("dataset: d.jsonl\neval_dataset: missing_eval.jsonl\noutput_dir: run\n"
                        "dataset_cache: false\n", encoding="utf-8")
    with pytest.raises(UserError) as info:
        prepare_data(load_config(cfg_file), tok)
    assert str(info.value) == f"{cfg_file}:2: `eval_dataset`: {tmp_path / 'missing_eval.jsonl'} does not exist"
    with pytest.raises(UserError) as info:
        prepare_data(load_config(cfg_file, ["eval_dataset=/nowhere/e.jsonl"]), tok)
    assert str(info.value) == "the override eval_dataset=/nowhere/e.jsonl: `eval_dataset`: /nowhere/e.jsonl " \
        "does not exist"
    cfg_file.write_text("dataset: gone.jsonl\noutput_dir: run\n", encoding="utf-8")
    with pytest.raises(UserError, match=rf"^{cfg_file}:1: `dataset`: .*gone\.jsonl does not exist$"):
        prepare_data(load_config(cfg_file), tok)
