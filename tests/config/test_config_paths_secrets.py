"""Relative paths resolve against the config file's folder (issue 14 item 1), and credentials
in `mirror_to` are refused without ever being repeated (issue 15 item 1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relaytune import cli
from relaytune.config.datasets import DatasetSource
from relaytune.config.loader import load_config
from relaytune.config.paths import saved_config_view
from relaytune.errors import UserError
from relaytune.redact import redact_url, scrub, url_secrets


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """tmp/cfg/config.yaml, and the working directory tmp/elsewhere: `cd elsewhere &&
    relaytune train ../cfg/config.yaml`."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- issue 14 item 1: paths ----------------------------------------------------------------------

def test_paths_in_a_file_resolve_against_its_folder(layout):
    cfg_dir = layout / "cfg"
    (cfg_dir / "models" / "mine").mkdir(parents=True)
    write(cfg_dir / "t.jinja", "{{ messages }}")
    write(cfg_dir / "config.yaml",
          "output_dir: runs/x\ndataset: data.jsonl\neval_dataset: ./eval.jsonl\nmodel: models/mine\n"
          "chat_template: t.jinja\nmirror_to: drive/backup\n"
          "resume_from_checkpoint: runs/old/checkpoints/step-3\n")
    cfg = load_config("../cfg/config.yaml")
    assert cfg.output_dir == str(cfg_dir / "runs" / "x")
    assert cfg.dataset == str(cfg_dir / "data.jsonl")
    assert cfg.eval_dataset == str(cfg_dir / "eval.jsonl")
    assert cfg.model == str(cfg_dir / "models" / "mine")
    assert cfg.chat_template == str(cfg_dir / "t.jinja")
    assert cfg.mirror_to == str(cfg_dir / "drive" / "backup")
    assert cfg.resume_from_checkpoint == str(cfg_dir / "runs" / "old" / "checkpoints" / "step-3")
    assert cfg.model_dump()["output_dir"] == str(cfg_dir / "runs" / "x"), "checkpoints save it absolute"


def test_hub_ids_names_and_urls_stay_as_written(layout):
    write(layout / "cfg" / "config.yaml",
          "output_dir: /abs/run\ndataset: tatsu-lab/alpaca\nmodel: Qwen/Qwen2.5-3B\nchat_template: chatml\n"
          "mirror_to: s3://bucket/runs\nresume_from_checkpoint: auto\n")
    cfg = load_config(layout / "cfg" / "config.yaml")
    assert (cfg.output_dir, cfg.dataset, cfg.model) == ("/abs/run", "tatsu-lab/alpaca", "Qwen/Qwen2.5-3B")
    assert (cfg.chat_template, cfg.mirror_to, cfg.resume_from_checkpoint) == ("chatml", "s3://bucket/runs", "auto")
    builtin = load_config({"dataset": "org/name:train", "output_dir": "o"})
    assert builtin.model.startswith("builtin:") and builtin.dataset == "org/name:train"


@pytest.mark.parametrize("value,resolved", [
    ("./m", "m"), ("../models/m", "../models/m"), ("small.gguf", "small.gguf"), ("org/local", "org/local"),
])
def test_model_that_is_a_path_resolves(layout, value, resolved):
    (layout / "cfg" / "org" / "local").mkdir(parents=True)
    write(layout / "cfg" / "config.yaml", f"output_dir: r\ndataset: d.jsonl\nmodel: {value}\n")
    cfg = load_config(layout / "cfg" / "config.yaml")
    assert cfg.model == os.path.normpath(layout / "cfg" / resolved)


def test_dataset_list_entries_resolve(layout):
    write(layout / "cfg" / "config.yaml",
          "output_dir: r\ndataset:\n  - a.jsonl\n  - path: sub/b.csv\n    weight: 2\n  - path: org/hub-set\n")
    cfg = load_config(layout / "cfg" / "config.yaml")
    first, second, third = cfg.dataset
    assert first == str(layout / "cfg" / "a.jsonl")
    assert isinstance(second, DatasetSource) and second.path == str(layout / "cfg" / "sub" / "b.csv")
    assert third.path == "org/hub-set"


def test_overrides_and_dicts_resolve_against_the_working_directory(layout):
    write(layout / "cfg" / "config.yaml", "output_dir: runs/x\ndataset: data.jsonl\n")
    here = layout / "elsewhere"
    cfg = load_config("../cfg/config.yaml", ["output_dir=runs/y", "dataset=mine.jsonl"])
    assert (cfg.output_dir, cfg.dataset) == (str(here / "runs" / "y"), str(here / "mine.jsonl"))
    from_dict = load_config({"output_dir": "o", "dataset": [{"path": "d.jsonl"}], "model": "~/m"})
    assert from_dict.output_dir == str(here / "o") and from_dict.dataset[0].path == str(here / "d.jsonl")
    assert from_dict.model == os.path.expanduser("~/m")
    again = load_config(from_dict, {"seed": 3})
    assert (again.output_dir, again.seed) == (from_dict.output_dir, 3)


def test_a_run_left_where_the_old_reading_put_it_is_not_silently_restarted(layout):
    write(layout / "cfg" / "config.yaml", "output_dir: runs/x\ndataset: data.jsonl\n")
    (layout / "elsewhere" / "runs" / "x" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError) as info:
        load_config("../cfg/config.yaml")
    message = str(info.value)
    assert f"{layout / 'elsewhere' / 'runs' / 'x'}" in message and "output_dir" in message
    assert load_config("../cfg/config.yaml", ["output_dir=runs/x"]).output_dir == \
        str(layout / "elsewhere" / "runs" / "x")


def test_saved_relative_paths_of_an_older_run_still_match(layout):
    """A checkpoint written before paths were resolved holds `dataset: data.jsonl`."""
    write(layout / "cfg" / "config.yaml", "output_dir: runs/x\ndataset: data.jsonl\nmodel: ./m\n")
    current = load_config(layout / "cfg" / "config.yaml").model_dump(mode="json")
    saved = {**current, "dataset": "data.jsonl", "model": "./m", "output_dir": "runs/x"}
    for bases in ((layout / "cfg",), ()):  # the config folder known, or not (the working directory differs)
        view = saved_config_view(saved, current, bases)
        assert {k: view[k] for k in ("dataset", "model")} == {k: current[k] for k in ("dataset", "model")}
    moved = {**saved, "dataset": "other.jsonl", "model": "./other"}
    view = saved_config_view(moved, current)
    assert (view["dataset"], view["model"]) == ("other.jsonl", "./other")
    hub_then = {**current, "model": "org/name"}  # a Hub id then, a local folder beside the config now
    local_now = {**current, "model": str(layout / "cfg" / "org" / "name")}
    assert saved_config_view(hub_then, local_now)["model"] == "org/name"
    listed = {**current, "dataset": [{"path": str(layout / "cfg" / "a.jsonl"), "weight": 2.0}]}
    old_list = {**current, "dataset": [{"path": "a.jsonl", "weight": 2.0}]}
    assert saved_config_view(old_list, listed)["dataset"] == listed["dataset"]


# --- issue 15 item 1: credentials in mirror_to -----------------------------------------------------

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"


@pytest.mark.parametrize("url,hint", [
    (f"s3://AKIAEXAMPLEKEY:{SECRET}@bucket/x?token=tok-{SECRET}", "AWS_SECRET_ACCESS_KEY"),
    (f"s3://bucket/x?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIAEXAMPLEKEY", "~/.aws/credentials"),
    (f"gs://bucket/x?sig={SECRET}", "gcloud"),
    (f"hf://datasets/me/runs?token={SECRET}", "HF_TOKEN"),
    (f"https://user:{SECRET}@example.com/dav/runs", "the environment"),
])
def test_credentials_in_mirror_to_are_refused_without_repeating_them(tmp_path, capsys, url, hint):
    cfg = write(tmp_path / "config.yaml", f"dataset: d.jsonl\noutput_dir: run\nmirror_to: '{url}'\n")
    for message in (_refusal(cfg), _refusal(write(tmp_path / "c2.yaml", "dataset: d.jsonl\noutput_dir: run\n"),
                                            [f"mirror_to={url}"])):
        assert "`mirror_to`" in message and "credentials" in message and hint in message, message
        assert SECRET not in message and "AKIAEXAMPLEKEY" not in message, message
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "Traceback" not in err


def _refusal(cfg, overrides=None) -> str:
    with pytest.raises(UserError) as info:
        load_config(cfg, overrides)
    return str(info.value)


@pytest.mark.parametrize("url", ["s3://bucket/runs/x", "hf://datasets/org/repo@main/runs", "gs://b/p?versioned=1",
                                 "sftp://alice@host/backups"])
def test_mirror_urls_without_credentials_are_fine(tmp_path, url):
    cfg = load_config({"dataset": "d.jsonl", "output_dir": str(tmp_path), "mirror_to": url})
    assert cfg.mirror_to == url


def test_redact_url_strips_userinfo_and_query_also_inside_text():
    assert redact_url(f"s3://KEY:{SECRET}@bucket/x?token=t#frag") == "s3://bucket/x"
    assert redact_url("s3://KEY:p@ss@bucket/x") == "s3://bucket/x"
    assert redact_url("hf://datasets/org/repo@main/x") == "hf://datasets/org/repo@main/x"
    text = f"OSError: cannot open 's3://K:{SECRET}@bkt/k?sig=zz' (403) and http://h:8080/p"
    assert redact_url(text) == "OSError: cannot open 's3://bkt/k' (403) and http://h:8080/p"
    assert redact_url("/plain/folder") == "/plain/folder"
    leaked = f"bucket name 'KEY:{SECRET}@bucket' is not valid"
    assert scrub(leaked, url_secrets(f"s3://KEY:{SECRET}@bucket/x")) == "bucket name '***:***@bucket' is not valid"


# --- URLs in path settings other than mirror_to: refused by name, never joined, never leaked ----------

URL_CASES = [  # (key, URL, secrets it carries, what the message shows of it)
    ("dataset", "https://alice:SECRETPW1@example.com/d.jsonl", ("alice", "SECRETPW1"), "https://example.com/d.jsonl"),
    ("dataset", "https://example.com/d.jsonl?token=SECRETQ2", ("SECRETQ2",), "https://example.com/d.jsonl"),
    ("eval_dataset", "https://bob:SECRETE@example.com/e.jsonl", ("SECRETE",), "https://example.com/e.jsonl"),
    ("model", "https://carol:SECRETM@example.com/m.gguf", ("carol", "SECRETM"), "https://example.com/m.gguf"),
    ("chat_template", "https://dave:SECRETC@example.com/t.jinja?sig=SECRETS", ("SECRETC", "SECRETS"),
     "https://example.com/t.jinja"),
    ("resume_from_checkpoint", "s3://erin:SECRETR@bucket/ck/step-3", ("erin", "SECRETR"), "s3://bucket/ck/step-3"),
    ("output_dir", "s3://AKIAEXAMPLEKEY:SECRETO@bucket/run", ("AKIAEXAMPLEKEY", "SECRETO"), "s3://bucket/run"),
]


@pytest.mark.parametrize("key,url,secrets,shown", URL_CASES)
def test_a_url_where_a_path_is_expected_is_refused_without_its_credentials(layout, capsys, key, url, secrets,
                                                                            shown):
    base = {"dataset": "d.jsonl", "output_dir": "run", "seed": "1"}
    base.pop(key, None)
    lines = "".join(f"{k}: {v}\n" for k, v in list(base.items())[:2])
    cfg = write(layout / "cfg" / "config.yaml", lines)
    in_file = write(layout / "cfg" / "c2.yaml", f"{lines}{key}: '{url}'\n")
    for message, where in ((_refusal(cfg, [f"{key}={url}"]), f"the override {key}={shown}: "),
                           (_refusal(in_file), f"{in_file}:3: ")):
        assert message.startswith(f"{where}`{key}` does not read URLs ({shown}); it takes "), message
        assert "only mirror_to takes a URL" in message
        assert not any(s in message for s in secrets), message
    assert cli.main(["train", str(cfg), f"{key}={url}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"`{key}` does not read URLs" in err
    assert not any(s in err for s in secrets), err


def test_a_url_in_a_dataset_list_entry_is_refused_by_its_index(layout):
    cfg = write(layout / "cfg" / "config.yaml", "output_dir: run\ndataset:\n  - a.jsonl\n"
                "  - path: 'hf://datasets/me/d?token=SECRETL'\n    weight: 2\n")
    message = _refusal(cfg)
    assert message.startswith(f"{cfg}:2: `dataset[1]` does not read URLs (hf://datasets/me/d)"), message
    assert "SECRETL" not in message


def test_no_config_error_repeats_a_url_secret_whatever_the_path_to_it(layout):
    """Messages that quote a URL some other way (as a key, or a config file path) are scrubbed too."""
    cfg = write(layout / "cfg" / "config.yaml", "dataset: d.jsonl\noutput_dir: run\n")
    as_key = _refusal(cfg, ["https://frank:SECRETK@example.com/x=1"])
    assert "SECRETK" not in as_key and "frank" not in as_key and "is not a key" in as_key, as_key
    as_file = _refusal("https://gina:SECRETF@example.com/c.yaml")
    assert as_file == "https://example.com/c.yaml: the config file must be a local file, not a URL; download it first"
    mirror = _refusal(cfg, ["mirror_to=https://hank:SECRETW@example.com/runs"])
    assert "SECRETW" not in mirror and "credentials" in mirror


def test_urls_are_never_joined_onto_a_folder(layout):
    from relaytune.config.paths import resolve_value
    for key in ("dataset", "eval_dataset", "model", "chat_template", "resume_from_checkpoint", "output_dir"):
        assert resolve_value(key, "https://example.com/a/b.jsonl", layout) == "https://example.com/a/b.jsonl"
    assert resolve_value("mirror_to", "s3://bucket/x", layout) == "s3://bucket/x"
    assert resolve_value("dataset", "C://data/x.jsonl", layout) != "C://data/x.jsonl", "a drive, not a scheme"
