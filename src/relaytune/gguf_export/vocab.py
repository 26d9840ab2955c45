"""The tokenizer as GGUF metadata: vocabulary, merges or scores, special ids, chat template.

Two tokenizer kinds cover the supported families:
  - byte-level BPE (SmolLM2, Llama 3, Qwen2, Mistral Nemo): `tokenizer.ggml.model = gpt2`,
    the tokens as byte-level strings plus the merges, and `tokenizer.ggml.pre` naming the
    pre-tokenizer regex that llama.cpp must apply before the merges;
  - BPE with byte fallback, converted from SentencePiece (Llama 2, Mistral 7B):
    `tokenizer.ggml.model = llama`, where llama.cpp merges the pair whose result has the
    highest score, so a token's score is minus the rank of the merge that makes it.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import gguf

from relaytune.errors import UserError

T = gguf.TokenType
# llama.cpp names a pre-tokenizer by the sha256 of how it tokenizes this text (from its
# convert_hf_to_gguf_update.py); a hash match proves the same splitting, whatever the JSON says.
CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated)'
    ' ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁'
    ' ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!'
    "!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D"
    " you like some tea? We'Ve a'lL"
)
KNOWN_HASHES = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/SmolLM2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2/2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3 vocab
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # GPT-2
}
# The same pre-tokenizers recognised from tokenizer.json, for a vocabulary of one's own.
LETTERS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
TAIL = "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
SPLIT_REGEXES = {LETTERS + "\\p{N}{1,3}" + TAIL: "llama-bpe", LETTERS + "\\p{N}" + TAIL: "qwen2"}


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config, pre: str | None = None) -> None:
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no tokenizer.json; GGUF export needs the fast tokenizer "
                        "files beside the weights")
    spec = json.loads(path.read_text(encoding="utf-8"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    n_vocab = config.vocab_size
    if max(tok.get_vocab().values()) >= n_vocab:
        raise UserError(f"the tokenizer in {model_dir} has ids up to {max(tok.get_vocab().values())} but the "
                        f"model's embedding has only {n_vocab} rows; resize the embeddings before exporting")
    if spec["model"].get("type") == "BPE" and spec["model"].get("byte_fallback"):
        _add_sentencepiece_style(writer, spec, tok, n_vocab)
    elif spec["model"].get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        _add_byte_level(writer, model_dir, tok, n_vocab, pre or pre_tokenizer_name(tok, spec))
    else:
        raise UserError(f"GGUF export: the tokenizer in {model_dir} is neither byte-level BPE nor "
                        "BPE with byte fallback, the two kinds llama.cpp reads for these families")
    _add_special_tokens(writer, tok, config)
    template = tok.chat_template
    if isinstance(template, dict):  # several named templates (tool use, RAG)
        template = [{"name": k, "template": v} for k, v in template.items()]
    if template:
        writer.add_chat_template(template)


def pre_tokenizer_name(tok, spec: dict) -> str:
    """llama.cpp's name for the pre-tokenizer: by the check-text hash, else by its structure."""
    digest = sha256(str(tok.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in KNOWN_HASHES:
        return KNOWN_HASHES[digest]
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True) and not parts[0].get("add_prefix_space"):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") \
            and parts[1].get("use_regex", True) and not parts[1].get("add_prefix_space"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        name = SPLIT_REGEXES.get((parts[0].get("pattern") or {}).get("Regex", ""))
        if name:
            return name
    raise UserError(
        "GGUF export: llama.cpp has no known pre-tokenizer matching this tokenizer "
        f"({json.dumps(pre)[:300]}); pass tokenizer_pre= with the llama.cpp name if you know it")


def _add_byte_level(writer, model_dir: Path, tok, n_vocab: int, pre: str) -> None:
    tokens, types = _tokens_and_types(tok, n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).merges
    if not merges:
        raise UserError(f"{model_dir}/tokenizer.json has no BPE merges")
    writer.add_token_merges(merges)


def _tokens_and_types(tok, n_vocab: int) -> tuple[list[str], list[int]]:
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:  # the embedding matrix is padded past the tokenizer (Qwen2.5)
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(T.CONTROL if added[i].special else T.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(T.NORMAL)
    return tokens, types


def _add_sentencepiece_style(writer, spec: dict, tok, n_vocab: int) -> None:
    tokens, types = _tokens_and_types(tok, n_vocab)
    rank: dict[str, int] = {}
    for r, merge in enumerate(spec["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, r)
    unk = spec["model"].get("unk_token")
    scores = []
    for i, text in enumerate(tokens):
        if types[i] == T.NORMAL and text.startswith("<0x") and text.endswith(">") and len(text) == 6:
            types[i] = T.BYTE
        elif text == unk:
            types[i] = T.UNKNOWN
        scores.append(-float(rank[text]) if text in rank else 0.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_prepends_space(spec))


def _prepends_space(spec: dict) -> bool:
    """Whether the text gets a leading '▁' before the merges (Llama 2 / Mistral: yes)."""
    def walk(node):
        if isinstance(node, dict):
            yield node
            for key in ("normalizers", "pretokenizers"):
                yield from (n for child in node.get(key) or [] for n in walk(child))
    for node in [*walk(spec.get("normalizer")), *walk(spec.get("pre_tokenizer"))]:
        if node.get("type") == "Prepend" and node.get("prepend") == "\u2581":
            return True
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never" \
                and node.get("add_prefix_space", True):
            return True
    return False


def _add_special_tokens(writer, tok, config) -> None:
    """Special ids from the tokenizer (config.json as fallback), and whether encoding adds BOS/EOS,
    observed rather than guessed so llama.cpp prepends exactly what transformers does."""
    def first(value):
        return value[0] if isinstance(value, (list, tuple)) else value

    ids = {kind: getattr(tok, f"{kind}_token_id") for kind in ("bos", "eos", "unk", "pad")}
    ids = {kind: first(getattr(config, f"{kind}_token_id", None)) if value is None else value
           for kind, value in ids.items()}
    for kind, value in ids.items():
        if value is not None:
            getattr(writer, f"add_{kind}_token_id")(int(value))
    probe = tok("a")["input_ids"]
    writer.add_add_bos_token(bool(probe) and ids["bos"] is not None and probe[0] == ids["bos"])
    writer.add_add_eos_token(bool(probe) and ids["eos"] is not None and probe[-1] == ids["eos"])
