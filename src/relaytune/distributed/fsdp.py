"""FSDP2: the frozen base weights sharded over the ranks, for a base that does not fit one GPU.

What is sharded and what is not. `fully_shard` goes on every decoder layer and then on the
decoder (embeddings, final norm): those frozen weights are split over the ranks and all-gathered
one layer at a time, in forward and again in backward. The LoRA weights are left out
(`ignored_params`): they are small, every rank keeps a full copy, and their gradients are summed
by the same one flat all-reduce as without FSDP (World.sum_grads). So the optimizer, the gradient
norm, the gradient scaler and the checkpoint files are exactly those of an unsharded run: a
checkpoint written under FSDP resumes without it, on any number of GPUs, and the other way round.
The output head stays whole too: the chunked loss calls it outside the decoder's forward, where
FSDP could not gather it (and a tied head is the embedding itself).

Compilation: `torch_compile: auto` is off under FSDP. The hooks fully_shard puts around each layer
break its graph, and on an H200 compiled sharded layers ran at 3.4k tok/s against 4.8k eager
(bench/results/fsdp-one-gpu.md).

The price of collectives inside forward and backward: every rank must run the same number of
micro-batch passes (step.py pads a short share with a zero-weight pass), and a rank that runs
out of memory mid-forward cannot tell its peers, who wait in an all-gather. Under FSDP an OOM
therefore ends the round: the rank writes the halved micro-batch down (`oom_request`), the
elastic agent restarts every worker, and they continue from the last committed checkpoint with
it (training/continuation.py).
"""

from __future__ import annotations

import json

from relaytune.errors import UserError
from relaytune.log import notice

# `fsdp: auto` shards when replicated frozen weights would leave less than this share of a GPU free.
AUTO_SHARE = 0.8


def sharded(cfg, world, frozen_bytes: int | None, free_bytes: list[int] | None = None) -> bool:
    """Whether this run shards its base: `fsdp` resolved for this world and the free memory of
    the GPUs this host's ranks train on (measured here unless given)."""
    if not world.distributed:
        if cfg.fsdp is True:
            notice("fsdp: true with one process: there is nothing to shard over; training unsharded")
        return False
    if cfg.fsdp != "auto":
        return bool(cfg.fsdp)
    if free_bytes is None:
        free_bytes = _free_gpu_bytes()
    if not frozen_bytes or not free_bytes:
        return False  # no GPU, or a model the planner does not know: replicate
    return frozen_bytes > AUTO_SHARE * min(free_bytes)


def _free_gpu_bytes() -> list[int]:
    import torch

    from relaytune.distributed.world import local_size

    if not torch.cuda.is_available():
        return []
    used = min(local_size(), torch.cuda.device_count())
    return [torch.cuda.mem_get_info(i)[0] for i in range(used)]


def load_settings(cfg, param_dtype) -> dict:
    """Config values the sharded model loads with: the 4-bit storage dtype, and compilation off
    unless asked for (see the module's docstring)."""
    settings: dict = {}
    if (storage := check_quantization(cfg, param_dtype)) is not None:
        settings["bnb_4bit_quant_storage"] = storage
    if cfg.torch_compile == "auto":
        settings["torch_compile"] = False
    if cfg.compile_checkpoint == "auto":  # what pays for it, the embedding in host memory, is sharded here
        settings["compile_checkpoint"] = False
    return settings


def check_quantization(cfg, param_dtype) -> str | None:
    """The 4-bit storage dtype to load with under FSDP (None: not 4-bit), or UserError.

    FSDP turns bitsandbytes' Params4bit into plain tensors and shards them like any weight; with the
    default uint8 storage that silently trains to loss 0 or NaN (accelerate #3983). A float storage of
    the parameters' own dtype shards like an ordinary Linear (bitsandbytes' FSDP-QLoRA guide)."""
    if cfg.load_in_8bit:
        raise UserError("`load_in_8bit` cannot be sharded with FSDP (fsdp: true); use load_in_4bit: true, "
                        "or fsdp: false to replicate the 8-bit base on every GPU")
    if not cfg.load_in_4bit:
        return None
    wanted = str(param_dtype).removeprefix("torch.")
    storage = cfg.bnb_4bit_quant_storage
    if storage == "auto":
        return wanted
    if storage != wanted:
        why = ("uint8 storage is turned into plain tensors by FSDP and trains silently to loss 0 or NaN"
               if storage == "uint8" else f"FSDP all-gathers the weights as {wanted}, the parameters' dtype")
        raise UserError(f"`bnb_4bit_quant_storage`: {storage} cannot be sharded with FSDP ({why}); set it to "
                        f"{wanted} or auto, or set fsdp: false")
    return storage


def shard(model, world) -> None:
    """fully_shard each decoder layer, then the decoder; LoRA weights and the head stay whole.

    A CPU-loaded base is moved shard by shard to this rank's device by fully_shard; the parameters
    it leaves whole (LoRA, the head) and the buffers outside the decoder are moved here."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from relaytune.layers import decoder_layers

    device = world.device()
    mesh = init_device_mesh(device.type, (world.size,))
    lm = model.get_base_model()
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    whole = {p for p in model.parameters() if p.requires_grad} | set(head.parameters())
    layers = decoder_layers(model)
    if not layers:
        raise UserError("fsdp: this model's decoder has no list of layers to shard; set fsdp: false")
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=whole, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, ignored_params=whole, reshard_after_forward=True)
    with torch.no_grad():
        for p in whole:
            if p.device != device:
                p.data = p.data.to(device)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.device != device:
                    module._buffers[name] = buf.to(device)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def oom_request(path, step: int, micro_batch: int) -> None:
    """Write down the micro-batch the restarted workers take (any rank may: the same bytes)."""
    from relaytune.atomic import replace_file

    replace_file(path, json.dumps({"step": step, "micro_batch_size": micro_batch}).encode())


def read_oom_request(path) -> dict | None:
    try:
        value = json.loads(path.read_bytes())
        return value if isinstance(value, dict) and {"step", "micro_batch_size"} <= value.keys() else None
    except (OSError, ValueError):
        return None


__all__ = ["sharded", "load_settings", "check_quantization", "shard", "is_sharded", "oom_request",
           "read_oom_request"]
