"""Tiny random models with a real tokenizer and chat template, built offline.

Tests, benchmarks and smoke runs use these instead of downloading anything:
`make_tiny_model(folder)` writes a from_pretrained-loadable folder in well under
a second. `make_tokenizer()` builds a byte-level BPE with ChatML specials.
"""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? the capital of france is paris.",
    "user assistant system question answer reply hello world",
    "0 1 2 3 4 5 6 7 8 9 10 plus minus times equals",
    "Translate to JSON: name age city. {\"name\": \"ada\", \"age\": 36}",
]


def make_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def make_tiny_model(folder: str | Path, arch: str = "llama", hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
                    **config_overrides) -> Path:
    """Write a random-init causal LM plus tokenizer to `folder`; returns the folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    tok = make_tokenizer()
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        **{"max_position_embeddings": 2048, "tie_word_embeddings": True, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
