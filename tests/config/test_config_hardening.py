"""Hostile or odd config input: exit 2 with file, line and key named, never a traceback or a stall.

Issue 15 item 6 (ranges, YAML alias bombs, deep nesting, duplicate keys), issue 15 item 2
(non-finite hyperparameters), issue 14 item 6 (unquoted timestamps, enum lists) and issue 13
item 4 (warmup longer than the run is a warning, as in Hugging Face's Trainer).
"""

from __future__ import annotations

import time
from datetime import date, datetime, timezone
from pathlib import Path

import pytest

from relaytune import cli
from relaytune.config.loader import load_config
from relaytune.config.schema import parse_timestamp
from relaytune.errors import UserError


def config_file(tmp_path: Path, extra: str = "") -> Path:
    """dataset and output_dir on lines 1-2, then `extra` from line 3 on."""
    path = tmp_path / "config.yaml"
    path.write_text(f"dataset: {tmp_path / 'data.jsonl'}\noutput_dir: {tmp_path / 'run'}\n{extra}",
                    encoding="utf-8")
    return path


def refused(source, overrides=None) -> str:
    with pytest.raises(UserError) as info:
        load_config(source, overrides)
    return str(info.value)


# --- ranges and non-finite values (issue 15 items 2 and 6) --------------------------------------

OUT_OF_RANGE = [
    ("learning_rate", ".inf"), ("learning_rate", ".nan"), ("weight_decay", ".nan"),
    ("weight_decay", "-0.1"), ("num_train_epochs", ".inf"), ("max_grad_norm", ".inf"),
    ("max_grad_norm", "-1.0"), ("nan_lr_factor", ".nan"), ("warmup_ratio", ".nan"),
    ("lora_dropout", ".nan"), ("val_set_size", ".inf"), ("val_set_size", "-1"),
    ("max_bad_fraction", ".nan"), ("save_every_seconds", ".inf"), ("save_every_seconds", ".nan"),
    ("adam_beta1", "1.0"), ("adam_beta1", "-0.1"), ("adam_beta2", "1.5"), ("adam_beta2", ".nan"),
    ("adam_epsilon", "0"), ("adam_epsilon", "-1.0e-8"), ("adam_epsilon", ".inf"),
    ("seed", "-1"), ("seed", "4294967296"), ("seed", "99999999999999999999"),
    ("lora_r", "1000000"), ("lora_alpha", "100000000"), ("max_seq_length", "2097152"),
    ("per_device_train_batch_size", "1000000"), ("gradient_accumulation_steps", "65537"),
    ("max_steps", "1.0e+30"), ("warmup_steps", "-5"), ("num_train_epochs", "1.0e+18"),
]


@pytest.mark.parametrize("key,value", OUT_OF_RANGE)
def test_out_of_range_value_names_file_line_and_key(tmp_path, key, value):
    cfg = config_file(tmp_path, f"seed: 1\n{key}: {value}\n" if key != "seed" else f"{key}: {value}\n")
    line = 4 if key != "seed" else 3
    message = refused(cfg)
    assert f"{cfg}:{line}: `{key}`:" in message, message


@pytest.mark.parametrize("key,value", [("learning_rate", ".inf"), ("adam_beta1", "1.0"), ("lora_r", "1000000")])
def test_out_of_range_is_exit_2_without_traceback(tmp_path, capsys, key, value):
    cfg = config_file(tmp_path, f"{key}: {value}\n")
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"`{key}`" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_non_finite_override_names_the_override(tmp_path):
    message = refused(config_file(tmp_path), ["learning_rate=.inf"])
    assert "the override learning_rate=inf: `learning_rate`:" in message and "finite" in message


@pytest.mark.parametrize("extra", [
    "adam_beta1: 0\nadam_beta2: 0.9999\nseed: 0\n", "seed: 4294967295\nlora_r: 4096\nlora_alpha: 8192\n",
    "max_seq_length: 1048576\nper_device_train_batch_size: 65536\ngradient_accumulation_steps: 65536\n",
    "weight_decay: 0\nmax_grad_norm: 0\nsave_every_seconds: 0\nwarmup_steps: 0\nval_set_size: 0\n",
    "max_steps: 2147483647\nnum_train_epochs: 0.5\n",
])
def test_edges_of_each_range_are_accepted(tmp_path, extra):
    load_config(config_file(tmp_path, extra))


def test_dataset_weight_is_capped(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\ndataset:\n  - path: a.jsonl\n    weight: 1.0e+12\n")
    message = refused(cfg)
    assert "`weight` must be at most 10,000" in message and f"{cfg}:2:" in message


# --- YAML structure (issue 15 item 6) ------------------------------------------------------------

def alias_bomb(levels: int = 9) -> str:
    lines = ["lora_target_modules:", '  - &l0 ["a", "a", "a", "a", "a", "a", "a", "a", "a"]']
    for i in range(1, levels):
        lines.append(f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_in_a_known_key_is_refused_at_once(tmp_path):
    cfg = config_file(tmp_path, alias_bomb())
    started = time.monotonic()
    message = refused(cfg)
    assert time.monotonic() - started < 20  # expanded, it would take minutes and gigabytes
    assert message == (f"{cfg}:4: YAML anchors and aliases (&name, *name) are not accepted in a config; "
                       "write the value out")


def test_an_anchor_alone_is_refused_too(tmp_path):
    cfg = config_file(tmp_path, "run_name: &n demo\n")
    assert "anchors and aliases" in refused(cfg) and f"{cfg}:3:" in refused(cfg)


@pytest.mark.parametrize("depth", [25, 5000])
def test_deeply_nested_yaml_is_refused_with_a_message(tmp_path, capsys, depth):
    cfg = config_file(tmp_path, "lora_target_modules: " + "[" * depth + "]" * depth + "\n")
    message = refused(cfg)
    assert message == (f"{cfg}:3: nested more than 20 levels deep; a config is a flat list of "
                       "key: value lines")
    assert cli.main(["train", str(cfg)]) == 2 and "Traceback" not in capsys.readouterr().err


def test_duplicate_key_names_both_lines(tmp_path, capsys):
    cfg = config_file(tmp_path, "seed: 1\nlearning_rate: 1.0e-4\noutput_dir: elsewhere\n")
    assert refused(cfg) == f"`output_dir` is set twice: {cfg}:2 and {cfg}:5; keep one"
    assert cli.main(["train", str(cfg)]) == 2
    assert "is set twice" in capsys.readouterr().err


def test_duplicate_key_inside_a_dataset_entry(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\ndataset:\n  - path: a.jsonl\n    weight: 1\n"
                   "    weight: 2\n")
    assert refused(cfg) == f"`weight` is set twice: {cfg}:4 and {cfg}:5; keep one"


def test_oversized_config_file_is_refused_before_parsing(tmp_path):
    cfg = config_file(tmp_path, "# " + "x" * (1 << 20) + "\n")
    message = refused(cfg)
    assert message.startswith(f"{cfg}: ") and "too large for a config file" in message


def test_override_with_yaml_alias_syntax_stays_text(tmp_path):
    assert load_config(config_file(tmp_path), ["run_name=*not_an_alias"]).run_name == "*not_an_alias"
    bomb = "[&a [x, x], [*a, *a], [*a, *a]]"
    assert load_config(config_file(tmp_path), [f"lora_target_modules={bomb}"]).lora_target_modules == bomb


def test_plain_yaml_still_reads_as_safe_load_does(tmp_path):
    cfg = load_config(config_file(tmp_path, "lora_target_modules: [q_proj, v_proj]\nbf16: true\n"
                                            "learning_rate: 1.0e-4\nsave_total_limit: null\n"))
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.bf16 is True
    assert cfg.learning_rate == 1e-4 and cfg.save_total_limit is None
    with pytest.raises(UserError, match="could not determine a constructor"):
        load_config(config_file(tmp_path, "run_name: !!python/object/apply:os.system [echo hi]\n"))


# --- timestamps and enum messages (issue 14 item 6) ------------------------------------------------

def test_readme_deadline_works_unquoted(tmp_path):
    cfg = load_config(config_file(tmp_path, "deadline: 2026-12-01T06:00:00Z\n"))
    assert cfg.deadline == "2026-12-01T06:00:00Z"
    assert parse_timestamp(cfg.deadline) == datetime(2026, 12, 1, 6, tzinfo=timezone.utc).timestamp()
    quoted = load_config(config_file(tmp_path, "deadline: '2026-12-01T06:00:00Z'\n"))
    assert quoted.deadline == cfg.deadline
    assert load_config(config_file(tmp_path), ["deadline=2026-12-01T06:00:00Z"]).deadline == cfg.deadline


def test_deadline_as_date_or_datetime_object(tmp_path):
    assert load_config(config_file(tmp_path, "deadline: 2026-12-01\n")).deadline == "2026-12-01"
    when = datetime(2026, 12, 1, 6, tzinfo=timezone.utc)
    cfg = load_config({"dataset": "d.jsonl", "output_dir": "o", "deadline": when})
    assert parse_timestamp(cfg.deadline) == when.timestamp()
    by_date = load_config({"dataset": "d.jsonl", "output_dir": "o", "deadline": date(2026, 12, 1)})
    assert by_date.deadline == "2026-12-01"
    assert load_config(config_file(tmp_path, "run_name: 2026-12-01\n")).run_name == "2026-12-01"


@pytest.mark.parametrize("key,value,allowed", [
    ("optim", "adamw", ["adamw_torch", "adamw_8bit", "paged_adamw_8bit"]),
    ("lr_scheduler_type", "foo", ["linear", "cosine", "constant", "constant_with_warmup"]),
])
def test_enum_error_lists_the_allowed_values_once(tmp_path, key, value, allowed):
    message = refused(config_file(tmp_path, f"{key}: {value}\n"))
    for option in allowed:
        assert message.count(f"'{option}'") == 1, message
    assert f"got {value!r} (allowed: " in message


# --- warmup longer than the run (issue 13 item 4) --------------------------------------------------

def test_warmup_longer_than_max_steps_is_a_warning(tmp_path, capsys):
    cfg = load_config(config_file(tmp_path, "max_steps: 5\nwarmup_steps: 10\n"))
    assert (cfg.max_steps, cfg.warmup_steps) == (5, 10)
    err = capsys.readouterr().err
    assert "relaytune: warning: warmup_steps (10) is not shorter than the run (max_steps 5)" in err
    load_config(config_file(tmp_path, "max_steps: 10\nwarmup_steps: 9\n"))
    assert "warning" not in capsys.readouterr().err
