"""The tokenization cache: a resume does not tokenize (counted by tokenizer calls, not by a
clock); a change that matters does, and says why; a damaged cache is rebuilt."""

import json

import pytest
from conftest import chat_rows, write_jsonl

from relaytune import faults
from relaytune.atomic import TMP_PREFIX
from relaytune.config.loader import load_config
from relaytune.data import prepare_data
from relaytune.tiny import make_tokenizer


class Counting:
    """A tokenizer that counts how often it is asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(folder)
    return folder


def session(tok_dir):
    """A tokenizer as a new session loads it: a fresh object from the saved files."""
    from transformers import AutoTokenizer

    return Counting(AutoTokenizer.from_pretrained(tok_dir))


def run(tmp_path, tok, **settings):
    cfg = load_config({"dataset": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "run"),
                       **settings})
    return prepare_data(cfg, tok)


def test_resume_hits_the_cache_and_settings_after_tokenizing_do_not_miss(tmp_path, tok_dir, capsys):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(60))
    cold = session(tok_dir)
    first = run(tmp_path, cold, packing=True, max_seq_length=64)
    assert cold.calls > 0
    warm = session(tok_dir)
    second = run(tmp_path, warm, packing=True, max_seq_length=64)
    assert warm.calls == 0
    assert "loaded from the cache" in capsys.readouterr().err
    assert second.fingerprint == first.fingerprint
    assert [r.input_ids.tolist() for r in second.train] == [r.input_ids.tolist() for r in first.train]
    assert [r.segments for r in second.train] == [r.segments for r in first.train]
    # Truncation, packing, split and seed are applied after the cache: no tokenizing for them.
    again = session(tok_dir)
    other = run(tmp_path, again, packing=False, max_seq_length=16, seed=3, val_set_size=0.1)
    assert again.calls == 0 and other.fingerprint != first.fingerprint
    assert 0 < other.stats["truncated"] < 60 and other.stats["eval_rows"] == 6


@pytest.mark.parametrize("change,why", [
    ("data", "content changed"),
    ("train_on_inputs", "train_on_inputs False -> True"),
    ("chat_template", "the chat template changed (tokenizer -> llama3)"),
    ("tokenizer", "the tokenizer changed"),
    ("columns", "columns"),
])
def test_a_change_that_matters_tokenizes_again_and_says_why(tmp_path, tok_dir, capsys, change, why):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(20))
    run(tmp_path, session(tok_dir))
    capsys.readouterr()
    tok, settings = session(tok_dir), {}
    if change == "data":
        write_jsonl(tmp_path / "data.jsonl", chat_rows(20, seed=1))
    elif change == "tokenizer":
        tok.tok.add_tokens(["<new>"])
    elif change == "columns":
        settings["dataset_columns"] = {"messages": "messages"}
    else:
        settings[change] = True if change == "train_on_inputs" else "llama3"
    run(tmp_path, tok, **settings)
    assert tok.calls > 0
    assert why in capsys.readouterr().err


def test_moved_data_file_still_hits(tmp_path, tok_dir):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(10))
    run(tmp_path, session(tok_dir))
    (tmp_path / "data.jsonl").rename(tmp_path / "moved.jsonl")
    tok = session(tok_dir)
    cfg = load_config({"dataset": str(tmp_path / "moved.jsonl"), "output_dir": str(tmp_path / "run")})
    prepare_data(cfg, tok)
    assert tok.calls == 0


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "manifest", "table_json"])
def test_a_damaged_cache_is_rebuilt(tmp_path, tok_dir, capsys, damage):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(30))
    first = run(tmp_path, session(tok_dir), packing=True, max_seq_length=48)
    (entry,) = (tmp_path / "run" / "data-cache").iterdir()
    tokens = entry / "tokens.safetensors"
    if damage == "flip_byte":
        data = bytearray(tokens.read_bytes())
        data[-3] ^= 0xFF
        tokens.write_bytes(bytes(data))
    elif damage == "truncate":
        tokens.write_bytes(tokens.read_bytes()[:100])
    elif damage == "manifest":
        (entry / "manifest.json").write_text("{not json")
    else:
        (entry / "table.json").write_text(json.dumps({"parts": {}}))
    capsys.readouterr()
    tok = session(tok_dir)
    second = run(tmp_path, tok, packing=True, max_seq_length=48)
    assert tok.calls > 0 and "damaged" in capsys.readouterr().err
    assert second.fingerprint == first.fingerprint
    warm = session(tok_dir)
    run(tmp_path, warm, packing=True, max_seq_length=48)
    assert warm.calls == 0  # the rebuilt entry is good


def test_unfinished_write_is_cleaned_and_old_entries_pruned(tmp_path, tok_dir):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(10))
    cache = tmp_path / "run" / "data-cache"
    (cache / f"{TMP_PREFIX}abc-123").mkdir(parents=True)  # as a kill mid-write leaves it
    for n in range(5):
        write_jsonl(tmp_path / "data.jsonl", chat_rows(10, seed=n))
        run(tmp_path, session(tok_dir))
    assert len(list(cache.iterdir())) == 3  # KEEP entries, no tmp folder left


def test_cache_can_be_turned_off(tmp_path, tok_dir):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(10))
    run(tmp_path, session(tok_dir), dataset_cache=False)
    assert not (tmp_path / "run" / "data-cache").exists()


def test_eval_data_does_not_change_the_training_fingerprint(tmp_path, tok_dir):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(20))
    write_jsonl(tmp_path / "eval.jsonl", chat_rows(5, seed=9))
    plain = run(tmp_path, session(tok_dir), packing=True)
    with_eval = run(tmp_path, session(tok_dir), packing=True, eval_dataset=str(tmp_path / "eval.jsonl"))
    assert len(with_eval.eval) == 1 and with_eval.fingerprint == plain.fingerprint  # 5 rows, packed
    split = run(tmp_path, session(tok_dir), packing=True, val_set_size=4)
    assert split.fingerprint != plain.fingerprint  # held-out rows leave training: another run


@pytest.mark.parametrize("point", ["cache:mid_file", "cache:before_rename"])
def test_a_failed_cache_write_leaves_nothing_behind_and_the_run_goes_on(tmp_path, tok_dir, capsys, point):
    write_jsonl(tmp_path / "data.jsonl", chat_rows(10))
    faults.reset({"RELAYTUNE_FAIL_AT": f"{point}:1:28"})  # a full disk at that step of the commit
    try:
        first = run(tmp_path, session(tok_dir))
    finally:
        faults.reset()
    assert "could not write the data cache" in capsys.readouterr().err
    assert not any((tmp_path / "run" / "data-cache").iterdir())  # no entry and no tmp folder
    cold = session(tok_dir)
    assert run(tmp_path, cold).fingerprint == first.fingerprint and cold.calls > 0
    warm = session(tok_dir)
    run(tmp_path, warm)
    assert warm.calls == 0
