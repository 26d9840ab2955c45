"""Loss masks for new shapes and templates: multi-turn with system prompts, named and file
templates, conversational prompt/completion, and an independent oracle (transformers'
own assistant mask from {% generation %} tags)."""

import os
from pathlib import Path

import pytest

from relaytune.data.prepare import IGNORE, tokenize
from relaytune.data.tokenize import tokenize_samples
from relaytune.errors import UserError
from relaytune.data.templates import NAMED, Renderer, resolve
from relaytune.tiny import CHATML, make_tokenizer

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


def runs(tok, ids, labels):
    """The decoded text of each contiguous run of target tokens."""
    out, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


def one(samples, tok, template=None, train_on_inputs=False):
    (res,) = tokenize_samples(samples, tok, resolve(template, tok), train_on_inputs)
    return res[0].tolist(), res[1].tolist()


def test_multi_turn_with_system_exact_positions_match_transformers_oracle(tok):
    ids, labels = tokenize({"messages": CONVO}, tok)
    rendered = tok.apply_chat_template(CONVO, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert runs(tok, ids, labels) == ["5<|im_end|>", "10, the answer<|im_end|>"]
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


def test_train_on_inputs_learns_everything(tok):
    ids, labels = tokenize({"messages": CONVO}, tok, train_on_inputs=True)
    assert labels == ids


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_templates_render_like_transformers_and_mask_replies(tok, name):
    template = resolve(name, tok)
    assert Renderer(template, tok).render(CONVO, False) == tok.apply_chat_template(
        CONVO, chat_template=NAMED[name], tokenize=False)
    ids, labels = one([{"messages": CONVO}], tok, name)
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "phi3": "<|end|>",
           "zephyr": "<|im_end|>", "mistral": "<|im_end|>"}[name]  # zephyr/mistral end with eos
    assert runs(tok, ids, labels) == ["5" + end, "10, the answer" + end]


def test_jinja_file_template_and_its_syntax_errors(tok, tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, labels = one([{"messages": CONVO[1:3]}], tok, str(good))
    assert runs(tok, ids, labels) == ["5</s>"]
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
    assert runs(plain, ids, labels) == ["5\n\n<|im_end|>"]
    assert plain.decode(ids).startswith("### User:\nwhat is 2 plus 3?\n\n### Assistant:\n")


def test_prompt_completion_and_text(tok):
    ids, labels = tokenize({"prompt": "Q: 2+3=", "completion": " 5"}, tok)
    assert runs(tok, ids, labels) == [" 5<|im_end|>"]
    ids, labels = tokenize({"text": "hello world"}, tok)
    assert labels == ids and ids[-1] == tok.eos_token_id


def test_conversational_prompt_completion_targets_only_the_completion(tok):
    from relaytune.data.formats import Fields, Row, parse

    row = Row("x:1", {"prompt": CONVO[:4], "completion": [{"role": "assistant", "content": "10"}]})
    kind, sample = parse(row, Fields())
    assert kind == "prompt_completion" and sample["train"] == [False, False, False, False, True]
    ids, labels = one([sample], tok)
    assert runs(tok, ids, labels) == ["10<|im_end|>"]


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


@pytest.mark.skipif(not (Path(os.path.expanduser("~/.cache/relaytune/SmolLM2-135M-Instruct")) /
                         "tokenizer.json").is_file(), reason="SmolLM2 tokenizer not cached here")
def test_real_smollm2_template_with_default_system_prompt():
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(os.path.expanduser("~/.cache/relaytune/SmolLM2-135M-Instruct"))
    convo = CONVO[1:]  # no system: the template inserts its own
    ids, labels = tokenize({"messages": convo}, real)
    assert ids == real.apply_chat_template(convo, tokenize=True, return_dict=True)["input_ids"]
    assert runs(real, ids, labels) == ["5<|im_end|>", "10, the answer<|im_end|>"]
