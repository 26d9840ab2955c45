"""The config contract: every mistake is exit 2 with what and where (file:line), no traceback.

Most cases call `relaytune.cli.main` in-process (the same function the console command runs,
without the seconds of imports of a new process); one case runs a real CLI process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import chat_rows, run_cli, write_jsonl

from relaytune import cli
from relaytune.config.loader import load_config
from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def base_yaml(tmp_path: Path, extra: str = "") -> Path:
    """dataset and output_dir on lines 1-2, then `extra` from line 3 on."""
    return write_yaml(tmp_path / "config.yaml",
                      f"dataset: {tmp_path / 'data.jsonl'}\noutput_dir: {tmp_path / 'run'}\n{extra}")


def main_exit(argv: list[str], capsys) -> tuple[int, str]:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    return rc, err


def user_error(source, overrides=None) -> str:
    with pytest.raises(UserError) as info:
        load_config(source, overrides)
    return str(info.value)


# --- unknown keys -----------------------------------------------------------------------------

UNKNOWN = "`save_stpes` is not a key; did you mean `save_steps`?"


def test_unknown_key_real_cli_process(tmp_path):
    cfg = base_yaml(tmp_path, "learning_rate: 1.0e-4\nsave_stpes: 10\n")
    r = run_cli("train", str(cfg))
    assert r.returncode == 2
    assert f"relaytune: error: {cfg}:4: {UNKNOWN}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists(), "a config error must stop before anything is written"


def test_unknown_key_load_config(tmp_path):
    cfg = base_yaml(tmp_path, "save_stpes: 10\n")
    assert user_error(cfg) == f"{cfg}:3: {UNKNOWN}"
    assert issubclass(UserError, Exception) and UserError.exit_code == 2


def test_unknown_key_in_override_and_without_close_match(tmp_path, capsys):
    cfg = base_yaml(tmp_path)
    assert user_error(cfg, ["save_stpes=3"]) == f"the override save_stpes=3: {UNKNOWN}"
    rc, err = main_exit(["train", str(cfg), "save_stpes=3"], capsys)
    assert rc == 2 and f"relaytune: error: the override save_stpes=3: {UNKNOWN}" in err
    far = base_yaml(tmp_path, "frobnicate: 1\n")
    assert user_error(far) == f"{far}:3: `frobnicate` is not a key; `relaytune train --help` lists the keys"


def test_misspelled_alias_suggests_the_canonical_key(tmp_path):
    cfg = base_yaml(tmp_path, "max_lenght: 256\n")
    assert user_error(cfg) == f"{cfg}:3: `max_lenght` is not a key; did you mean `max_seq_length`?"


def test_misspelled_key_in_a_dataset_entry_names_the_closest_key(tmp_path):
    cfg = write_yaml(tmp_path / "config.yaml", f"output_dir: {tmp_path / 'run'}\ndataset:\n"
                                                 "  - path: a.jsonl\n    wieght: 2\n")
    message = user_error(cfg)
    assert "`wieght`" in message and "did you mean `weight`?" in message
    assert "valid string" not in message


# --- bad values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,allowed", [
    ("optim", "adamw", ["adamw_torch", "adamw_8bit", "paged_adamw_8bit"]),
    ("lr_scheduler_type", "cosin", ["linear", "cosine", "constant", "constant_with_warmup"]),
    ("bnb_4bit_quant_type", "nf8", ["nf4", "fp4"]),
])
def test_bad_literal_names_key_line_and_allowed_values(tmp_path, capsys, key, value, allowed):
    cfg = base_yaml(tmp_path, f"seed: 1\n{key}: {value}\n")
    message = user_error(cfg)
    assert f"{cfg}:4: `{key}`:" in message
    assert f"got {value!r}" in message
    tail = message.split("allowed:", 1)[1]
    for option in allowed:
        assert repr(option) in tail
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 2 and "Traceback" not in err and f"`{key}`" in err


def test_bad_type_names_key_line_and_value(tmp_path):
    cfg = base_yaml(tmp_path, "max_steps: lots\n")
    message = user_error(cfg)
    assert f"{cfg}:3: `max_steps`:" in message and "got 'lots'" in message
    assert "valid integer" in message


@pytest.mark.parametrize("extra,expected", [
    ("fp16: true\nbf16: true\n", "fp16 and bf16 are both true; choose one"),
    ("load_in_4bit: true\nload_in_8bit: true\n", "load_in_4bit and load_in_8bit are both true; choose one"),
])
def test_cross_field_errors(tmp_path, capsys, extra, expected):
    cfg = base_yaml(tmp_path, extra)
    assert expected in user_error(cfg)
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 2 and expected in err and "Traceback" not in err


def test_cross_field_ok_cases(tmp_path):
    assert load_config(base_yaml(tmp_path, "max_steps: 10\nwarmup_steps: 9\n")).warmup_steps == 9
    assert load_config(base_yaml(tmp_path, "fp16: true\nbf16: false\n")).fp16 is True
    assert load_config(base_yaml(tmp_path, "load_in_4bit: true\n")).load_in_4bit is True


def test_warmup_not_shorter_than_derived_run_warns_and_trains(tmp_path, tiny_model, capsys):
    # 40 rows, global batch 8, 1 epoch: 5 steps, so 5 warmup steps never reach the peak; HF accepts it.
    write_jsonl(tmp_path / "data.jsonl", chat_rows(40))
    cfg = base_yaml(tmp_path, f"model: {tiny_model}\nnum_train_epochs: 1\nper_device_train_batch_size: 8\n"
                              "warmup_steps: 5\n")
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 0, err
    assert "warning: warmup (5 steps) is not shorter than the run (5 steps)" in err
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").exists()


# --- aliases --------------------------------------------------------------------------------------

@pytest.mark.parametrize("alias", ["model_name_or_path", "base_model"])
def test_model_aliases(tmp_path, alias):
    cfg = load_config(base_yaml(tmp_path, f"{alias}: org/some-model\n"))
    assert cfg.model == "org/some-model"
    assert load_config({"dataset": "d", "output_dir": "o", alias: "x/y"}).model == "x/y"


def test_max_length_alias(tmp_path):
    assert load_config(base_yaml(tmp_path, "max_length: 256\n")).max_seq_length == 256
    assert load_config(base_yaml(tmp_path), ["max_length=128"]).max_seq_length == 128


@pytest.mark.parametrize("first,second", [
    ("model", "base_model"),
    ("max_seq_length", "max_length"),
    ("base_model", "model"),
    ("max_length", "max_seq_length"),
    ("model_name_or_path", "base_model"),
])
def test_alias_and_canonical_together_is_an_error(tmp_path, capsys, first, second):
    value = "64" if "length" in first else "some/model"
    cfg = base_yaml(tmp_path, f"{first}: {value}\n{second}: {value}\n")
    message = user_error(cfg)
    assert message.startswith(f"{cfg}:4: ")
    assert "name the same setting; keep one" in message
    named = re.findall(r"`([^`]+)`", message)
    assert sorted(named) == sorted([first, second]), message
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 2 and "Traceback" not in err


# --- overrides --------------------------------------------------------------------------------------

def test_overrides_are_typed_by_yaml_and_win(tmp_path):
    cfg = base_yaml(tmp_path, "max_steps: 5\nlearning_rate: 0.1\n")
    c = load_config(cfg, ["learning_rate=1e-4", "max_steps=20", "bf16=true", "lora_dropout=0",
                          "lora_target_modules=[q_proj, v_proj]", "resume_from_checkpoint=false",
                          "time_limit=90m", "save_total_limit=null", "model_name_or_path=a/b"])
    assert (c.learning_rate, type(c.learning_rate)) == (1e-4, float)
    assert (c.max_steps, type(c.max_steps)) == (20, int)
    assert c.bf16 is True
    assert (c.lora_dropout, type(c.lora_dropout)) == (0.0, float)
    assert c.lora_target_modules == ["q_proj", "v_proj"]
    assert c.resume_from_checkpoint is False
    assert c.time_limit == "90m"
    assert c.save_total_limit is None
    assert c.model == "a/b"


def test_bad_override_names_the_override(tmp_path, capsys):
    cfg = base_yaml(tmp_path)
    message = user_error(cfg, ["max_steps=abc"])
    assert "the override max_steps=abc: `max_steps`:" in message and "got 'abc'" in message
    assert user_error(cfg, ["learning_rate"]) == \
        "override 'learning_rate' is not key=value (e.g. learning_rate=1e-4)"
    rc, err = main_exit(["train", str(cfg), "max_steps=abc"], capsys)
    assert rc == 2 and "the override max_steps=abc" in err and "Traceback" not in err


# --- the file itself ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,line,problem", [
    ("learning_rate: 1e-4: x\n", 3, "mapping values are not allowed here"),
    ("  max_steps: 3\nseed: 1\n", 3, "mapping values are not allowed here"),
])
def test_invalid_yaml_gives_file_and_line(tmp_path, capsys, extra, line, problem):
    cfg = base_yaml(tmp_path, extra)
    assert user_error(cfg) == f"{cfg}:{line}: not valid YAML: {problem}"
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 2 and f"{cfg}:{line}: not valid YAML" in err and "Traceback" not in err


def test_not_a_mapping_and_missing_file(tmp_path):
    listed = write_yaml(tmp_path / "list.yaml", "- a\n- b\n")
    assert user_error(listed) == f"{listed}: the config must be a flat mapping of key: value lines"
    missing = tmp_path / "nope.yaml"
    assert user_error(missing) == f"{missing}: config file not found"


def test_missing_required_dataset(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "config.yaml", f"output_dir: {tmp_path / 'run'}\nmax_steps: 3\n")
    message = user_error(cfg)
    assert "`dataset` is required" in message
    assert "output_dir" not in message.split("`dataset` is required", 1)[0]
    first_words = " ".join(TrainConfig.model_fields["dataset"].description.split()[:4])
    assert first_words in " ".join(message.split())
    rc, err = main_exit(["train", str(cfg)], capsys)
    assert rc == 2 and "`dataset` is required" in err and "Traceback" not in err


# --- --help ------------------------------------------------------------------------------------------

def test_help_lists_every_field_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    epilog = text.split("configuration keys", 1)[1]
    # Sections: "  key  (default: ...)" then the wrapped docstring, indented by 6.
    sections: dict[str, str] = {}
    current = None
    for line in epilog.splitlines():
        m = re.match(r"^  (\w+)  \(default: (.*)\)$", line)
        if m:
            current = m.group(1)
            sections[current] = ""
        elif current and line.startswith("      "):
            sections[current] += " " + line.strip()
    assert list(sections) == list(TrainConfig.model_fields), "every field, in declaration order"
    squash = lambda s: re.sub(r"\s+", "", s)  # noqa: E731  (wrapping may split at hyphens)
    for name, field in TrainConfig.model_fields.items():
        assert field.description, f"{name} has no docstring"
        assert squash(sections[name]) == squash(field.description), name
    assert "(default: required)" in epilog.split("  dataset  ", 1)[1].splitlines()[0]


def test_hf_only_keys_say_what_to_do_instead(tmp_path):
    """Seed 2's TrainingArguments carry evaluation_strategy/save_strategy: say what replaces them."""
    cfg = base_yaml(tmp_path, "evaluation_strategy: steps\n")
    message = user_error(cfg)
    assert "`evaluation_strategy` is not a key: evaluation runs every `eval_steps`" in message
    assert message.startswith(f"{cfg}:")
