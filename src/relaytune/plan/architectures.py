"""Model shapes the planner needs, and a shipped table of popular architectures' config.json values."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder layer: its module name, shape, and which tensor it reads."""

    name: str
    in_features: int
    out_features: int
    reads: str  # linears that read the same tensor share it: "attn_in", "attn_out", "mlp_in", "mlp_mid"


@dataclass(frozen=True)
class Architecture:
    """The config.json values that decide memory and compute."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    fused_qkv: bool = False  # Phi-3/4: one qkv_proj instead of q_proj, k_proj, v_proj
    fused_gate_up: bool = False  # Phi-3/4: one gate_up_proj instead of gate_proj, up_proj
    norms_per_layer: int = 2  # Gemma 2/3 have four RMSNorms per layer
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each query and key head
    logit_softcapping: bool = False
    # Modules loaded with the model that a text-only run never calls (Gemma 3 4B's vision tower):
    # (in, out, count) of their linear layers, plus their other parameters.
    extra_linears: tuple[tuple[int, int, int], ...] = ()
    extra_other_params: int = 0
    name: str = ""
    source: str = ""  # where these values came from, for the report
    notes: tuple[str, ...] = field(default=())

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_linears(self) -> list[Linear]:
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = ([Linear("qkv_proj", h, q + 2 * kv, "attn_in")] if self.fused_qkv else
                [Linear("q_proj", h, q, "attn_in"), Linear("k_proj", h, kv, "attn_in"),
                 Linear("v_proj", h, kv, "attn_in")])
        mlp = ([Linear("gate_up_proj", h, 2 * inter, "mlp_in")] if self.fused_gate_up else
               [Linear("gate_proj", h, inter, "mlp_in"), Linear("up_proj", h, inter, "mlp_in")])
        return attn + [Linear("o_proj", q, h, "attn_out")] + mlp + [Linear("down_proj", inter, h, "mlp_mid")]

    def linear_params(self) -> int:
        """Weights of every decoder linear layer (what bitsandbytes quantizes), plus any extra module's."""
        per_layer = sum(m.in_features * m.out_features for m in self.layer_linears())
        return per_layer * self.num_layers + sum(i * o * n for i, o, n in self.extra_linears)

    def embedding_params(self) -> int:
        """Input embeddings and output head; a tied head is the same tensor, counted once."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def other_params(self) -> int:
        """Norm weights, biases and the extra modules' non-linear parameters (kept in the compute dtype)."""
        h = self.hidden_size
        norms = self.num_layers * (self.norms_per_layer * h + (2 * self.head_dim if self.qk_norm else 0)) + h
        bias = self.num_layers * (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return norms + bias + self.extra_other_params

    def total_params(self) -> int:
        return self.linear_params() + self.embedding_params() + self.other_params()

    def describe(self) -> str:
        heads = f"{self.num_heads}/{self.num_kv_heads} heads of {self.head_dim}"
        tied = "tied embeddings" if self.tied_embeddings else "separate output head"
        return (f"{self.model_type}, {self.total_params() / 1e9:.2f} B parameters ({self.num_layers} layers, "
                f"hidden {self.hidden_size}, intermediate {self.intermediate_size}, {heads}, "
                f"vocab {self.vocab_size:,}, {tied})")


def _qwen2(h, inter, layers, heads, kv, vocab, tied):
    return dict(model_type="qwen2", hidden_size=h, intermediate_size=inter, num_layers=layers, num_heads=heads,
                num_kv_heads=kv, head_dim=h // heads, vocab_size=vocab, tied_embeddings=tied, qkv_bias=True)


def _llama(h, inter, layers, heads, kv, vocab, tied, model_type="llama"):
    return dict(model_type=model_type, hidden_size=h, intermediate_size=inter, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=h // heads, vocab_size=vocab, tied_embeddings=tied)


def _gemma(model_type, h, inter, layers, heads, kv, vocab, softcap, **extra):
    return dict(model_type=model_type, hidden_size=h, intermediate_size=inter, num_layers=layers,
                num_heads=heads, num_kv_heads=kv, head_dim=256, vocab_size=vocab, tied_embeddings=True,
                norms_per_layer=4, qk_norm=model_type.startswith("gemma3"), logit_softcapping=softcap, **extra)


def _phi3(h, inter, layers, heads, kv, vocab):
    return dict(model_type="phi3", hidden_size=h, intermediate_size=inter, num_layers=layers, num_heads=heads,
                num_kv_heads=kv, head_dim=h // heads, vocab_size=vocab, tied_embeddings=False, fused_qkv=True,
                fused_gate_up=True)


# Gemma 3 4B is a multimodal checkpoint: its SigLIP vision tower (27 layers, hidden 1152, MLP 4304) and
# projector load with it. Linear shapes as (in, out, count); the rest is patch and position embeddings.
_SIGLIP = dict(extra_linears=((1152, 1152, 4 * 27), (1152, 4304, 27), (4304, 1152, 27), (1152, 2560, 1)),
               extra_other_params=5_400_000,
               notes=("a multimodal checkpoint: its 0.42 B-parameter vision tower is loaded too and counted",))

# Values copied from each model's config.json on the Hugging Face Hub. The first id of each row is the
# canonical one; the others are the same architecture (instruct or re-released variants).
TABLE: dict[tuple[str, ...], dict] = {
    ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"): _qwen2(896, 4864, 24, 14, 2, 151936, True),
    ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"): _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"): _qwen2(2048, 11008, 36, 16, 2, 151936, True),
    ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"): _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B",
     "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"):
        _llama(4096, 14336, 32, 32, 8, 128256, False),
    ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"):
        _llama(4096, 14336, 32, 32, 8, 32768, False, model_type="mistral"),
    ("google/gemma-2-2b", "google/gemma-2-2b-it"): _gemma("gemma2", 2304, 9216, 26, 8, 4, 256000, True),
    ("google/gemma-2-9b", "google/gemma-2-9b-it"): _gemma("gemma2", 3584, 14336, 42, 16, 8, 256000, True),
    ("google/gemma-3-1b-pt", "google/gemma-3-1b-it"): _gemma("gemma3_text", 1152, 6912, 26, 4, 1, 262144, False),
    ("google/gemma-3-4b-pt", "google/gemma-3-4b-it"):
        _gemma("gemma3", 2560, 10240, 34, 8, 4, 262208, False, **_SIGLIP),
    ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-128k-instruct"): _phi3(3072, 8192, 32, 32, 32, 32064),
    ("microsoft/phi-4",): _phi3(5120, 17920, 40, 40, 10, 100352),
    ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", "builtin:SmolLM2-135M-Instruct"):
        _llama(576, 1536, 30, 9, 3, 49152, True),
    ("HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M-Instruct"): _llama(960, 2560, 32, 15, 5, 49152, True),
    ("HuggingFaceTB/SmolLM2-1.7B", "HuggingFaceTB/SmolLM2-1.7B-Instruct"): _llama(2048, 8192, 24, 32, 32, 49152, True),
}


def known_ids() -> list[str]:
    return [i for ids in TABLE for i in ids]


def canonical_ids() -> list[str]:
    return [ids[0] for ids in TABLE]


def from_table(model_id: str) -> Architecture | None:
    """The table's entry for a Hub id (case-insensitive), or None.

    Re-uploads such as `unsloth/Qwen2.5-3B-Instruct` resolve by their name part when it is unique.
    """
    wanted = model_id.strip().lower()
    for ids, values in TABLE.items():
        if wanted in (i.lower() for i in ids):
            return Architecture(**values, name=model_id, source="relaytune's table of known architectures")
    name = wanted.rsplit("/", 1)[-1]
    for suffix in ("-unsloth-bnb-4bit", "-bnb-4bit"):
        name = name.removesuffix(suffix)
    hits = [(ids, values) for ids, values in TABLE.items()
            if name in (i.lower().rsplit("/", 1)[-1] for i in ids)]
    if len(hits) == 1:
        ids, values = hits[0]
        return Architecture(**values, name=model_id, source=f"relaytune's table, as {ids[0]} (same name)")
    return None
