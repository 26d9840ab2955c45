"""GGUF export, checked by readers other than our writer: transformers' own GGUF loader
(weights, config and tokenizer rebuilt from the file) and gguf.GGUFReader (the raw keys,
tensor names, shapes and types). llama.cpp itself reads the same files in the slow
test_gguf_llamacpp.py.

Tolerances: the f16 export differs from the float32 source only by rounding each weight
to half precision; on these tiny models (logits of magnitude ~1) that moves logits by
about 3e-4, so 2e-3 is asserted, with the same greedy token at every position. q8_0
moves them by about 6e-3; 3e-2 is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.gguf_cases import fields

from relaytune.errors import UserError
from relaytune.gguf_export import write_gguf, write_modelfile

F16_TOL, Q8_TOL = 2e-3, 3e-2
PROMPTS = [  # shaped like the demo's held-out rows, through the chat template
    "Rewrite this date in ISO format (YYYY-MM-DD): 7 December 2013",
    "Convert the date to YYYY-MM-DD: 10 August 2001",
    "Write July 26, 2024 as an ISO 8601 date.",
    "what is the capital of france?",
    "Translate to JSON: name age city.",
]
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}")


# --- tiny models of each family ---------------------------------------------------------------

def qwen2_style_tokenizer():
    """relaytune.tiny's byte-level BPE, pre-tokenized with Qwen2's split regex as Qwen2.5's is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from relaytune.tiny import CHATML, CORPUS, SPECIALS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def spm_style_tokenizer():
    """A Llama 2 / Mistral 7B style tokenizer.json: BPE over '▁'-marked text with byte fallback,
    <unk> <s> </s> at ids 0-2 and the 256 byte tokens <0x00>..<0xFF> after them."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from relaytune.tiny import CORPUS

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer_tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for text, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = MISTRAL_TEMPLATE
    return fast


def tiny_folder(folder: Path, arch: str, tok, **overrides) -> Path:
    """relaytune.tiny.make_tiny_model's sizes, with a tokenizer of the family's own kind."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{
        "vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        **overrides})
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random biases, so a lost or misplaced bias shows in the logits
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """The conftest tiny llama exported as f16 and q8_0 (module-wide: each test only reads)."""
    out = tmp_path_factory.mktemp("gguf")
    return {t: write_gguf(tiny_model, out / f"tiny-{t}.gguf", t) for t in ("f16", "q8_0")}


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_same_model(source: Path, gguf_file: Path, tol: float, prompts=PROMPTS) -> float:
    """Load the GGUF with transformers' loader; its logits match the source's on the prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(source).eval()
    back = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).eval()
    tok = AutoTokenizer.from_pretrained(source)
    worst = 0.0
    for prompt in prompts:
        ids = chat_ids(tok, prompt)
        a, b = logits(src, ids), logits(back, ids)
        worst = max(worst, float(np.abs(a - b).max()))
        assert (a.argmax(-1) == b.argmax(-1)).all(), prompt
    assert worst < tol, f"{gguf_file.name}: logits differ by {worst:.2e} (tolerance {tol})"
    return worst


# --- llama (the conftest tiny model) -----------------------------------------------------------

def test_f16_and_q8_0_read_back_by_transformers_match_the_source_logits(tiny_model, exported):
    assert assert_same_model(tiny_model, exported["f16"], F16_TOL) < F16_TOL
    assert assert_same_model(tiny_model, exported["q8_0"], Q8_TOL) < Q8_TOL


def test_tokenizer_read_back_by_transformers_encodes_the_same_ids(tiny_model, exported):
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(tiny_model)
    back = AutoTokenizer.from_pretrained(exported["f16"].parent, gguf_file=exported["f16"].name)
    for prompt in PROMPTS + ["  spaces\n\nand {\"json\": 36} 1234567"]:
        assert back.encode(prompt) == src.encode(prompt), prompt


def test_metadata_and_tensors_as_gguf_reader_sees_them(tiny_model, exported):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    kv, reader = fields(exported["f16"])
    assert {k: kv[k] for k in (
        "general.architecture", "general.type", "general.name", "general.file_type", "llama.context_length",
        "llama.embedding_length", "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.vocab_size", "llama.rope.dimension_count",
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token")} == {
        "general.architecture": "llama", "general.type": "model", "general.name": tiny_model.name,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16), "llama.context_length": 2048,
        "llama.embedding_length": 64, "llama.block_count": 2, "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.vocab_size": len(tok),
        "llama.rope.dimension_count": 16, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": tok.bos_token_id, "tokenizer.ggml.eos_token_id": tok.eos_token_id,
        "tokenizer.ggml.add_bos_token": False}
    assert kv["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["tokenizer.chat_template"] == tok.chat_template
    assert len(kv["tokenizer.ggml.tokens"]) == len(kv["tokenizer.ggml.token_type"]) == len(tok)
    assert kv["tokenizer.ggml.tokens"][tok.convert_tokens_to_ids("<|im_end|>")] == "<|im_end|>"
    assert kv["tokenizer.ggml.token_type"][tok.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    assert len(kv["tokenizer.ggml.merges"]) > 100

    per_block = {"attn_norm": [64], "attn_q": [64, 64], "attn_k": [64, 32], "attn_v": [64, 32],
                 "attn_output": [64, 64], "ffn_norm": [64], "ffn_gate": [64, 128], "ffn_up": [64, 128],
                 "ffn_down": [128, 64]}
    expected = {"token_embd.weight": [64, len(tok)], "output_norm.weight": [64]}
    expected |= {f"blk.{b}.{n}.weight": s for b in range(2) for n, s in per_block.items()}
    got = {t.name: t for t in reader.tensors}
    assert {n: list(map(int, t.shape)) for n, t in got.items()} == expected  # tied: no output.weight
    assert {got[n].tensor_type.name for n in expected if "norm" in n} == {"F32"}
    assert {got[n].tensor_type.name for n in expected if "norm" not in n} == {"F16"}
    _, q8 = fields(exported["q8_0"])
    assert {t.tensor_type.name for t in q8.tensors if "norm" not in t.name} == {"Q8_0"}
    assert {t.tensor_type.name for t in q8.tensors if "norm" in t.name} == {"F32"}


def test_untied_output_and_llama3_rope_factors(tmp_path):
    """An untied head is written as output.weight; Llama 3.1's rope scaling becomes rope_freqs."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from relaytune.tiny import make_tokenizer

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = tiny_folder(tmp_path / "m", "llama", make_tokenizer(), tie_word_embeddings=False, rope_parameters=rope)
    kv, reader = fields(write_gguf(model, tmp_path / "m.gguf", "f16"))
    got = {t.name: t for t in reader.tensors}
    assert list(got["output.weight"].shape) == [64, kv["llama.vocab_size"]]
    config = AutoConfig.from_pretrained(model)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    # llama.cpp divides each frequency by its factor, giving back transformers' scaled frequencies.
    np.testing.assert_allclose(plain.numpy() / np.asarray(got["rope_freqs.weight"].data), scaled.numpy(), rtol=1e-6)
    assert kv["llama.rope.freq_base"] == pytest.approx(500000.0)


# --- qwen2, mistral ----------------------------------------------------------------------------

def test_qwen2_keeps_qkv_biases_unpermuted_and_names_its_pre_tokenizer(tmp_path):
    tok = qwen2_style_tokenizer()
    # Qwen2.5's embedding has rows past the tokenizer (151936 vs 151665); they become unused tokens.
    model = tiny_folder(tmp_path / "qwen", "qwen2", tok, vocab_size=len(tok) + 8)
    out = write_gguf(model, tmp_path / "qwen.gguf", "f16")
    kv, reader = fields(out)
    assert kv["tokenizer.ggml.tokens"][-1] == f"[PAD{len(tok) + 7}]"
    assert kv["tokenizer.ggml.token_type"][-8:] == [gguf.TokenType.UNUSED] * 8
    assert kv["general.architecture"] == "qwen2"
    assert kv["tokenizer.ggml.pre"] == "qwen2"
    assert kv["qwen2.block_count"] == 2 and kv["qwen2.attention.head_count_kv"] == 2
    biases = {t.name: list(map(int, t.shape)) for t in reader.tensors if t.name.endswith(".bias")}
    assert biases == {f"blk.{b}.attn_{x}.bias": [n] for b in range(2) for x, n in (("q", 64), ("k", 32), ("v", 32))}
    assert assert_same_model(model, out, F16_TOL) < F16_TOL


def test_mistral_with_a_sentencepiece_style_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    # Not named "mistral": transformers' GGUF loader then looks for a gguf-py "mistral" arch and fails.
    model = tiny_folder(tmp_path / "tiny-m", "mistral", spm_style_tokenizer())
    out = write_gguf(model, tmp_path / "tiny-m.gguf", "f16")
    kv, _ = fields(out)
    assert kv["general.architecture"] == "llama"  # llama.cpp runs Mistral as the llama graph
    assert kv["tokenizer.ggml.model"] == "llama"
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_space_prefix"] is True
    types, tokens = kv["tokenizer.ggml.token_type"], kv["tokenizer.ggml.tokens"]
    assert [types[i] for i in (0, 1, 2, 3, 258)] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
                                                     gguf.TokenType.CONTROL, gguf.TokenType.BYTE,
                                                     gguf.TokenType.BYTE]
    assert tokens[3] == "<0x00>" and len(kv["tokenizer.ggml.scores"]) == len(tokens)
    src = AutoTokenizer.from_pretrained(model)
    back = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    for text in PROMPTS + ["caf\u00e9 \u2705 unseen-word"]:
        assert back.encode(text) == src.encode(text), text
    assert assert_same_model(model, out, F16_TOL) < F16_TOL


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
RAW_BYTES = {**BYTE_LEVEL, "use_regex": False}


@pytest.mark.parametrize("pre, name", [
    (BYTE_LEVEL, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": QWEN2_SPLIT.replace(
        "\\p{N}|", "\\p{N}{1,3}|")}, "behavior": "Isolated"}, RAW_BYTES]}, "llama-bpe"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": QWEN2_SPLIT},
                                             "behavior": "Isolated"}, RAW_BYTES]}, "qwen2"),
    ({**BYTE_LEVEL, "add_prefix_space": True}, None),
])
def test_pre_tokenizer_recognised_from_tokenizer_json(pre, name):
    """Without a known check-text hash, llama.cpp's pre-tokenizer is recognised by structure, or refused."""
    from relaytune.gguf_export.vocab import pre_tokenizer_name
    from relaytune.tiny import make_tokenizer

    tok = make_tokenizer()  # its check-text hash matches none of llama.cpp's list
    if name is None:
        with pytest.raises(UserError, match="no known pre-tokenizer"):
            pre_tokenizer_name(tok, {"pre_tokenizer": pre})
    else:
        assert pre_tokenizer_name(tok, {"pre_tokenizer": pre}) == name


# --- refusals ----------------------------------------------------------------------------------

def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "gemma"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(UserError) as err:
        write_gguf(folder, tmp_path / "x.gguf", "f16")
    assert "'gemma2'" in str(err.value)
    assert all(name in str(err.value) for name in ("llama", "mistral", "qwen2"))
    assert not list(tmp_path.glob("*.gguf*")), "nothing is written for a refused model"


def test_an_unknown_type_is_refused(tiny_model, tmp_path):
    with pytest.raises(UserError, match="q3_k.*f32, f16, bf16, q8_0"):
        write_gguf(tiny_model, tmp_path / "x.gguf", "q3_k")


# --- Ollama Modelfile --------------------------------------------------------------------------

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_modelfile_for_chatml_with_its_default_system_prompt(tmp_path):
    path = write_modelfile(tmp_path / "model-f16.gguf", SMOLLM2_TEMPLATE, ["<|im_end|>"], tmp_path)
    text = path.read_text()
    assert path == tmp_path / "Modelfile"
    assert text.startswith("FROM ./model-f16.gguf\n")
    assert 'TEMPLATE """{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n' in text
    assert "{{- if eq .Role \"user\" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n" in text
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    assert text.endswith('PARAMETER stop "<|im_start|>"\nPARAMETER stop "<|im_end|>"\n')


def test_modelfile_for_llama3_mistral_and_an_unknown_template(tmp_path):
    llama3 = write_modelfile(tmp_path / "a.gguf", LLAMA3_TEMPLATE, ["<|eot_id|>"], tmp_path / "l3").read_text()
    assert llama3.startswith("FROM ./../a.gguf\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\n{{ .Content }}<|eot_id|>" in llama3
    assert "SYSTEM" not in llama3.replace(".System", "").replace("system<|end", "")
    assert 'PARAMETER stop "<|eot_id|>"' in llama3
    mistral = write_modelfile(tmp_path / "m.gguf", MISTRAL_TEMPLATE, ["</s>"], tmp_path).read_text()
    assert "[INST] {{ .Content }}[/INST]" in mistral and 'PARAMETER stop "</s>"' in mistral
    other = write_modelfile(tmp_path / "o.gguf", "{{ messages }}", ["<end>"], tmp_path).read_text()
    assert not any(line.startswith("TEMPLATE") for line in other.splitlines())
    assert "by hand" in other and other.endswith('PARAMETER stop "<end>"\n')
