"""`relaytune compare`: same prompts through base and checkpoints, deterministic, scored, reported."""

from __future__ import annotations

import json

import pytest
from support.read_only import files, make_read_only
from support.trained_run import copy_run, finished_run, one_thread

from relaytune.cli import main
from relaytune.commands.compare import Comparison, Decoding, Prompt, compare_run, read_prompts, score, side_by_side
from relaytune.errors import UserError


@pytest.fixture
def run(tmp_path_factory, tiny_model, tmp_path):
    return copy_run(finished_run(tmp_path_factory, tiny_model), tmp_path / "run")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "3 plus 4", "reference": "7"}, {"prompt": "hello"},
            {"messages": [{"role": "user", "content": "2 plus 2"}, {"role": "assistant", "content": "4"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _body(report):
    return [ln for ln in report.read_text().splitlines() if not ln.startswith("- generated:")]


@pytest.mark.parametrize("decoding", [Decoding(max_new_tokens=6),
                                      Decoding(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7)],
                         ids=["greedy", "sampling"])
def test_compare_is_deterministic_across_two_runs(run, prompts, tmp_path, decoding):
    with one_thread():
        a = compare_run(run, prompts, "step-4,final", decoding, tmp_path / "a.md")
        b = compare_run(run, prompts, "step-4,final", decoding, tmp_path / "b.md")
    assert list(a.outputs) == ["base", "step-4", "final"]
    assert a.outputs == b.outputs
    assert _body(a.report) == _body(b.report)
    if not decoding.greedy:  # sampling from a random model gives visible text to compare
        assert any(o.strip() for outs in a.outputs.values() for o in outs)
    text = a.report.read_text()
    for setting in ("max_new_tokens | 6", f"seed | {decoding.seed}", "repetition_penalty | 1.0",
                    "greedy" if decoding.greedy else "temperature | 1.0"):
        assert setting in text
    assert "## Scores" in text and "exact match" in text  # two rows carry a reference


def test_compare_cli_prints_side_by_side_and_report_path(run, prompts, capsys):
    with one_thread():
        code = main(["compare", str(run), "--prompts", str(prompts), "--checkpoints", "final",
                     "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0
    report = out.strip().splitlines()[-1].removeprefix("report: ")
    assert report.endswith(".md") and (run / report.rsplit("/", 1)[-1]).is_file()
    assert "base" in out and "final" in out and "[1] 3 plus 4" in out


def test_read_prompts_formats(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first question\n\nsecond one\n")
    assert [p.text for p in read_prompts(txt)] == ["first question", "second one"]
    js = tmp_path / "p.jsonl"
    chat = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "r"}]}
    js.write_text(json.dumps({"prompt": "q", "system": "be brief", "reference": "a"}) + "\n" + json.dumps(chat) + "\n")
    p1, p2 = read_prompts(js)
    assert p1.messages[0] == {"role": "system", "content": "be brief"} and p1.reference == "a"
    assert p2.messages == [{"role": "user", "content": "u"}] and p2.reference == "r"  # the answer is the reference
    js.write_text(json.dumps({"question": "no prompt key"}) + "\n")
    with pytest.raises(UserError, match="p.jsonl:1"):
        read_prompts(js)


def test_scoring_and_narrow_terminal():
    prompts = [Prompt([{"role": "user", "content": "q1"}], "Paris"), Prompt([{"role": "user", "content": "q2"}], "7"),
               Prompt([{"role": "user", "content": "q3"}])]
    outputs = {"base": ["paris.", "It is 7", "x"], "final": ["The capital is Paris", "8", "y"]}
    s = score(prompts, outputs)
    assert s["base"] == {"exact": 0.5, "contains": 1.0, "n": 2}
    assert s["final"] == {"exact": 0.0, "contains": 0.5, "n": 2}
    view = side_by_side(Comparison(prompts, outputs, s), width=30)  # too narrow for columns: stacked
    assert "--- base" in view and "--- final" in view
    wide = side_by_side(Comparison(prompts, outputs, s), width=120)
    assert " | " in wide


@pytest.fixture
def no_generation(monkeypatch):
    """Loading the model is where generation begins: a refusal must come before it."""
    from relaytune.commands import compare

    def refuse(cfg):
        raise AssertionError("the model was loaded: the refusal came after generation began")

    monkeypatch.setattr(compare, "load_adapter_slot", refuse)


def test_bad_prompts_or_report_are_refused_before_generating(run, prompts, tmp_path, capsys, no_generation):
    utf16 = tmp_path / "p16.txt"
    utf16.write_bytes("hello\n".encode("utf-16"))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"one\ntwo\ncaf\xe9\n")
    (tmp_path / "a_file").write_text("x")
    step4 = run / "checkpoints" / "step-4"
    before = files(step4)
    cases = [([str(run), "--prompts", str(utf16)], f"{utf16}:1: not UTF-8 text (byte 0xff at offset 0); "
                                                   "it looks like UTF-16"),
             ([str(run), "--prompts", str(latin)], f"{latin}:3: not UTF-8 text (byte 0xe9 at offset 11)"),
             ([str(run), "--prompts", str(prompts), "--report", str(tmp_path)], f"--report {tmp_path}: "
                                                                                f"{tmp_path} is a folder"),
             ([str(run), "--prompts", str(prompts), "--report", str(tmp_path / "a_file" / "r.md")],
              f"{tmp_path / 'a_file'} is a file, not a folder"),
             ([str(run), "--prompts", str(prompts), "--report", str(step4 / "r.md")],
              f"{step4} is a committed adapter folder"),
             ([str(step4), "--prompts", str(prompts)],
              f"is checkpoint step-4 of the run in {run}, not a run folder; use `relaytune compare {run} "
              "--checkpoints step-4`"),
             ([str(run / "final"), "--prompts", str(prompts)], "is the final adapter (final/) of the run in")]
    for args, says in cases:
        assert main(["compare", *args]) == 2, args
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    assert files(step4) == before


def test_read_prompts_drops_a_utf8_byte_order_mark(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9"}).encode() + b"\n")
    assert [p.text for p in read_prompts(path)] == ["caf\u00e9"]


def test_an_unwritable_run_folder_keeps_the_results(run, prompts, capsys, monkeypatch):
    """Kaggle's /kaggle/input is read-only: the generated answers are printed, the report skipped with a warning."""
    make_read_only(run, monkeypatch)
    before = files(run)
    try:
        with one_thread():
            code = main(["compare", str(run), "--prompts", str(prompts), "--checkpoints", "final",
                         "--max-new-tokens", "4"])
    finally:
        run.chmod(0o755)
    out, err = capsys.readouterr()
    assert code == 0
    assert "[1] 3 plus 4" in out and "final" in out and out.strip().endswith("report: not written (see the warning "
                                                                             "above)")
    assert "the results are only printed" in err and "Traceback" not in err
    assert files(run) == before
