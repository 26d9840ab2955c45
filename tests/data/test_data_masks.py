"""Loss masks, exactly: which token positions carry loss for each data shape and template.

Labels must equal input_ids on the target tokens and be IGNORE elsewhere. For chat rows the
targets are the assistant contents plus the end-of-turn marker that closes each assistant
turn (`<|im_end|>` for the tiny ChatML tokenizer of relaytune.tiny), as
`tokenizer.apply_chat_template` renders them; an independent oracle (transformers' own
assistant mask from {% generation %} tags) checks the positions. Also: multi-turn with
system prompts, named and file templates, conversational prompt/completion, and through the
pipeline: truncation counts, and bad rows quarantined with file:line (exit 2 above 1%).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import chat_rows, write_jsonl
from row_tokens import tokenize

from relaytune import cli
from relaytune.config.schema import TrainConfig
from relaytune.data import IGNORE, prepare_data
from relaytune.data.formats import Fields, RawRow, normalise, parse
from relaytune.data.templates import NAMED, Renderer, resolve
from relaytune.data.tokenize import tokenize_samples
from relaytune.errors import UserError
from relaytune.tiny import CHATML, make_tokenizer

END = "<|im_end|>"
CONVO = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is 2 plus 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and times 2?"},
    {"role": "assistant", "content": "10, the answer"},
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def encode(tok, sample: dict, train_on_inputs: bool = False):
    ids, labels = tokenize(normalise(RawRow("test:1", sample)), tok, train_on_inputs)
    assert len(ids) == len(labels)
    return list(ids), list(labels)


def target_runs(tok, ids, labels) -> list[str]:
    """Decoded runs of consecutive target positions; checks labels == ids there."""
    runs, current = [], []
    for i, (t, lab) in enumerate(zip(ids, labels)):
        if lab == IGNORE:
            if current:
                runs.append(current)
                current = []
            continue
        assert lab == t, f"position {i}: label {lab} is not the input id {t}"
        current.append(t)
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_plain_text_all_targets_plus_eos(tok):
    ids, labels = encode(tok, {"text": "the quick brown fox jumps"})
    assert ids == list(tok("the quick brown fox jumps")["input_ids"]) + [tok.eos_token_id]
    assert labels == ids
    assert tok.decode(ids) == "the quick brown fox jumps" + END


def test_prompt_completion_masks_the_prompt(tok):
    prompt, completion = "what is the capital of france?", " paris."
    ids, labels = encode(tok, {"prompt": prompt, "completion": completion})
    p = list(tok(prompt)["input_ids"])
    c = list(tok(completion, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    assert ids == p + c
    assert labels == [IGNORE] * len(p) + c
    assert target_runs(tok, ids, labels) == [completion + END]


def test_alpaca_becomes_chat(tok):
    sample = {"instruction": "Translate to JSON", "input": "name ada", "output": '{"name": "ada"}'}
    assert normalise(RawRow("x:1", sample)) == {"messages": [
        {"role": "user", "content": "Translate to JSON\n\nname ada"},
        {"role": "assistant", "content": '{"name": "ada"}'}]}
    ids, labels = encode(tok, sample)
    assert ids == chat_ids(tok, normalise(RawRow("x:1", sample))["messages"])
    assert target_runs(tok, ids, labels) == ['{"name": "ada"}' + END]
    assert labels[-1] == IGNORE and tok.decode(ids[-1:]) == "\n"  # the newline after <|im_end|>


def test_alpaca_with_system(tok):
    sample = {"system": "be brief", "instruction": "2 plus 2", "output": "4"}
    ids, labels = encode(tok, sample)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 plus 2"},
                {"role": "assistant", "content": "4"}]
    assert ids == chat_ids(tok, messages)
    assert target_runs(tok, ids, labels) == ["4" + END]


MESSAGES_SINGLE = [{"role": "system", "content": "you answer sums"},
                   {"role": "user", "content": "3 plus 4"},
                   {"role": "assistant", "content": "7"}]
MESSAGES_MULTI = [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hello world"},
                  {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "what is the capital of france?"},
                  {"role": "assistant", "content": "the capital of france is paris."},
                  {"role": "user", "content": "2 plus 2"},
                  {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("messages", [MESSAGES_SINGLE, MESSAGES_MULTI], ids=["single", "multi"])
def test_openai_messages_targets_are_assistant_turns_with_im_end(tok, messages):
    ids, labels = encode(tok, {"messages": messages})
    assert ids == chat_ids(tok, messages)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == rendered
    expected = [m["content"] + END for m in messages if m["role"] == "assistant"]
    assert target_runs(tok, ids, labels) == expected
    # Everything else is masked: what is left over is exactly the rest of the rendering.
    masked = tok.decode([t for t, lab in zip(ids, labels) if lab == IGNORE])
    rest = rendered
    for piece in expected:
        rest = rest.replace(piece, "", 1)
    assert masked == rest
    # The system and user contents never carry loss.
    for m in messages:
        if m["role"] != "assistant":
            assert all(m["content"] not in run for run in target_runs(tok, ids, labels))


@pytest.mark.parametrize("sample", [
    {"text": "the quick brown fox"},
    {"prompt": "what is the capital of france?", "completion": " paris."},
    {"instruction": "Translate to JSON", "input": "name ada", "output": '{"name": "ada"}'},
    {"messages": MESSAGES_MULTI},
    {"messages": CONVO},
], ids=["text", "prompt_completion", "alpaca", "messages", "messages_with_system"])
def test_train_on_inputs_labels_everything(tok, sample):
    ids, labels = encode(tok, sample, train_on_inputs=True)
    assert labels == ids
    masked_ids, _ = encode(tok, sample)
    assert ids == masked_ids, "train_on_inputs changes the labels, never the tokens"


# --- templates -------------------------------------------------------------------------------

def test_multi_turn_with_system_exact_positions_match_transformers_oracle(tok):
    ids, labels = tokenize({"messages": CONVO}, tok)
    rendered = tok.apply_chat_template(CONVO, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert target_runs(tok, ids, labels) == ["5<|im_end|>", "10, the answer<|im_end|>"]
    # Oracle: the same template with {% generation %} around what the model should write.
    tagged = CHATML.replace(
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}")
    oracle = tok.apply_chat_template(CONVO, chat_template=tagged, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert oracle["input_ids"] == ids
    expected = [i if m else IGNORE for i, m in zip(ids, oracle["assistant_masks"])]
    assert labels == expected
    # The newline after <|im_end|> and the next header are not targets; <|im_end|> is.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [k for k, i in enumerate(ids) if i == im_end]
    assert [labels[k] != IGNORE for k in ends] == [False, False, True, False, True]
    assert all(labels[k + 1] == IGNORE for k in ends)  # the newline after it is not


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_templates_render_like_transformers_and_mask_replies(tok, name):
    template = resolve(name, tok)
    assert Renderer(template, tok).render(CONVO, False) == tok.apply_chat_template(
        CONVO, chat_template=NAMED[name], tokenize=False)
    ids, labels = tokenize({"messages": CONVO}, tok, template=name)
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "phi3": "<|end|>",
           "zephyr": "<|im_end|>", "mistral": "<|im_end|>"}[name]  # zephyr/mistral end with eos
    assert target_runs(tok, ids, labels) == ["5" + end, "10, the answer" + end]


def test_jinja_file_template_and_its_syntax_errors(tok, tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, labels = tokenize({"messages": CONVO[1:3]}, tok, template=str(good))
    assert target_runs(tok, ids, labels) == ["5</s>"]
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}\n{{ m['content'] }")
    with pytest.raises(UserError, match=r"bad\.jinja:\d+"):
        resolve(str(bad), tok)
    with pytest.raises(UserError, match="neither a template name"):
        resolve("no-such-template", tok)


def test_plain_format_for_a_tokenizer_without_template(tok):
    plain = make_tokenizer()
    plain.chat_template = None
    ids, labels = tokenize({"messages": CONVO[1:3]}, plain)
    assert target_runs(plain, ids, labels) == ["5\n\n<|im_end|>"]
    assert plain.decode(ids).startswith("### User:\nwhat is 2 plus 3?\n\n### Assistant:\n")


def test_prompt_completion_and_text(tok):
    ids, labels = tokenize({"prompt": "Q: 2+3=", "completion": " 5"}, tok)
    assert target_runs(tok, ids, labels) == [" 5<|im_end|>"]
    ids, labels = tokenize({"text": "hello world"}, tok)
    assert labels == ids and ids[-1] == tok.eos_token_id


def test_conversational_prompt_completion_targets_only_the_completion(tok):
    row = RawRow("x:1", {"prompt": CONVO[:4], "completion": [{"role": "assistant", "content": "10"}]})
    kind, sample = parse(row, Fields())
    assert kind == "prompt_completion" and sample["train"] == [False, False, False, False, True]
    ids, labels = tokenize(sample, tok)
    assert target_runs(tok, ids, labels) == ["10<|im_end|>"]


def test_template_that_refuses_a_conversation_is_a_bad_row(tok, tmp_path):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}"
                      "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (res,) = tokenize_samples([{"messages": CONVO}], tok, resolve(str(strict), tok), False)
    assert "must start with user" in str(res)


def test_template_that_rewrites_earlier_turns_falls_back_to_the_reply_text(tok):
    # Like reasoning templates that drop earlier assistant turns' text: not prefix-stable.
    tmpl = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
            "<a>[old]</a>{% else %}<{{ m['role'] }}>{{ m['content'] }}</x>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok2 = make_tokenizer()
    tok2.chat_template = tmpl
    with pytest.raises(Exception, match="drops this assistant turn"):
        tokenize({"messages": CONVO}, tok2)


def test_real_smollm2_template_with_default_system_prompt():
    """The built-in model's own tokenizer and chat template, read from the GGUF that setup installs, so
    that a fresh machine runs it too (not from the converted model's cache, which only a run makes)."""
    from transformers import AutoTokenizer

    from relaytune.builtin import gguf_path

    gguf = gguf_path()
    real = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    convo = CONVO[1:]  # no system: the template inserts its own
    ids, labels = tokenize({"messages": convo}, real)
    assert ids == real.apply_chat_template(convo, tokenize=True, return_dict=True)["input_ids"]
    assert target_runs(real, ids, labels) == ["5<|im_end|>", "10, the answer<|im_end|>"]


# --- through the pipeline: prepare_data ------------------------------------------------------

def config(tmp_path: Path, data: Path, **kw) -> TrainConfig:
    return TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), **kw)


def test_prepare_data_gives_the_same_masks(tmp_path, tok):
    rows = [{"messages": MESSAGES_MULTI}, {"text": "hello world"},
            {"prompt": "0 1 2", "completion": " 3 4"}]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    prepared = prepare_data(config(tmp_path, data), tok)
    assert len(prepared.train) == 3
    for row, got in zip(rows, prepared.train):
        ids, labels = encode(tok, row)
        assert got.input_ids.tolist() == ids
        assert got.labels.tolist() == labels
    assert not (tmp_path / "run" / "quarantine.jsonl").exists()


def test_truncation_is_counted_and_keeps_the_prefix(tmp_path, tok, capsys):
    texts = ["the quick brown fox jumps over the lazy dog", "hello world",
             "0 1 2 3 4 5 6 7 8 9 10", "the capital of france is paris."]
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    full = [encode(tok, {"text": t})[0] for t in texts]
    limit = 6
    longer = sum(len(f) > limit for f in full)
    assert 0 < longer < len(texts)
    prepared = prepare_data(config(tmp_path, data, max_seq_length=limit), tok)
    assert prepared.stats["truncated"] == longer
    assert f"{longer} of {len(texts)} rows were longer than max_seq_length={limit} and were truncated" \
        in capsys.readouterr().err
    assert [r.input_ids.tolist() for r in prepared.train] == [f[:limit] for f in full]
    assert [r.labels.tolist() for r in prepared.train] == [f[:limit] for f in full]


def test_row_left_without_targets_by_truncation_is_quarantined(tmp_path, tok):
    rows = [{"prompt": "the quick brown fox jumps over the lazy dog", "completion": " yes"}] + \
        [{"text": "hello"}] * 120
    data = write_jsonl(tmp_path / "pc.jsonl", rows)
    prepared = prepare_data(config(tmp_path, data, max_seq_length=5), tok)
    assert len(prepared.train) == 120
    lines = (tmp_path / "run" / "quarantine.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"where": f"{data}:1", "reason": "no target tokens left within max_seq_length=5"}]


def bad_data(path: Path, good: int) -> tuple[Path, list[dict]]:
    """`good` chat rows with three bad ones at lines 5, 11 and 21; returns the expected quarantine."""
    lines = [json.dumps(r) for r in chat_rows(good)]
    lines.insert(4, '{"messages": [{"role": "user", "content": "hi"}')  # line 5: not JSON
    lines.insert(10, json.dumps({"prompt_x": 1}))  # line 11: no known field
    lines.insert(20, json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "  "}]}))  # line 21
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, [
        {"where": f"{path}:5", "reason": "not valid JSON (Expecting ',' delimiter, column 1)"},
        {"where": f"{path}:11", "reason": "`messages` is missing"},
        {"where": f"{path}:21", "reason": "`messages[1]`: the assistant turn is empty"},
    ]


def read_quarantine(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "quarantine.jsonl").read_text(encoding="utf-8").splitlines()]


def test_bad_rows_below_limit_are_quarantined_and_skipped(tmp_path, tok, capsys):
    data, expected = bad_data(tmp_path / "data.jsonl", good=297)  # 3 of 300 rows: exactly 1%
    prepared = prepare_data(config(tmp_path, data), tok)
    assert len(prepared.train) == 297
    assert read_quarantine(tmp_path / "run") == expected
    err = capsys.readouterr().err
    assert "3 of 300 rows" in err and f"{data}:21" in err


def test_bad_rows_above_limit_exit_2_with_file_and_line(tmp_path, tiny_model, capsys):
    data, expected = bad_data(tmp_path / "data.jsonl", good=97)  # 3 of 100 rows: over 1%
    with pytest.raises(UserError):
        prepare_data(config(tmp_path, data), make_tokenizer())
    assert read_quarantine(tmp_path / "run") == expected
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model: {tiny_model}\ndataset: {data}\noutput_dir: {tmp_path / 'run'}\nmax_steps: 2\n")
    rc = cli.main(["train", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert "`dataset`: 3 of 100 rows are unusable" in err
    for item in expected:
        assert f"{item['where']}: {item['reason']}" in err
    assert f"All are listed in {tmp_path / 'run' / 'quarantine.jsonl'}" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert read_quarantine(tmp_path / "run") == expected
