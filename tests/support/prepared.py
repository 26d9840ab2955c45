"""Data prepared in-process as training prepares it, and the quarantine list it leaves."""

from __future__ import annotations

import json

from relaytune.config.loader import load_config
from relaytune.data import prepare_data


def prep(tmp_path, tok, path, **settings):
    cfg = load_config({"dataset": str(path), "output_dir": str(tmp_path / "run"), "dataset_cache": False,
                       **settings})
    return prepare_data(cfg, tok)


def quarantine(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "quarantine.jsonl").read_text().splitlines()]
