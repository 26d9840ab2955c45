"""The input embedding table in CPU memory (`offload_embeddings`): only the rows a batch looks up reach the GPU.

A frozen table that is not also the output head is read once per forward, by one lookup. Kept on the
GPU it costs vocab x hidden x 2 bytes (Llama-3-8B: 0.98 GiB) for the few thousand rows a micro-batch
reads (32 MiB at 4,096 tokens). Here the lookup runs on the CPU into a pinned buffer, whose rows are
copied to the GPU asynchronously. A lookup copies values, so training is the same bit for bit. The
weight stays a parameter of the model (on the CPU), so the model's state dict is unchanged; what
reads `model.device` (the first parameter's) sees the CPU, which is why the packing check asks for
the device of the decoder instead (data/packing.py). torch is imported where it is used, so the
planner reads AUTO_MIN_BYTES without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaytune.log import notice

if TYPE_CHECKING:
    import torch

GIB = 2 ** 30
AUTO_MIN_BYTES = 256 * 2 ** 20  # below this the GPU memory saved is not worth a host round trip per batch
# Decoders whose input embedding is transformers' *ScaledWordEmbedding, an nn.Embedding subclass that
# `offloadable` refuses; the planner reads this to say so without the model. Every Gemma family is one.
SCALED_EMBEDDING_TYPES = frozenset({"biogpt", "minicpm3"})


def scaled_input_embedding(model_type: str) -> bool:
    """Whether a model type's input embedding scales its output (and so stays on the GPU)."""
    return "gemma" in model_type or model_type in SCALED_EMBEDDING_TYPES


class HostLookup:
    """An nn.Embedding's forward with its weight in host memory; the rows go to `device`."""

    def __init__(self, module: torch.nn.Embedding, device: torch.device):
        self.module, self.device = module, device
        self.ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # (host ids, their rows): prefetch_rows

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """nn.Embedding.forward's call: the ids positionally or as `input`."""
        from relaytune.data.batches import host_copy

        input_ids = args[0] if args else kwargs["input"]
        # The batch's pinned source when it has one (data/batches.py): copying the ids back from the
        # GPU would make the host wait there for all the kernels queued before it.
        ids = host_copy(input_ids)
        ids = input_ids.to("cpu") if ids is None else ids
        if self.ahead is not None and self.ahead[0] is ids:  # used once: a second forward looks up again
            rows, self.ahead = self.ahead[1], None
        else:  # other ids (an evaluation between steps) leave the rows for the forward they were made for
            rows = self.host_rows(ids)
        # From pinned memory the copy is asynchronous, and torch's host allocator reuses the buffer
        # only once the copy is done.
        return rows.to(self.device, non_blocking=self.device.type == "cuda")

    def host_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of host `ids`, in pinned memory when they go to a GPU."""
        import torch

        weight = self.module.weight
        rows = torch.empty((*ids.shape, weight.shape[1]), dtype=weight.dtype,
                           pin_memory=self.device.type == "cuda")
        torch.index_select(weight.detach(), 0, ids.reshape(-1), out=rows.view(-1, weight.shape[1]))
        return rows


def prefetch_rows(model, host_ids: torch.Tensor) -> None:
    """Look up the rows of a batch that has not started yet (training/prefetch.py) into host memory,
    so its forward only queues their copy. `host_ids` is the tensor the batch's device ids are copied
    from (data/batches.to_device keeps it as their `host_copy`). Nothing when the table is on the GPU."""
    lookup = getattr(_input_embedding(_base(model)), "__dict__", {}).get("forward")
    if isinstance(lookup, HostLookup):
        lookup.ahead = (host_ids, lookup.host_rows(host_ids))


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _input_embedding(base):
    return base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None


def offloadable(model) -> torch.nn.Embedding | None:
    """The model's input embedding when it can live in host memory: a plain frozen nn.Embedding (not a
    subclass that scales its output, not one with max_norm, which writes to the table) that is not
    the output head's weight too."""
    import torch

    base = _base(model)
    embedding = _input_embedding(base)
    if type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None:
        return None
    if embedding.weight.requires_grad or isinstance(embedding.__dict__.get("forward"), HostLookup):
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    if head_weight is not None and head_weight.data_ptr() == embedding.weight.data_ptr():
        return None
    return embedding


def offload_decision(setting, model, device: torch.device, sharded: bool) -> tuple[bool, str | None]:
    """(offload?, why not, when the user asked for it)."""
    if setting is False:
        return False, None
    asked = setting is True
    if device.type != "cuda":
        return False, "the model is on the CPU already" if asked else None
    if sharded:
        return False, "FSDP shards the base, the table with it" if asked else None
    embedding = offloadable(model)
    if embedding is None:
        return False, ("the input embedding is tied to the output head, trains, or is not a plain "
                       "nn.Embedding" if asked else None)
    size = embedding.weight.numel() * embedding.weight.element_size()
    return asked or size >= AUTO_MIN_BYTES, None


def offload_input_embedding(model, device: torch.device) -> int:
    """Moves the input embedding's weight to host memory and looks its rows up there; the GPU bytes freed."""
    embedding = offloadable(model)
    if embedding is None:
        return 0
    import torch

    weight = embedding.weight
    size = weight.numel() * weight.element_size()
    weight.data = weight.data.to("cpu")
    embedding.forward = HostLookup(embedding, device)  # an instance attribute: hooks still run around it
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return size


def place_input_embedding(model, cfg, device: torch.device, sharded: bool) -> str | None:
    """Applies `offload_embeddings`; the preflight table's line when the table went to host memory."""
    offload, why = offload_decision(getattr(cfg, "offload_embeddings", False), model, device, sharded)
    if why:
        notice(f"offload_embeddings: off ({why})")
    if not offload:
        return None
    freed = offload_input_embedding(model, device)
    return f"in CPU memory, rows copied per batch ({freed / GIB:.2f} GiB of GPU memory freed; offload_embeddings)"
