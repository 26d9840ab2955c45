"""offload_activations: each checkpointed decoder layer keeps its inputs in pinned host memory.

Non-reentrant checkpointing saves a layer's inputs through autograd's saved-tensor hooks, so
`offloaded_checkpoint` hands them to `to_host` in forward and takes them back through `to_device` in
backward; what the layer saves inside is still dropped and recomputed under checkpointing's own hooks.

The copies run on a side CUDA stream, one per GPU, so that they overlap the layers' compute instead of
queueing between its kernels: in forward, layer i's inputs go to the host while layer i runs; in
backward, taking back layer i's inputs starts the copies of layer i-1's, which layer i's recompute and
backward then hide. So one more layer's inputs than without the prefetch are on the GPU at a time.
A layer's inputs leave the GPU when the next layer starts: the compute stream waits there for their copy
(a layer's compute to finish it in), so their blocks go back to the compute stream's pool at once, where
a `record_stream` would hold them until the host saw the copy done, as many layers later as the host runs
ahead of the GPU. The last layer's inputs stay on the GPU until backward, which takes them from there.
A copy back is not recorded on the side stream either: the compute stream waits for it before the layer
uses it, and a prefetch that backward never takes makes the compute stream wait as its item is dropped.
It was the copies back that held the blocks: on an H100, Qwen2.5-3B QLoRA at micro-batch 4 reserved
4.37 GiB with them recorded and 4.16 without, as much as with every copy on the compute stream, at the
same tokens/s, allocated peak and losses (Llama-3-8B QLoRA: 6.18 GiB, as on the compute stream, where
another H100 had reserved 6.54 with them recorded); the forward release alone had saved 0.02 GiB.
The chain of layers restarts with each forward pass, so a prefetch never reaches into an older graph.

Stream rules kept here (the caching allocators order reuse by stream, not by host time):
- the side stream waits for the compute stream before reading a tensor it produced, and before writing
  into a block the compute stream handed out (its earlier users are queued there);
- a GPU tensor the side stream reads or writes is kept until the compute stream has waited for its copy,
  so no block goes back to the compute stream's pool before its copy is done;
- the compute stream waits for a copy's event before it uses the copied tensor;
- the pinned host blocks record their copies' events themselves (torch's host allocator).
A layer that wrote its input in place would race the copy to the host; autograd does not check saved
tensors that go through hooks, so `offloaded_checkpoint` does.
"""

from __future__ import annotations

import weakref

import torch

from relaytune.errors import UserError


class Layer:
    """The inputs one checkpointed layer call offloaded, and the layer call before it in this forward pass."""

    __slots__ = ("inputs", "earlier", "__weakref__")

    def __init__(self, earlier: Layer | None):
        self.inputs: list[weakref.ref] = []
        self.earlier = weakref.ref(earlier) if earlier is not None else None


class Offloaded:
    """One layer input in host memory, its layer, the GPU tensor until it is released, and its copy back to
    the GPU while one is in flight."""

    __slots__ = ("device", "host", "copied", "source", "layer", "reloaded", "ready", "__weakref__")

    def __init__(self, source: torch.Tensor, host: torch.Tensor, copied, layer: Layer):
        self.device, self.host, self.copied, self.layer = source.device, host, copied, layer
        self.source: torch.Tensor | None = source  # the GPU tensor, until the compute stream waits for `copied`
        self.reloaded: torch.Tensor | None = None
        self.ready = None  # the side stream's event after the copy back

    def __del__(self):
        # A prefetch that backward never took (it raised, or the graph was dropped) must not go back to the
        # pool while its copy may still write into it: the compute stream, which reuses the block, waits first.
        # A dropped input still on the GPU needs no wait: its copy only reads it, into a pinned block that
        # the host allocator keeps until that copy is done and that nothing else reads.
        if self.reloaded is not None and self.reloaded.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready)


# Tensors on these devices go to the host (a CPU test sets "cpu", with the copies replaced, to follow the schedule).
OFFLOADED_DEVICE_TYPES = ("cuda",)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_last_layer: list[weakref.ref] = []  # the layer call offloaded last in this forward pass, if any


def offloaded_checkpoint(checkpoint, starts_pass: bool, function, *args, **kwargs):
    """`checkpoint(function, *args)` with the inputs it keeps in pinned host memory; `starts_pass`: this is
    the first checkpointed layer of the model, so a new forward pass begins."""
    earlier = None if starts_pass or not _last_layer else _last_layer[0]()
    layer = Layer(earlier)
    _last_layer[:] = [weakref.ref(layer)]
    versions = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: to_host(tensor, layer), to_device):
        output = checkpoint(function, *args, **kwargs)
    if layer.inputs and any(a._version != version for a, version in versions):
        raise UserError("offload_activations: this model's decoder layer writes its input in place, which "
                        "would race the input's copy to host memory; set offload_activations: false")
    return output


def to_host(tensor: torch.Tensor, layer: Layer):
    if type(tensor) is not torch.Tensor or tensor.device.type not in OFFLOADED_DEVICE_TYPES:
        return tensor  # a tensor subclass (a sharded or quantized weight) stays as autograd saved it
    for item in inputs_of(layer.earlier):  # the layer before this one has run: its inputs leave the GPU
        if item.source is not None:
            release_source(item)
    item = Offloaded(tensor, *copy_to_host(tensor), layer)
    layer.inputs.append(weakref.ref(item))
    return item


def inputs_of(layer_ref: weakref.ref | None) -> list[Offloaded]:
    layer = layer_ref() if layer_ref is not None else None
    items = (ref() for ref in layer.inputs) if layer is not None else ()
    return [item for item in items if item is not None]  # a dropped graph's items are gone


def to_device(packed):
    if not isinstance(packed, Offloaded):
        return packed
    if packed.source is not None:  # the forward pass's last layer: its inputs are still on the GPU
        tensor = release_source(packed)
    else:
        if packed.reloaded is None:
            start_copy_back(packed)
        tensor = wait_for_copy_back(packed)
    for item in inputs_of(packed.layer.earlier):  # the layer before this one, which backward reaches next
        if item.source is None and item.reloaded is None:
            start_copy_back(item)
    return tensor


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    compute, side = torch.cuda.current_stream(tensor.device), side_stream(tensor.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, side.record_event()


def release_source(item: Offloaded) -> torch.Tensor:
    """The input's GPU tensor, no longer kept: the compute stream waits for its copy to the host first, so
    compute work that reuses its block runs after the copy has read it."""
    torch.cuda.current_stream(item.device).wait_event(item.copied)
    tensor, item.source = item.source, None
    return tensor


def start_copy_back(item: Offloaded) -> None:
    compute, side = torch.cuda.current_stream(item.device), side_stream(item.device)
    # Allocated from the compute stream's pool, where it is used and freed, so the prefetch adds no pool.
    tensor = torch.empty(item.host.size(), dtype=item.host.dtype, device=item.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        tensor.copy_(item.host, non_blocking=True)
        item.ready = side.record_event()
    item.reloaded = tensor


def wait_for_copy_back(item: Offloaded) -> torch.Tensor:
    torch.cuda.current_stream(item.device).wait_event(item.ready)
    tensor, item.reloaded = item.reloaded, None  # a kept graph's second backward copies again
    return tensor
