"""The typed run configuration: the single source of truth for every setting.

Each field's docstring is its `--help` text. Names follow Hugging Face
TrainingArguments / SFTConfig where one exists, with the same meaning.
Loading (YAML, overrides, error messages) lives in `config_loader`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from relaytune.config.checks import (
    RANGES,
    check_mirror_url,
    check_range,
    duration_text,
    iso_text,
    parse_timestamp,
    refuse_contradictions,
    settle_global_batch,
    tracker_names,
)
from relaytune.config.datasets import DatasetSource, Format, check_columns

BUILTIN_MODEL = "builtin:SmolLM2-135M-Instruct"

# Keys that may be written under another name, as in TRL / axolotl configs.
ALIASES = {
    "model_name_or_path": "model",
    "base_model": "model",
    "max_length": "max_seq_length",
}


class TrainConfig(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` in any float setting is refused with its key named.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False, allow_inf_nan=False)

    # --- what to train -------------------------------------------------------
    model: str = BUILTIN_MODEL
    """Base model: a Hub id, a local folder, a .gguf file, or the built-in default
    `builtin:SmolLM2-135M-Instruct` (aliases: model_name_or_path, base_model)."""
    dataset: str | list[str | DatasetSource]
    """Training data: a .jsonl/.json/.csv/.parquet file, a folder of them, a saved `datasets`
    folder, or a Hub dataset id (id:split for a split). To mix several: a list of
    {path, weight, split, subset, format, columns}; weight 2 uses each row twice per epoch, 0.3 a
    seeded 30% of the rows."""
    output_dir: str
    """Run folder: checkpoints/, final/ and metrics.jsonl live here. Re-running continues the run in it.
    Relative paths (here, in dataset, model, eval_dataset, chat_template, mirror_to,
    resume_from_checkpoint) count from the config file's folder; given as key=value, from the
    working directory."""
    trust_remote_code: bool = False
    """Run Python code shipped with a Hub model. Off by default: that code runs with your
    permissions. Turn on only for a model you trust that needs it."""

    # --- data ------------------------------------------------------------------
    max_seq_length: int = 1024
    """Longest sequence in tokens (alias max_length); longer rows: see on_long_rows."""
    dataset_text_field: str = "text"
    """Column that holds plain text, for plain-text data."""
    train_on_inputs: bool = False
    """Compute the loss on prompt tokens too. Off: loss only on assistant / response tokens."""
    packing: bool = False
    """Pack several short rows into one sequence of max_seq_length tokens (best-fit decreasing,
    fixed by the seed). Packed rows never attend to each other: each has its own positions."""
    val_set_size: float = 0.0
    """Hold out part of the training data for evaluation: a fraction (<1) or a row count (>=1)."""
    eval_dataset: str | None = None
    """A separate evaluation data file; overrides val_set_size."""
    dataset_format: Format = "auto"
    """Row format: auto (recognised per row), text, alpaca (instruction/input/output, optional
    system), messages (OpenAI role/content), sharegpt (conversations of from/value), or
    prompt_completion (strings, or lists of messages)."""
    dataset_columns: dict[str, str] | None = None
    """Your column names for the standard fields, e.g. {instruction: question, output: answer}.
    Fields: text, instruction, input, output, system, prompt, completion, messages,
    conversations, role, content, from, value."""
    chat_template: str | None = None
    """Chat template for chat rows. Unset: the tokenizer's own (a plain '### Role:' format if it
    has none). Or a name: chatml, llama3, gemma, mistral, phi3, zephyr, plain; or a .jinja file."""
    on_long_rows: Literal["truncate", "drop", "error"] = "truncate"
    """Rows longer than max_seq_length: truncate them, drop them (listed in quarantine.jsonl),
    or stop with an error that names them."""
    max_bad_fraction: float = 0.01
    """Stop before training when more than this fraction of rows is unusable (0 to 1). Bad rows
    are listed in output_dir/quarantine.jsonl with file:line and reason."""
    dataset_cache: bool = True
    """Cache the tokenized data in output_dir/data-cache/, so that a resumed run, in any new
    session, does not tokenize again. Any change that matters re-tokenizes."""

    @field_validator("dataset_columns")
    @classmethod
    def _columns(cls, v):
        return check_columns(v)

    @field_validator("dataset")
    @classmethod
    def _some_data(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the list of datasets is empty")
        return v

    @field_validator("max_bad_fraction")
    @classmethod
    def _bad_fraction(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError("must be between 0 and 1")
        return v

    # --- schedule --------------------------------------------------------------
    num_train_epochs: float = 3.0
    """Passes over the training data (fractions allowed). Ignored when max_steps > 0."""
    max_steps: int = -1
    """Total optimizer steps; -1 means derive from num_train_epochs."""
    per_device_train_batch_size: int | Literal["auto"] = 8
    """Rows per forward pass (the micro-batch). Only decides how a global batch is split.
    auto: the largest that fits this GPU (planned from its free memory, then confirmed by one trial
    step at start-up that bisects down on an out-of-memory), with global_batch_size required; on the
    CPU, the largest divisor of the global batch up to 8. The choice is printed in the preflight
    table and kept in the checkpoint: a resume on the same GPU does not probe again."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Global batch = per_device_train_batch_size x this.
    With per_device_train_batch_size: auto it follows from the micro-batch chosen; leave it out."""
    global_batch_size: int | None = None
    """Rows per optimizer step (what the maths depends on). Required with
    per_device_train_batch_size: auto. With a fixed micro-batch it may replace
    gradient_accumulation_steps (which becomes global_batch_size / micro-batch; it must divide).
    Unset: per_device_train_batch_size x gradient_accumulation_steps, as in Hugging Face."""
    learning_rate: float = 2e-4
    """Peak learning rate of the AdamW optimizer."""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule after warmup."""
    warmup_ratio: float = 0.0
    """Fraction of the total steps spent warming up linearly from 0."""
    warmup_steps: int = 0
    """Warmup length in steps; overrides warmup_ratio when > 0."""
    weight_decay: float = 0.0
    """Decoupled AdamW weight decay on the trainable weight matrices."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    optim: Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = "adamw_torch"
    """Optimizer. adamw_torch is torch's AdamW, as one fused kernel on a GPU (Hugging Face's default
    there too; the same update up to float rounding); the 8-bit ones (bitsandbytes) keep their state in
    8 bits."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    seed: int = 42
    """Seed for initialisation, data order and dropout."""

    # --- precision and memory --------------------------------------------------
    bf16: bool | None = None
    """bfloat16 mixed precision. Unset: on where the GPU supports it. A GPU without bf16
    (a T4) gets fp16 instead, with a notice."""
    fp16: bool | None = None
    """float16 mixed precision with a gradient scaler. Unset: on for GPUs without bf16."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in backward to save memory (always the non-reentrant kind).
    auto: off when the memory planner says the activations fit this GPU with a 10% margin (faster:
    no recomputation, +51% tokens/s measured for Qwen2.5-3B LoRA on an H200), else on; printed in
    the preflight table. On the CPU auto is off (the planner models GPUs only)."""
    load_in_4bit: bool = False
    """Load the base model in 4 bits (QLoRA) with bitsandbytes."""
    load_in_8bit: bool = False
    """Load the base model in 8 bits with bitsandbytes."""
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type."""
    bnb_4bit_use_double_quant: bool = True
    """Quantize the 4-bit quantization constants too (saves about 0.4 bit per weight)."""
    bnb_4bit_compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Compute dtype for 4-bit layers; auto follows the mixed-precision choice."""
    bnb_4bit_quant_storage: Literal["auto", "uint8", "bfloat16", "float16", "float32"] = "auto"
    """The dtype that holds the packed 4-bit values (the values are the same): auto = uint8, or
    under FSDP the model's parameter dtype, which FSDP needs to shard them (uint8 is refused there)."""
    torch_compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer with torch.compile (regional compilation; gradient checkpointing
    kept). auto: on for CUDA GPUs of compute capability 7.0+ with torch 2.6+, off on the CPU (so CPU
    runs stay bit for bit reproducible). 4-bit (QLoRA) layers then dequantize in generated kernels,
    to bitsandbytes' values bit for bit. The first step takes longer (the warm-up is printed); a
    compile error falls back to eager with a warning. Results equal eager within rounding, not bit
    for bit, so changing this on resume is allowed."""
    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay the compiled decoder layers as CUDA graphs: one launch instead of each kernel's, where
    the host's launching bounds the step (a small model or short batches on a fast GPU: Qwen2.5-3B
    QLoRA at seq 512 ran 2.4x the tokens/s on an H200). Costs a longer warm-up, and memory for the
    graphs' pool: +0.13 GiB there at seq 2048, none measured at seq 512.
    Needs torch_compile, gradient_checkpointing: true, packing and one GPU. auto: on in bf16 where a
    layer's forward at the GPU's peak takes under 1.5 ms (the host bounds it), else off. Same maths, so
    changing it on resume is allowed."""
    compile_checkpoint: bool | Literal["auto"] = "auto"
    """Compile each decoder layer's gradient checkpoint with the layer, so backward recomputes only what
    it reads (H200: Llama-3-8B QLoRA 8.7% faster, for a backward peak 0.64 GiB higher). Needs
    torch_compile and gradient_checkpointing; not with cuda_graphs or offload_activations, nor where a
    4-bit layer runs bitsandbytes' own matmul (an FSDP shard), whose dequantized weight it would keep
    for backward. auto: on where offload_embeddings moves the input embedding to CPU memory, which
    pays for it, unless the memory plan at the micro-batch in force says it would not fit the GPU
    with a 10% margin (then off from the start). An OOM moves the checkpoint outside and redoes the
    step at the same micro-batch.
    Equal within rounding, so changing it on resume is allowed."""
    offload_embeddings: bool | Literal["auto"] = "auto"
    """Keep a frozen input embedding not tied to the output head in CPU memory; each batch copies only
    its rows to the GPU (the same values). Llama-3-8B's is 0.98 GiB of GPU memory. auto: on for CUDA
    runs when the table is at least 256 MiB, not under FSDP. Changing it on resume is allowed."""
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention for packed batches. flex: FlexAttention with one document mask per batch (packed
    samples never see each other), on CUDA GPUs of compute capability 7.5+ (a T4 or newer); varlen:
    FlashAttention's variable-length kernel over each batch's documents (torch.nn.attention.varlen),
    on CUDA GPUs of compute capability 8.0+ (A100, L4, H100) in bf16 or fp16, not with CUDA graphs;
    sdpa: PyTorch's scaled_dot_product_attention, with a mask of the documents. auto: flex on GPUs
    with Hopper's shared memory per block (H100, H200, B200; measured faster there), sdpa elsewhere
    (flex's kernels have failed to compile on GPUs with less). Unpacked (padded) batches always keep
    SDPA. Equal within rounding, so changing it on resume is allowed."""
    offload_activations: bool = False
    """Keep each checkpointed decoder layer's input in pinned CPU memory, not on the GPU, and copy it
    back when backward recomputes that layer (as Unsloth and torchtune offer). Saves hidden size x 2
    bytes per token per layer (Llama-3-8B at seq 2048: 0.5 GiB per row of the micro-batch) for PCIe
    traffic each step, which a side CUDA stream overlaps with the layers' compute (the next layer's input
    is copied back ahead). Needs gradient_checkpointing. Same maths, so changing it on resume is allowed."""
    liger_kernels: list[Literal["rms_norm", "swiglu"]] = []
    """Liger's Triton kernels for the decoder layers' SwiGLU MLP and RMSNorm (LoRA keeps the gate, up and
    down layers), for less activation memory at fewer tokens/s. [swiglu] is the one that saves: H100, with
    offload_activations, Qwen2.5-3B QLoRA seq 2048 3.97 -> 3.51 GiB at 5% fewer tokens/s; rms_norm adds
    no saving to compiled layers (the default on a GPU) and costs 2% more. Llama, Mistral, Qwen2 and
    Qwen3 models on CUDA GPUs, with the liger-kernel package; the checkpoint stays outside the compiled
    layers, and CUDA graphs stay off. The memory plan counts SwiGLU's saving at the least measured. Same
    maths within rounding, so changing it on resume is allowed."""
    adapter_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the LoRA weights, their gradients and their AdamW state. bfloat16 halves that memory
    (Llama-3-8B all-linear r16: 0.31 GiB) as TRL and the QLoRA reference code do for 4-bit bases,
    but rounds away updates smaller than 1/256 of a weight; float32 keeps them. Not with fp16 training
    (a T4): its gradient scaler takes fp32 adapters."""

    # --- LoRA ------------------------------------------------------------------
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    lora_target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: a list of names, or all-linear (every linear layer but the head)."""

    # --- recovery inside the run --------------------------------------------------
    max_bad_steps: int = 3
    """After this many optimizer steps in a row with a NaN/Inf loss or gradient (each one is
    skipped, not applied), roll back to the last checkpoint (see on_repeated_nan)."""
    on_repeated_nan: Literal["lower_lr", "stop"] = "lower_lr"
    """lower_lr: roll back and continue with the learning rate times nan_lr_factor;
    stop: roll back and stop with a diagnosis."""
    nan_lr_factor: float = 0.5
    """Learning-rate multiplier applied at each NaN rollback."""

    # --- logging, evaluation, checkpoints ----------------------------------------
    logging_steps: int = 10
    """Write a metrics.jsonl record every this many steps."""
    eval_steps: int | None = None
    """Evaluate every this many steps (needs eval data). Unset: evaluate at the end only."""
    save_steps: int = 500
    """Commit a checkpoint every this many steps."""
    save_every_seconds: float = 30.0
    """Also commit a checkpoint when this many seconds passed since the last one; 0 disables.
    A kill loses at most this much work."""
    save_total_limit: int | None = 3
    """Keep the newest this many checkpoints (plus the best by eval loss). Unset keeps all."""
    save_only_model: bool = False
    """Leave the optimizer state out of checkpoints. Smaller, but a resume restarts AdamW's
    moments, so it is no longer exact."""
    resume_from_checkpoint: bool | str = "auto"
    """auto: continue from the newest valid checkpoint; a path: continue from it;
    false: refuse to touch an existing run (use --fresh to start over)."""
    mirror_to: str | None = None
    """Copy each committed checkpoint to durable storage in the background: a folder (e.g. a
    mounted Google Drive) or an fsspec URL (s3://, gs://, hf://). A new session with an empty
    output_dir restores from it. Credentials never go in the URL (it is saved in every
    checkpoint): give them through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
    HF_TOKEN) or the storage library's own config (~/.aws/credentials, gcloud)."""
    deadline: str | None = None
    """Stop, save and exit 75 before this wall-clock time (ISO 8601, e.g. 2026-12-01T06:00:00Z,
    quoted or not); a time without a zone is local time."""
    time_limit: str | None = None
    """Stop, save and exit 75 before this much wall time has passed: 11h30m, 90m, 45s, 1d, or
    plain seconds (3600)."""

    # --- several GPUs --------------------------------------------------------------
    num_gpus: Literal["auto"] | int = "auto"
    """How many GPUs (processes) train this run on this machine: auto = every visible CUDA GPU
    (1 on a machine without one), or a number. With more than 1, relaytune starts the workers
    itself through torch's elastic agent (the engine behind torchrun); under an external
    torchrun it joins instead. The global batch (per_device_train_batch_size x
    gradient_accumulation_steps) stays the same on any count: each GPU takes its share, so a
    run may continue on another number of GPUs. On a CPU, a number above 1 runs that many
    processes with the gloo backend (for tests)."""
    max_restarts: int = 3
    """With several GPUs: how many times a crashed worker (killed by the kernel, an unexpected
    error) brings every worker back from the last committed checkpoint within the same command."""
    fsdp: Literal["auto"] | bool = "auto"
    """Shard the frozen base weights over the GPUs with FSDP2 (fully_shard per decoder layer):
    true, false (every GPU holds the whole base; LoRA gradients are summed across GPUs), or auto
    (shard when the base's weights would fill more than 80% of a GPU). The LoRA weights, the
    optimizer and the checkpoint are the same either way, so a run may change this between
    sessions. Under FSDP an out-of-memory error restarts the workers from the last checkpoint with
    half the micro-batch. 4-bit bases are sharded with a float bnb_4bit_quant_storage; 8-bit
    bases cannot be."""

    # --- looking inside a run: trackers and the best checkpoint --------------------
    report_to: str | list[str] = "none"
    """Experiment trackers besides metrics.jsonl (always written): none, tensorboard, wandb,
    trackio, mlflow, all, or a list. A resumed run continues the same tracker run at the right
    step. A tracker that fails to import or to connect is warned about once; training goes on."""
    run_name: str | None = None
    """Name of the run in trackers. Unset: the output_dir folder name."""
    load_best_model_at_end: bool = False
    """End with the adapter of the lowest eval loss in final/ (needs eval data). Either way
    best/ holds the best adapter and final/ the chosen one."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, v):
        return tracker_names(v)

    @field_validator("model", "dataset", "output_dir")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not str(v).strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("per_device_train_batch_size", "global_batch_size")
    @classmethod
    def _positive_or_auto(cls, v, info: ValidationInfo):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1" + (" (or auto)" if info.field_name != "global_batch_size" else ""))
        return v

    @field_validator(
        "gradient_accumulation_steps", "max_seq_length",
        "lora_r", "lora_alpha", "logging_steps", "save_steps", "max_bad_steps",
    )
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("learning_rate", "num_train_epochs")
    @classmethod
    def _positive_float(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be greater than 0")
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _duration(cls, v):
        return duration_text(v)

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, v, info: ValidationInfo):
        return check_range(info.field_name, v)

    @field_validator("mirror_to")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        return check_mirror_url(v)

    @field_validator("deadline", mode="before")
    @classmethod
    def _timestamp_text(cls, v):
        return iso_text(v)

    @field_validator("deadline")
    @classmethod
    def _timestamp(cls, v: str | None) -> str | None:
        if v is not None:
            parse_timestamp(v)
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> TrainConfig:
        refuse_contradictions(self)
        settle_global_batch(self)
        return self

    @property
    def micro_batch_hint(self) -> int:
        """The configured micro-batch; with auto (chosen only when training starts), a stand-in for
        figures that need one (evaluation, padding statistics): the largest divisor of the global batch up to 8."""
        if self.per_device_train_batch_size != "auto":
            return self.per_device_train_batch_size
        return max(d for d in range(1, min(8, self.global_batch_size) + 1) if self.global_batch_size % d == 0)
