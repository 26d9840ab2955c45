"""The decoder layers of a model and how each one runs: compiled or eager, checkpointed or not.

Gradient checkpointing wraps the layer's forward from outside any compiled region by default. transformers
applies its own checkpointing inside `forward` since 5.2x (before, around `__call__`), so compiling the
layer put the checkpoint inside the compiled graph, where AOTAutograd chose what to keep for backward:
on an H200, Qwen2.5-3B QLoRA at 8,192 tokens per step peaked at 20.1 GiB instead of 4.95 GiB
(bench/results/vs-trl-h200.md). Compiling `checkpoint(forward)` as one region was measured again in
the thirteenth session: the forward then kept only the layer inputs and the steps ran 9-12% faster, but
the backward graph's own peak was 0.64 GiB higher, above TRL's. Here transformers still provides the
checkpoint function (with `use_reentrant=False` and, when asked, the offloading of the saved inputs),
but relaytune decides where it goes: `LayerForward` becomes the layer's `forward` and calls
checkpoint(compiled forward, ...), or, with `checkpoint_inside`, one compiled checkpoint(forward), which
trades that backward peak for the speed. The module's hooks (FSDP2's) stay outside the checkpoint, as
transformers keeps them.
"""

from __future__ import annotations

import functools

import torch


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated decoder blocks (model.get_base_model().model.layers for HF causal LMs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class LayerForward:
    """A decoder layer's forward as relaytune runs it: `run` (the class's forward, or its compiled
    form) under `checkpoint` when one is set and the layer trains with gradients, or `run_checkpointed`
    (the checkpoint and the forward compiled as one region) when that is set."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.eager = type(layer).forward  # unbound: the layer is its first argument, as in the class
        self.run = self.eager
        self.checkpoint = None
        self.graphed = False  # `run` replays CUDA graphs: checkpoint with RecomputedLayer instead
        self.run_checkpointed = None
        # compile_layers(checkpoint_inside=True): compiles (forward, checkpoint) as one region, also for
        # a checkpoint that arrives after the compile (gradient_checkpointing: auto turned on late).
        self.compile_inside = None

    def __call__(self, *args, **kwargs):
        layer = self.layer
        if self.checkpoint is not None and layer.training and torch.is_grad_enabled():
            if self.run_checkpointed is not None:
                return self.run_checkpointed(layer, *args, **kwargs)
            if self.graphed and RecomputedLayer.can_run(args, kwargs):
                return RecomputedLayer.apply(args[0], self, kwargs)
            # The ordinary checkpoint cannot wrap graph replays: such a layer runs eagerly.
            return self.checkpoint(self.eager if self.graphed else self.run, layer, *args, **kwargs)
        if self.graphed:  # each call overwrites the last one's output: the next layer still reads it
            return _map_tensors(self.run(layer, *args, **kwargs), torch.clone)
        return self.run(layer, *args, **kwargs)

    @property
    def compiled(self) -> bool:
        return self.run is not self.eager


class RecomputedLayer(torch.autograd.Function):
    """A checkpointed layer whose forward and recompute may replay CUDA graphs (cudagraph trees).

    torch.utils.checkpoint around them failed on an H200 ("accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run"; bench/results/host-overhead-h200.md, 3b): as read, its
    recompute runs a forward while the first forward's backward is pending, and the trees then free
    outputs still in use.
    Here the first forward runs under no_grad (an inference graph) and its output is cloned out of
    the graphs' memory pool; backward restores the RNG (the same dropout masks) and the autocast
    state, recomputes with gradients, and hands back clones of the input's gradient and the
    adapters' gradients, so nothing outside keeps a tensor that the next replay overwrites. Only the
    layer's input gets a gradient: `can_run` leaves every other case to the ordinary checkpoint."""

    @staticmethod
    def can_run(args, kwargs) -> bool:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return False
        values = [v for value in kwargs.values() for v in (value if isinstance(value, (tuple, list)) else (value,))]
        return not any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)

    @staticmethod
    def forward(ctx, hidden, forward: LayerForward, kwargs):
        ctx.forward, ctx.kwargs = forward, kwargs
        ctx.rng = _rng_states(hidden.device)
        device = hidden.device.type  # backward runs outside the caller's autocast: recompute under it
        ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                            dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            out = forward.run(forward.layer, hidden, **kwargs)
        return _map_tensors(out, torch.clone)

    @staticmethod
    def backward(ctx, *grads):
        (saved,) = ctx.saved_tensors
        hidden = saved.detach().requires_grad_(saved.requires_grad)
        layer = ctx.forward.layer
        params = [p for p in layer.parameters() if p.requires_grad]
        with torch.random.fork_rng(devices=[hidden.device] if hidden.device.type == "cuda" else []):
            _set_rng_states(hidden.device, ctx.rng)
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                out = ctx.forward.run(layer, hidden, **ctx.kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        inputs = ([hidden] if hidden.requires_grad else []) + params
        got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
        _drop_recompute_graph(outs)
        for param, grad in zip(params, got[len(inputs) - len(params):]):
            if grad is not None:
                param.grad = grad.clone() if param.grad is None else param.grad.add_(grad)
        return (got[0].clone() if hidden.requires_grad and got[0] is not None else None), None, None


def _drop_recompute_graph(outs: list[torch.Tensor]) -> None:
    """The trees hand back the same output tensor at every replay, and autograd hangs the recompute's
    graph on it; that graph's context keeps the layer's input (a step's checkpointed clone) alive until
    the layer's next recompute, one step later: on an H200, 35 clones of 8 MiB more at the peak
    (bench/results/cuda-graphs-h200.md). Detaching the outputs in place lets the graph and that input go
    once the gradients are taken. A view cannot be detached in place; a layer's output is not one."""
    for out in outs:
        if out.grad_fn is not None and not out._is_view():
            out.detach_()


def _map_tensors(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(o) if isinstance(o, torch.Tensor) else o for o in out)


def _rng_states(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_states(device: torch.device, states) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def layer_forward(layer: torch.nn.Module) -> LayerForward:
    """The layer's LayerForward, installed as its `forward` on first use."""
    current = layer.__dict__.get("forward")
    if not isinstance(current, LayerForward):
        current = LayerForward(layer)
        layer.forward = current  # an instance attribute: the class's forward stays as it is
    return current


def take_over_checkpointing(model) -> None:
    """Moves transformers' gradient checkpointing of each decoder layer out of the layer's forward
    and into its LayerForward. Call after transformers enabled it."""
    for layer in decoder_layers(model):
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and checkpoint is not None:
            current = layer_forward(layer)
            current.checkpoint = checkpoint
            if current.compile_inside is not None:
                current.run_checkpointed = current.compile_inside(current.eager, checkpoint)
            layer.gradient_checkpointing = False  # transformers' own check: it no longer checkpoints


def compile_layers(layers: list[torch.nn.Module], cuda_graphs: bool = False,
                   checkpoint_inside: bool = False) -> None:
    """Compiles each layer's forward (regional compilation); the checkpoint stays outside. Layers of
    one class share one compiled function and so one graph: the layer is an input, not a constant.

    Inductor draws random numbers with ATen's generator (`fallback_random`), so a compiled layer's
    dropout masks are eager's: compiled and eager runs (and a run resumed with the other setting)
    stay equal within rounding, and under `cuda_graphs` the no_grad forward and the recompute, two
    different graphs, draw the same masks. It was not slower on an H200 (Qwen2.5-3B QLoRA seq 512:
    +5% in one lease, within that case's spread; Llama-3-8B QLoRA 9,905 tok/s against 9,520-9,599
    without it in earlier leases).

    `cuda_graphs`: the compiled forward and backward replay CUDA graphs, checkpointed by
    RecomputedLayer. Their pointwise kernels are not autotuned: Inductor benchmarks a new kernel's
    configurations at its first run, which under the graphs is inside their memory pool, and the pool
    kept the benchmark's buffers for good (+0.10 GiB on an H200 in a run compiling from scratch,
    none once Inductor's cache held the kernels; bench/results/cuda-graphs-h200.md, section 5).

    `checkpoint_inside` (not with `cuda_graphs`): a checkpointed layer in training runs as one
    compiled region, checkpoint(forward), so AOTAutograd's partitioner writes the recompute into the
    backward graph: the forward keeps only the layer's inputs, and backward recomputes only what it
    reads (not the down projection's frozen matmul, which only feeds the residual)."""
    options = {"fallback_random": True,
               **({"triton.cudagraphs": True, "triton.autotune_pointwise": False} if cuda_graphs else {})}
    compiled: dict[object, object] = {}
    inside = functools.partial(_compiled_region, compiled, options) if checkpoint_inside and not cuda_graphs else None
    if inside is not None:
        _skip_side_effect_replay()
    for layer in layers:
        current = layer_forward(layer)
        if current.eager not in compiled:
            compiled[current.eager] = torch.compile(current.eager, options=options)
        current.run = compiled[current.eager]
        current.graphed = cuda_graphs
        current.compile_inside = inside
        current.run_checkpointed = None
        if inside is not None and current.checkpoint is not None:
            current.run_checkpointed = inside(current.eager, current.checkpoint)


def _compiled_region(cache: dict, options: dict, forward, checkpoint):
    """checkpoint(forward) compiled as one region; layers of one class with one checkpoint share it."""
    if (forward, checkpoint) not in cache:
        cache[forward, checkpoint] = torch.compile(functools.partial(_checkpointed, checkpoint, forward),
                                                   options=options)
    return cache[forward, checkpoint]


def _skip_side_effect_replay() -> None:
    """Lets Dynamo trace a checkpoint whose forward has Python side effects, applied once in forward
    and not replayed in the recompute. transformers' hub-kernel wrapper (`use_kernelized_func`, on
    wherever the `kernels` package is installed, which 5.25 requires) sets and resets a context
    variable in every attention forward. Dynamo refused that inside a checkpoint and ran the whole
    checkpoint eagerly around a compiled forward, so `compile_checkpoint` silently did nothing (0 graphs
    compiled, on the CPU).
    That variable is restored before the forward returns: not replaying it loses nothing. The flag is
    Dynamo's, for the process: a run puts back the value it found as it ends (speedups.configure_dynamo)."""
    import torch._dynamo.config as dynamo

    if hasattr(dynamo, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _checkpointed(checkpoint, forward, layer, *args, **kwargs):
    return checkpoint(forward, layer, *args, **kwargs)


def drop_cuda_graphs(layers: list[torch.nn.Module]) -> bool:
    """Layers that replay CUDA graphs are compiled again without them, and the graphs and their
    private memory pool are freed (after an OOM: the retry at a smaller micro-batch would record
    new graphs beside the old ones). False when no layer replayed graphs."""
    graphed = [layer for layer in layers if getattr(layer.__dict__.get("forward"), "graphed", False)]
    if not graphed:
        return False
    compile_layers(graphed, cuda_graphs=False)
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    return True


def move_checkpoints_outside(layers: list[torch.nn.Module]) -> bool:
    """Layers whose checkpoint was compiled with them keep it outside from now on (after an OOM: the
    compiled checkpoint's backward peaks higher). False when no layer had it inside."""
    moved = False
    for layer in layers:
        current = layer.__dict__.get("forward")
        if isinstance(current, LayerForward):
            moved |= current.run_checkpointed is not None
            current.run_checkpointed = current.compile_inside = None
    return moved


def uncompile_layers(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        current = layer_forward(layer)
        current.run = current.eager
        current.graphed = False
        current.run_checkpointed = current.compile_inside = None


def is_compiled(layer: torch.nn.Module) -> bool:
    current = layer.__dict__.get("forward")
    return isinstance(current, LayerForward) and current.compiled


def checkpoints_inside(layer: torch.nn.Module) -> bool:
    """Whether the layer's checkpoint is compiled with it (`compile_layers(checkpoint_inside=True)`)."""
    return getattr(layer.__dict__.get("forward"), "run_checkpointed", None) is not None
