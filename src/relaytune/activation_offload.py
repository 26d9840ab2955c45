"""offload_activations: each checkpointed decoder layer keeps its input in pinned host memory.

Non-reentrant checkpointing saves a layer's inputs through autograd's saved-tensor hooks, so
`offloaded_checkpoint` hands them to `to_host` in forward and takes them back through `to_device` in
backward; what the layer saves inside is still dropped and recomputed under checkpointing's own hooks.

The copies run on a side CUDA stream, one per GPU, so that they overlap the layers' compute instead of
queueing between its kernels: in forward, layer i's input goes to the host while layer i runs; in
backward, taking back layer i's input starts the copy of layer i-1's, which layer i's recompute and
backward then hide. So one more layer input than without the prefetch is on the GPU at a time.

Stream rules kept here (the caching allocators order reuse by stream, not by host time):
- the side stream waits for the compute stream before reading a tensor it produced, and before writing
  into a block the compute stream handed out (its earlier users are queued there);
- a GPU tensor the side stream reads or writes is recorded on it, so its block is not reused before the copy;
- the compute stream waits for a copy's event before it uses the copied tensor;
- the pinned host blocks record their copies' events themselves (torch's host allocator).
"""

from __future__ import annotations

import weakref

import torch


class Offloaded:
    """One layer input in host memory, the input offloaded just before it (to prefetch in backward),
    and its copy back to the GPU while one is in flight."""

    __slots__ = ("device", "host", "earlier", "reloaded", "ready", "__weakref__")

    def __init__(self, device: torch.device, host: torch.Tensor, earlier: weakref.ref | None):
        self.device, self.host, self.earlier = device, host, earlier
        self.reloaded: torch.Tensor | None = None
        self.ready = None  # the side stream's event after the copy back


# Tensors on these devices go to the host (a CPU test sets "cpu", with the copies replaced, to follow the schedule).
OFFLOADED_DEVICE_TYPES = ("cuda",)
# The side stream of each GPU, and the input offloaded last there (forward order links each to the one before).
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_last_offloaded: dict[torch.device, weakref.ref] = {}


def offloaded_checkpoint(checkpoint, function, *args, **kwargs):
    """`checkpoint(function, *args)` with the inputs it keeps in pinned host memory."""
    with torch.autograd.graph.saved_tensors_hooks(to_host, to_device):
        return checkpoint(function, *args, **kwargs)


def to_host(tensor: torch.Tensor):
    if tensor.device.type not in OFFLOADED_DEVICE_TYPES:
        return tensor
    item = Offloaded(tensor.device, copy_to_host(tensor), _last_offloaded.get(tensor.device))
    _last_offloaded[tensor.device] = weakref.ref(item)
    return item


def to_device(packed):
    if not isinstance(packed, Offloaded):
        return packed
    if packed.reloaded is None:
        start_copy_back(packed)
    tensor = wait_for_copy_back(packed)
    earlier = packed.earlier() if packed.earlier is not None else None
    if earlier is not None and earlier.reloaded is None:
        start_copy_back(earlier)  # the layer before this one, which backward reaches next
    return tensor


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    compute, side = torch.cuda.current_stream(tensor.device), side_stream(tensor.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
    tensor.record_stream(side)
    return host


def start_copy_back(item: Offloaded) -> None:
    compute, side = torch.cuda.current_stream(item.device), side_stream(item.device)
    # Allocated from the compute stream's pool, where it is used and freed, so the prefetch adds no pool.
    tensor = torch.empty(item.host.size(), dtype=item.host.dtype, device=item.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        tensor.copy_(item.host, non_blocking=True)
        item.ready = side.record_event()
    tensor.record_stream(side)  # a prefetch that backward never takes (it raised) is freed after its copy
    item.reloaded = tensor


def wait_for_copy_back(item: Offloaded) -> torch.Tensor:
    torch.cuda.current_stream(item.device).wait_event(item.ready)
    tensor, item.reloaded = item.reloaded, None  # a second backward through a kept graph copies again
    return tensor
