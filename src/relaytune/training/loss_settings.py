"""The loss's shape settings, torch-free, so that the planner predicts what the loss really allocates."""

CHUNK_TOKENS = 256  # labelled tokens whose logits exist at once (one chunk); TRL uses 256

# Model types whose output head is a plain linear layer, so the chunked loss computes exactly what
# the model's own forward would; others (logit soft-capping, scaling) use the model's forward.
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "smollm3", "gemma", "starcoder2"})
