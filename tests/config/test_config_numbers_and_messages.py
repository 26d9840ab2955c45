"""Numbers past Python's int-string limit, time_limit given as a number, and a folder given as the
config: each is exit 2 with the file:line (or the override) and the key, never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relaytune import cli
from relaytune.config.loader import load_config
from relaytune.errors import UserError

LIMIT = sys.get_int_max_str_digits()
BIG = "1" + "0" * 5000  # 5,001 digits
TOO_LONG = (f"the number has 5,001 digits, too large for any setting "
            f"(at most {LIMIT:,} digits can be read as an integer)")


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def refusal(source, overrides=None) -> str:
    with pytest.raises(UserError) as info:
        load_config(source, overrides)
    return str(info.value)


def test_a_huge_integer_in_the_file_names_its_line_and_key(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", f"dataset: d.jsonl\nmax_steps: {BIG}\noutput_dir: run\n")
    assert refusal(cfg) == f"{cfg}:2: `max_steps`: {TOO_LONG}"
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{cfg}:2: `max_steps`" in err and len(err) < 400


def test_a_huge_integer_nested_in_a_dataset_entry_names_the_entry_line(tmp_path):
    cfg = write(tmp_path / "c.yaml", f"output_dir: run\ndataset:\n  - path: a.jsonl\n    weight: -{BIG}\n")
    assert refusal(cfg) == f"{cfg}:4: `dataset`: {TOO_LONG}"


def test_a_huge_integer_override_names_the_override_and_key(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", "dataset: d.jsonl\noutput_dir: run\n")
    message = refusal(cfg, [f"max_steps={BIG}"])
    assert message.startswith("the override max_steps=1000") and message.endswith(f"`max_steps`: {TOO_LONG}")
    assert len(message) < 400, "the 5,000 digits are clipped"
    assert cli.main(["data", str(cfg), f"max_steps={BIG}"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_huge_integers_that_python_can_hold_are_range_errors_that_can_be_shown(tmp_path):
    hexa = write(tmp_path / "c.yaml", "dataset: d.jsonl\noutput_dir: run\nmax_steps: 0x" + "f" * 5000 + "\n")
    message = refusal(hexa)
    assert message.startswith(f"invalid configuration:\n  {hexa}:3: `max_steps`: must be at most 2,147,483,647")
    assert "got a number of about 6,021 digits" in message
    from_dict = refusal({"dataset": "d.jsonl", "output_dir": "run", "seed": 10**5000})
    assert "`seed`: must be between 0 and" in from_dict and "got a number of about 5,001 digits" in from_dict


@pytest.mark.parametrize("written,kept", [("3600", "3600"), ("'3600'", "3600"), ("90.5", "90.5"),
                                          ("1:30:00", "5400"), ("11h30m", "11h30m")])
def test_time_limit_takes_plain_seconds(tmp_path, written, kept):
    cfg = write(tmp_path / "c.yaml", f"dataset: d.jsonl\noutput_dir: run\ntime_limit: {written}\n")
    assert load_config(cfg).time_limit == kept
    assert load_config(tmp_path / "c.yaml", ["time_limit=7200"]).time_limit == "7200"


@pytest.mark.parametrize("written,got", [("-5", "'-5' is not a duration"), ("soon", "'soon' is not a duration"),
                                         ("[1]", "a duration is text or a number of seconds, not a list"),
                                         ("true", "a duration is text or a number of seconds, not a bool"),
                                         (".inf", "'inf' is not a duration")])
def test_a_bad_time_limit_says_what_to_write(tmp_path, written, got):
    cfg = write(tmp_path / "c.yaml", f"dataset: d.jsonl\noutput_dir: run\ntime_limit: {written}\n")
    message = refusal(cfg)
    assert message.startswith(f"invalid configuration:\n  {cfg}:3: `time_limit`: {got}"), message
    assert "write e.g. 11h30m, 90m, 45s, 1d, or plain seconds (3600)" in message
    assert "valid string" not in message


def test_a_folder_given_as_the_config_is_called_a_folder(tmp_path, capsys):
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    assert refusal(folder) == f"{folder}: this is a folder, not a config file; name the .yaml file in it"
    assert cli.main(["train", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "this is a folder" in err and "not found" not in err and "Traceback" not in err
    assert refusal(tmp_path / "none.yaml") == f"{tmp_path / 'none.yaml'}: config file not found"
