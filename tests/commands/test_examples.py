"""examples/kaggle.ipynb can't rot: valid notebook JSON, every code cell compiles, the config cell's
YAML loads with relaytune's own loader, and the names it relies on (plot file, API) are the real ones."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, chat_rows, write_jsonl

from relaytune.config import load_config
from relaytune.run_dir import RunDir

KAGGLE = REPO / "examples" / "kaggle.ipynb"
WRITEFILE = "%%writefile config.yaml"


@pytest.fixture(scope="module")
def nb():
    notebook = nbformat.read(KAGGLE, as_version=4)
    nbformat.validate(notebook)
    return notebook


def code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def config_yaml(nb) -> str:
    cells = [s for s in code(nb) if s.startswith(WRITEFILE)]
    assert len(cells) == 1, f"one {WRITEFILE} cell expected"
    return cells[0].split("\n", 1)[1]


def test_every_code_cell_compiles(nb):
    assert nb.nbformat == 4 and nb.metadata.kernelspec.name == "python3"
    for source in code(nb):
        if source.startswith("%%"):
            assert source.startswith(WRITEFILE), f"unexpected cell magic: {source.splitlines()[0]}"
            continue
        python = "\n".join("" if line.lstrip().startswith(("!", "%")) else line for line in source.splitlines())
        ast.parse(python)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"


def test_the_cells_use_the_real_api_and_paths(nb):
    sources = "\n".join(code(nb))
    assert "!pip install -q relaytune" in sources
    assert 'relaytune.train("config.yaml")' in sources and "except StoppedEarly as e:" in sources
    assert "e.checkpoint" in sources
    assert "!relaytune status /kaggle/working/run" in sources
    plot = RunDir(Path("/kaggle/working/run")).plot
    assert f'"{plot}"' in sources, f"the plot cell must display {plot}, the file status writes"
    text = "\n".join(c.source for c in nb.cells)
    # No invented repository address: only the placeholder the user fills in.
    for url in re.findall(r"github\.com/\S+", text):
        assert "<org>" in url, url
    assert "resume_from_checkpoint: /kaggle/input/<your-notebook>/run" in text


@pytest.mark.parametrize("resume", [False, True], ids=["as-written", "resume-uncommented"])
def test_the_config_cell_loads(nb, tmp_path, resume):
    text = config_yaml(nb)
    if resume:
        text = re.sub(r"^# (resume_from_checkpoint:)", r"\1", text, flags=re.M)
    (tmp_path / "input" / "my-dataset").mkdir(parents=True)
    data = write_jsonl(tmp_path / "input" / "my-dataset" / "train.jsonl", chat_rows(4))
    # Kaggle's folders, moved under tmp_path: /kaggle/input -> tmp/input, /kaggle/working -> tmp/working
    text = text.replace("/kaggle/input/<your-notebook>/", f"{tmp_path}/input/your-notebook/")
    text = text.replace("/kaggle/input/", f"{tmp_path}/input/").replace("/kaggle/working/", f"{tmp_path}/working/")
    assert "/kaggle" not in text
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    cfg = load_config(path)
    assert cfg.dataset == str(data)
    assert cfg.output_dir == str(tmp_path / "working" / "run")
    assert cfg.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.load_in_4bit and cfg.time_limit == "11h30m"
    expected = str(tmp_path / "input" / "your-notebook" / "run") if resume else "auto"
    assert str(cfg.resume_from_checkpoint) == expected
    # the alternative the notebook offers for a first try loads as well
    assert load_config(path, {"model": "builtin:SmolLM2-135M-Instruct"}).model == "builtin:SmolLM2-135M-Instruct"
