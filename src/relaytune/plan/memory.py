"""Peak GPU memory of one relaytune LoRA/QLoRA training step, split into named parts that add up.

The model follows what relaytune's code keeps alive (model.py, the training loss, recipe and
checkpoint state), per token of a micro-batch (B rows x S tokens, every row
at max_seq_length: the worst case the peak is made of), with a = bytes of the compute dtype,
h hidden, q = heads x head_dim, kv = kv_heads x head_dim, I intermediate, V vocabulary:

- frozen weights: linear layers at 16/8/4.13/4.5 bits (bf16, int8, NF4 with / without double
  quantization); embeddings, output head, norms and biases stay in the compute dtype
  (bitsandbytes quantizes only nn.Linear, and relaytune does not upcast them); a tied head once.
- LoRA: r x (in + out) per adapted linear, fp32 (PEFT upcasts adapters), its fp32 gradient, and
  AdamW's two fp32 moments (8 bytes per parameter) or 8-bit ones (2 bytes plus an fp32 absmax per
  256; tensors under 4,096 values keep fp32 state). paged_adamw_8bit puts tensors of 100,000+
  values in CUDA unified memory, outside torch's count.
- checkpoint staging: a save clones the adapter and the optimizer state on the GPU and copies
  them to the host in the background, during the next step; a fresh run also keeps a clone of
  the initial adapter for a NaN rollback.
- saved activations, per layer and token: with gradient checkpointing the layer's input (a x h);
  without, everything autograd keeps (see `layer_saved_bytes`), which is less when torch_compile
  compiles each layer (Inductor recomputes the norms' upcast and the SiLU product in backward).
- CUDA graphs (`cuda_graphs` in force at this micro-batch, with checkpointing): GRAPHS_EXTRA, the most a
  run with graphs peaked above the same run without them on an H200 (bench/results/cuda-graphs-h200.md).
- the peak is reached either in the loss (all saved activations + one loss chunk of CHUNK_TOKENS
  labelled tokens: its logits in the compute dtype and in fp32, which become their own gradient in
  place, 6 bytes per logit, in forward; 12 bytes per logit when each chunk was recomputed in
  backward, as every run did before 2026-12-02: the fp32 log-softmax, its gradient and the input
  gradient) or in the backward of the last layer (all saved activations + that layer recomputed +
  the backward's temporaries), whichever is larger.
- reserved/nvidia-smi adds allocator slack, the CUDA context and paged optimizer state.

The constants fitted to GPU measurements live in plan/calibration.py, each beside where it was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from relaytune.errors import UserError
from relaytune.plan.architectures import Architecture
from relaytune.plan.calibration import (
    BACKWARD_CHECKPOINT_INSIDE,
    BACKWARD_COMPILED_QUANTIZED,
    BACKWARD_FIXED,
    BACKWARD_FP32_CAST,
    BACKWARD_PLAIN,
    GIB,
    GRAPHS_EXTRA,
    LIGER_SWIGLU_IN_PLACE,
    OFFLOAD_RESIDUAL_PER_TOKEN,
    SLACK_FRACTION,
)
from relaytune.plan.facts import chunk_tokens, embedding_offload_min_bytes, input_embedding_scales, plain_head_types
from relaytune.plan.gpus import CUDA_CONTEXT_GIB
from relaytune.training.cuda_graphs import auto_turns_on

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# bitsandbytes 4-bit: one absmax per 64 weights, fp32, or with double quantization 8-bit with one fp32
# constant per 256 blocks.
NF4_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}
LOSS_BYTES_PER_LOGIT = 12  # fp32 log-softmax output + its gradient + the logits' gradient, alive together
# The loss that computes the head's gradient in forward (bf16, fp32): fp32 logits beside their copy in
# the compute dtype, first as the matmul's output and then as the gradient's input to the next matmul.
FUSED_LOSS_BYTES_PER_LOGIT = 6
PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages optimizer state of tensors this large
EIGHT_BIT_MIN_NUMEL = 4096  # smaller tensors keep fp32 moments in the 8-bit optimizers


@dataclass(frozen=True)
class Settings:
    """The training choices that memory depends on (micro-batch and checkpointing are arguments)."""

    max_seq_length: int
    quantization: str = "none"  # none | nf4 | fp4 | int8
    double_quant: bool = True
    compute_dtype: str = "bf16"  # bf16 | fp16 | fp32
    optim: str = "adamw_torch"  # adamw_torch | adamw_8bit | paged_adamw_8bit
    lora_r: int = 16
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05
    save_only_model: bool = False
    labelled_fraction: float = 1.0  # share of tokens that carry a label (1.0: the worst case)
    chunk_tokens: int = field(default_factory=chunk_tokens)
    staging: bool = True  # a background save's GPU copy may overlap the next step
    rollback_copy: bool = True  # a fresh run keeps the initial adapter on the GPU
    compiled_layers: bool = False  # torch_compile in force: each decoder layer compiled by Inductor
    offload_activations: bool = False  # checkpointed layer inputs held in pinned CPU memory
    adapter_bytes: int = 4  # adapter_dtype: 4 for float32, 2 for bfloat16 (weights, gradients, AdamW moments)
    loss_recomputed: bool = False  # every loss chunk recomputed in backward (relaytune before 2026-12-02)
    # cuda_graphs in force: "off" (never: false, or something it cannot run beside), "on" (true), or "auto"
    # (training/cuda_graphs.auto_turns_on at the GPU's dense peak, graphs_peak_flops).
    graphs: str = "off"
    graphs_peak_flops: float = 0.0
    # offload_embeddings as it resolves on a GPU: "off", "on", or "auto" (an untied table this large,
    # facts.embedding_offload_min_bytes); either way only an untied input table leaves the GPU.
    offload_embeddings: str = "off"
    # compile_checkpoint: "off", "on", or "auto" (on where the input embedding is offloaded); either way in
    # force only where the layers are compiled, checkpointed, and neither graphed at this micro-batch nor offloaded.
    compile_checkpoint: str = "off"
    shards: int = 1  # FSDP: the processes the frozen base is sharded over (distributed/fsdp.shard)
    liger_kernels: tuple[str, ...] = ()  # Liger's kernels on the decoder layers: "rms_norm", "swiglu"


@dataclass
class MemoryEstimate:
    """Peak memory in bytes. `parts` add up to `total_allocated` (torch.cuda.max_memory_allocated)."""

    parts: dict[str, int]
    details: dict[str, str]
    peak_phase: str  # "loss" or "layer backward"
    off_peak: dict[str, int]  # the other phase's parts, which do not coincide with the peak
    total_allocated: int
    slack: int
    cuda_context: int
    paged: int  # optimizer state in CUDA unified memory (paged_adamw_8bit)
    micro_batch: int
    gradient_checkpointing: bool

    @property
    def total_reserved(self) -> int:
        """What the card holds for the process (nvidia-smi): allocated + slack + context + paged state."""
        return self.total_allocated + self.slack + self.cuda_context + self.paged

    @property
    def torch_reserved(self) -> int:
        """What torch's caching allocator holds (what torch.cuda.set_per_process_memory_fraction caps)."""
        return self.total_allocated + self.slack


def estimate_memory(arch: Architecture, settings: Settings, micro_batch: int,
                    gradient_checkpointing: bool) -> MemoryEstimate:
    """Peak memory of a training step at this micro-batch, parts first, then totals."""
    s, tokens = settings, micro_batch * settings.max_seq_length
    a = DTYPE_BYTES[s.compute_dtype]
    lora = lora_tensor_sizes(arch, s)
    n_lora = sum(lora)
    opt_torch, opt_paged = optimizer_bytes(lora, s.optim, s.adapter_bytes)
    layer = layer_saved_bytes(arch, s)
    parts = {"frozen weights": frozen_per_gpu(arch, s), "LoRA parameters": s.adapter_bytes * n_lora,
             "LoRA gradients": s.adapter_bytes * n_lora, "optimizer state": opt_torch,
             "checkpoint staging": staging_bytes(n_lora, opt_torch + opt_paged, s)}
    if gradient_checkpointing:
        parts["saved activations"] = tokens * OFFLOAD_RESIDUAL_PER_TOKEN if s.offload_activations \
            else arch.num_layers * tokens * a * arch.hidden_size
        graphs = replays_graphs(arch, s, tokens)
        if graphs:
            parts["CUDA graphs"] = GRAPHS_EXTRA
        # Offloaded inputs and Liger's kernels keep the checkpoint outside the layer (speedups.py), as graphs do.
        inside = (checkpoint_inside(arch, s) and s.compiled_layers and not graphs and not s.offload_activations
                  and not s.liger_kernels)
        layer_phase = {"recomputed layer": tokens * layer,
                       "backward working set": working_set(arch, s, tokens, inside)}
        if s.offload_activations:  # the copy back of the next layer's input starts as this one's recompute does
            layer_phase["prefetched layer input"] = tokens * a * arch.hidden_size
    else:
        parts["saved activations"] = arch.num_layers * tokens * layer
        layer_phase = {"backward working set": working_set(arch, s, tokens)}
    loss_phase = {"loss": loss_bytes(arch, s, tokens)}
    if gradient_checkpointing and s.offload_activations:  # backward takes it from the GPU, not the host
        loss_phase["last layer input"] = tokens * a * arch.hidden_size
    loss_peak = sum(loss_phase.values()) >= sum(layer_phase.values())
    at_peak, off = (loss_phase, layer_phase) if loss_peak else (layer_phase, loss_phase)
    parts.update(at_peak)
    allocated = sum(parts.values())
    return MemoryEstimate(
        parts=parts, details=describe_parts(arch, s, tokens, n_lora, opt_paged, gradient_checkpointing),
        peak_phase="loss" if loss_peak else "layer backward", off_peak=off,
        total_allocated=allocated, slack=int(SLACK_FRACTION * allocated),
        cuda_context=int(CUDA_CONTEXT_GIB * GIB), paged=opt_paged, micro_batch=micro_batch,
        gradient_checkpointing=gradient_checkpointing)


def replays_graphs(arch: Architecture, s: Settings, tokens: int) -> bool:
    """cuda_graphs in force at this micro-batch (training/cuda_graphs.py's rule, with checkpointing on)."""
    if s.offload_activations or s.liger_kernels or s.graphs == "off":
        return False
    weights = sum(m.in_features * m.out_features for m in arch.layer_linears())
    return s.graphs == "on" or (s.graphs_peak_flops > 0 and auto_turns_on(weights, tokens, s.graphs_peak_flops))


# The input embedding's name in every architecture the planner knows (Llama, Qwen2, Mistral, Gemma, Phi-3).
INPUT_EMBEDDING = "embed_tokens"


def adapts_embedding(targets) -> bool:
    """Whether LoRA adapts the input embedding (PEFT matches a target against a module name's end)."""
    targets = (targets,) if isinstance(targets, str) else targets
    return any(str(t).rsplit(".", 1)[-1] == INPUT_EMBEDDING for t in targets)


def adapted_linears(arch: Architecture, targets) -> list:
    """The decoder linears that get an adapter; PEFT matches a target name against the module name's end."""
    if isinstance(targets, str) and targets != "all-linear":
        targets = (targets,)
    layer = arch.layer_linears()
    if targets == "all-linear":
        return layer
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    chosen = [m for m in layer if m.name in names]
    if not chosen and INPUT_EMBEDDING not in names:
        raise UserError(f"`lora_target_modules`: none of {sorted(names)} is a linear layer of this model "
                        f"({arch.model_type}); its layers have {', '.join(m.name for m in layer)}, or use all-linear")
    return chosen


def lora_tensor_sizes(arch: Architecture, s: Settings) -> list[int]:
    """Element counts of every LoRA A and B matrix in the model."""
    per_layer = []
    for m in adapted_linears(arch, s.lora_target_modules):
        per_layer += [s.lora_r * m.in_features, m.out_features * s.lora_r]
    sizes = per_layer * arch.num_layers
    # PEFT's all-linear also adapts linear layers that text never runs through (a vision tower).
    if s.lora_target_modules == "all-linear":
        for i, o, n in arch.extra_linears:
            sizes += [s.lora_r * i, o * s.lora_r] * n
    if adapts_embedding(s.lora_target_modules):  # lora_embedding_A is r x vocab, lora_embedding_B hidden x r
        sizes += [s.lora_r * arch.vocab_size, arch.hidden_size * s.lora_r]
    return sizes


def weight_bytes(arch: Architecture, s: Settings) -> int:
    """Every frozen weight on the GPU (the input embedding not, where it is in host memory)."""
    a = DTYPE_BYTES[s.compute_dtype]
    embeddings = arch.embedding_params() - (arch.vocab_size * arch.hidden_size if embeddings_offloaded(arch, s) else 0)
    return int(linear_bytes(arch, s) + (embeddings + arch.other_params()) * a)


def linear_bytes(arch: Architecture, s: Settings) -> float:
    """The decoder's linear layers as stored: bf16/fp16/fp32, int8 with a scale per row, or 4-bit."""
    linear = arch.linear_params()
    if s.quantization in ("nf4", "fp4"):
        return linear * NF4_BYTES[s.double_quant]
    if s.quantization == "int8":
        rows = sum(m.out_features for m in arch.layer_linears()) * arch.num_layers
        return linear + 4 * rows  # int8 weights and one fp32 scale per output row
    return linear * DTYPE_BYTES[s.compute_dtype]


def frozen_per_gpu(arch: Architecture, s: Settings) -> int:
    """The frozen weights one GPU holds. Under FSDP (`shards` > 1) the output head stays whole (and so
    does a tied input embedding, the same tensor), the rest is split evenly, and two decoder layers are
    all-gathered at once: the one computing and the next, prefetched. On 2 H200s the planner then came
    within 4% below the measured peaks of Llama-3-8B (bench/results/multi-gpu.md)."""
    whole = weight_bytes(arch, s)
    if s.shards <= 1:
        return whole
    head = arch.vocab_size * arch.hidden_size * DTYPE_BYTES[s.compute_dtype]
    gathered = 2 * linear_bytes(arch, s) / arch.num_layers
    return int(head + (whole - head) / s.shards + gathered)


def checkpoint_inside(arch: Architecture, s: Settings) -> bool:
    """compile_checkpoint as speedups.checkpoint_inside_decision resolves it, before graphs and offloading."""
    return s.compile_checkpoint == "on" or (s.compile_checkpoint == "auto" and embeddings_offloaded(arch, s))


def embeddings_offloaded(arch: Architecture, s: Settings) -> bool:
    """Whether the input embedding is in host memory (embedding_offload.offload_decision's rule): not when
    tied to the head, adapted by LoRA, or scaling its output (Gemma's): none is a plain nn.Embedding."""
    table = arch.vocab_size * arch.hidden_size * DTYPE_BYTES[s.compute_dtype]
    wanted = s.offload_embeddings == "on" or (s.offload_embeddings == "auto" and table >= embedding_offload_min_bytes())
    return (wanted and not arch.tied_embeddings and not adapts_embedding(s.lora_target_modules)
            and not input_embedding_scales(arch.model_type))


def optimizer_bytes(sizes: list[int], optim: str, param_bytes: int = 4) -> tuple[int, int]:
    """(bytes torch allocates, bytes in paged unified memory) of the optimizer state."""
    if optim == "adamw_torch":  # two moments in the parameters' dtype
        return 2 * param_bytes * sum(sizes), 0
    allocated = paged = 0
    for n in sizes:
        if n < EIGHT_BIT_MIN_NUMEL:
            allocated += 8 * n
            continue
        moments = 2 * n
        side = 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4  # fp32 absmax per 256 values, and two 256-entry maps
        if optim == "paged_adamw_8bit" and n >= PAGED_MIN_NUMEL:
            paged += moments
        else:
            allocated += moments
        allocated += side
    return allocated, paged


def staging_bytes(n_lora: int, optimizer_total: int, s: Settings) -> int:
    save_copy = s.adapter_bytes * n_lora + (0 if s.save_only_model else optimizer_total) if s.staging else 0
    return save_copy + (s.adapter_bytes * n_lora if s.rollback_copy else 0)


def layer_saved_bytes(arch: Architecture, s: Settings) -> int:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing).

    RMSNorm keeps its fp32 input (4h each); SDPA keeps q, k, v after RoPE and its output
    (a(2q + 2kv)); the gated MLP keeps the activation's input and output and the up projection
    (3aI); each adapted linear keeps the input of lora_A (a x in, a copy per adapter, since PEFT
    casts it for the fp32 adapter) plus the dropout mask (1 byte x in) when lora_dropout > 0.
    Frozen linears keep nothing: their weight gradient is never needed.
    """
    a, h, q, kv = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, arch.q_dim, arch.kv_dim
    # A compiled layer's partitioner recomputes cheap pointwise work in backward instead of saving it:
    # each RMSNorm keeps its input in the compute dtype (the fp32 upcast is redone), and the MLP keeps
    # the gate and up projections but not the SiLU product (a x I less).
    # Liger's kernels save the same as a compiled layer: the norm's input in the compute dtype (and one fp32
    # per row), and the SwiGLU's two halves, recomputing the SiLU product in backward.
    norm = a if s.compiled_layers or "rms_norm" in s.liger_kernels else 4
    total = norm * h * arch.norms_per_layer + (norm * (q + kv) if arch.qk_norm else 0)
    mlp = 2 if s.compiled_layers or "swiglu" in s.liger_kernels else 3
    total += a * (2 * q + 2 * kv) + mlp * a * arch.intermediate_size
    return total + lora_saved_bytes(arch, s)


def lora_saved_bytes(arch: Architecture, s: Settings) -> int:
    a, mask = DTYPE_BYTES[s.compute_dtype], (1 if s.lora_dropout > 0 else 0)
    # Without dropout and without a dtype cast (4-bit layers under autocast, or fp32 training), lora_A
    # reads the very tensor the base layer read, so adapters on one input share one saved copy.
    shared = mask == 0 and (s.quantization != "none" or a == 4)
    total, seen = 0, set()
    for m in adapted_linears(arch, s.lora_target_modules):
        if shared and m.reads in seen:
            continue
        seen.add(m.reads)
        total += (a + mask) * m.in_features
    return total


def working_set(arch: Architecture, s: Settings, tokens: int, checkpoint_inside: bool = False) -> int:
    """Temporaries of one layer's backward (gradients in flight), beyond what the layer saved;
    `checkpoint_inside`: the recompute runs in the compiled backward graph (compile_checkpoint)."""
    a = DTYPE_BYTES[s.compute_dtype]
    casts = s.quantization == "none" and a == 2
    coefficient = BACKWARD_FP32_CAST if casts else BACKWARD_PLAIN
    if s.compiled_layers and s.quantization != "none":
        coefficient += BACKWARD_COMPILED_QUANTIZED
    if checkpoint_inside:
        coefficient += BACKWARD_CHECKPOINT_INSIDE
    if s.compiled_layers and "swiglu" in s.liger_kernels:  # measured compiled only; eager keeps the bound
        coefficient -= LIGER_SWIGLU_IN_PLACE
    return int(coefficient * a * arch.intermediate_size * tokens) + BACKWARD_FIXED


def uses_chunked_loss(arch: Architecture) -> bool:
    """As relaytune's loss decides: a plain linear head of a listed model type, no soft-capping."""
    return arch.model_type in plain_head_types() and not arch.logit_softcapping


def loss_bytes(arch: Architecture, s: Settings, tokens: int) -> int:
    """The loss's peak, plus the decoder's last hidden states around it.

    Chunked: one chunk of labelled tokens at a time (fp32 logits; see the module's docstring). Otherwise
    the model's own forward: logits for every position in the compute dtype, upcast to fp32.
    """
    a, h, v = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, arch.vocab_size
    labelled = max(1, int(tokens * s.labelled_fraction))
    # The final norm keeps its fp32 input; the labelled rows are gathered and get a gradient.
    around = tokens * h * (4 + a) + labelled * h * a
    if uses_chunked_loss(arch):
        per_logit = LOSS_BYTES_PER_LOGIT if s.loss_recomputed else FUSED_LOSS_BYTES_PER_LOGIT
        return around + min(s.chunk_tokens, labelled) * v * per_logit
    return around + tokens * v * (LOSS_BYTES_PER_LOGIT + a)


def describe_parts(arch: Architecture, s: Settings, tokens: int, n_lora: int, paged: int, gc: bool) -> dict:
    quant = {"none": f"all in {s.compute_dtype}", "int8": "linear layers in int8",
             "nf4": f"linear layers in NF4{' (double quant)' if s.double_quant else ''}",
             "fp4": "linear layers in FP4"}[s.quantization]
    rest = "" if s.quantization == "none" else \
        f", embeddings{'' if arch.tied_embeddings else ' and head'} in {s.compute_dtype}"
    if embeddings_offloaded(arch, s):
        rest += "; the input embedding in CPU memory (offload_embeddings)"
    if s.shards > 1:
        rest += f"; sharded over {s.shards} GPUs (FSDP), the head whole, two layers gathered at once"
    adapter = "fp32" if s.adapter_bytes == 4 else "bf16"
    opt = {"adamw_torch": f"two {adapter} moments", "adamw_8bit": "8-bit moments",
           "paged_adamw_8bit": "8-bit moments"}[s.optim]
    if paged:
        opt += f"; {paged / GIB:.2f} GiB more is paged (outside torch's count)"
    if uses_chunked_loss(arch):
        chunk = min(s.chunk_tokens, max(1, int(tokens * s.labelled_fraction)))
        how = "recomputed per chunk" if s.loss_recomputed else "gradient computed in forward"
        loss = f"{chunk:,} labelled tokens x {arch.vocab_size:,} vocab in fp32, {how}"
    else:
        loss = f"full logits of {tokens:,} tokens x {arch.vocab_size:,} ({arch.model_type} gets no chunked loss)"
    saved = ("each layer's input per token (checkpointing)" if gc
             else "every layer's activations (no checkpointing)")
    if gc and s.offload_activations:
        saved = ("the layer inputs are in pinned CPU memory (offload_activations); what stays on the GPU per "
                 "token, as measured")
    staging = "a save's GPU copy of adapter + optimizer" if s.staging else ""
    if s.rollback_copy:
        staging += (" + " if staging else "") + "the initial adapter (NaN rollback)"
    return {"frozen weights": quant + rest, "LoRA parameters": f"{n_lora / 1e6:.1f} M in {adapter}",
            "LoRA gradients": adapter, "optimizer state": opt, "checkpoint staging": staging,
            "saved activations": saved, "recomputed layer": "one layer's activations, rebuilt in backward",
            "backward working set": "gradients in flight in one layer's backward", "loss": loss,
            "prefetched layer input": "the next layer's input, copied back from the host ahead of its backward",
            "last layer input": "the last decoder layer's input, kept on the GPU for its backward",
            "CUDA graphs": "what graphs added to the peak where measured (up to 0.13 GiB)"}
