"""Value checks the schema applies: per field (ranges, sane caps, credentials in URLs, times, tracker
names) and across fields (refuse_contradictions).

Each cap says why: a value past it either crashes later (an allocation, an overflow, a
library's own refusal mid-run) or cannot be meant, and refusing it up front gives exit 2
with the key named instead of a traceback an hour in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime
from typing import Any

from relaytune.redact import secret_query_params, url_userinfo

MAX_STEPS = 2**31 - 1
MAX_EPOCHS = 1_000_000
MAX_RANK = 4096
MAX_ALPHA = 2 * MAX_RANK
MAX_SEQ = 1_048_576
MAX_BATCH = 65_536
MAX_SEED = 2**32 - 1
MAX_LR = 1e30

_TYPO = "a value this large is a typo"

# key -> (is the value fine?, what to write instead). Non-finite floats are refused by the
# schema's allow_inf_nan=False before these run.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "adam_beta1": (lambda v: 0 <= v < 1, "must be at least 0 and below 1 (torch's AdamW refuses others)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "must be at least 0 and below 1 (torch's AdamW refuses others)"),
    "adam_epsilon": (lambda v: v > 0, "must be greater than 0: it keeps AdamW's update from dividing by zero"),
    "seed": (lambda v: 0 <= v <= MAX_SEED,
             f"must be between 0 and {MAX_SEED} (2**32-1, the largest seed numpy accepts)"),
    "weight_decay": (lambda v: v >= 0, "must be 0 or more"),
    "learning_rate": (lambda v: v <= MAX_LR, f"must be at most {MAX_LR:g}: a larger rate overflows AdamW's "
                      "float32 state at once (LoRA rates are usually 1e-5 to 1e-3)"),
    "max_grad_norm": (lambda v: v >= 0, "must be 0 (no clipping) or more; a negative norm flips the gradient"),
    "val_set_size": (lambda v: v >= 0, "must be 0 (none), a fraction below 1, or a row count"),
    "num_train_epochs": (lambda v: v <= MAX_EPOCHS, f"must be at most {MAX_EPOCHS:,}; {_TYPO}"),
    "max_steps": (lambda v: v <= MAX_STEPS,
                  f"must be at most {MAX_STEPS:,} (2**31-1): years of training at any speed; {_TYPO}"),
    "warmup_steps": (lambda v: 0 <= v <= MAX_STEPS, f"must be between 0 and {MAX_STEPS:,}"),
    "lora_r": (lambda v: v <= MAX_RANK,
               f"must be at most {MAX_RANK}: a rank past the model's hidden size is no longer "
               "low-rank, and a huge one only allocates adapter matrices until memory runs out"),
    "lora_alpha": (lambda v: v <= MAX_ALPHA,
                   f"must be at most {MAX_ALPHA} (twice the largest rank, the usual alpha = 2 x r): "
                   "a larger scale sends the adapter's output to inf"),
    "max_seq_length": (lambda v: v <= MAX_SEQ,
                       f"must be at most {MAX_SEQ:,} tokens: no model's positions reach further, and "
                       "buffers of this length are allocated up front"),
    "per_device_train_batch_size": (lambda v: v == "auto" or v <= MAX_BATCH,
                                    f"must be at most {MAX_BATCH:,} rows per forward pass; {_TYPO}"),
    "gradient_accumulation_steps": (lambda v: v <= MAX_BATCH,
                                    f"must be at most {MAX_BATCH:,} micro-batches per step; {_TYPO}"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "must be between 0 and 1 (excluded)"),
    "lora_dropout": (lambda v: 0 <= v < 1, "must be between 0 and 1 (excluded)"),
    "nan_lr_factor": (lambda v: 0 < v < 1, "must be between 0 and 1 (excluded)"),
    "num_gpus": (lambda v: v == "auto" or v >= 1, "must be auto or at least 1"),
    "max_restarts": (lambda v: v >= 0, "must be 0 or more"),
}


def check_range(key: str, value: Any) -> Any:
    """`value` if it is in range for `key`, else ValueError with what to write instead."""
    fine, message = RANGES[key]
    if value is not None and not fine(value):
        raise ValueError(message)
    return value


def iso_text(value: Any) -> Any:
    """A datetime or date (YAML or Python gave one) as ISO 8601 text; anything else unchanged."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value


# Where each storage library looks for credentials, by URL scheme.
_CREDENTIALS_GO = {
    "s3": "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or "
          "~/.aws/credentials, which s3fs reads",
    "gs": "the environment (GOOGLE_APPLICATION_CREDENTIALS=/path/key.json) or "
          "`gcloud auth application-default login`, which gcsfs reads",
    "hf": "the environment (HF_TOKEN) or `hf auth login`, which huggingface_hub reads",
    "az": "the environment (AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
          "AZURE_STORAGE_SAS_TOKEN), which adlfs reads",
}
_SCHEME_FAMILY = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "adl": "az"}


def check_mirror_url(value: str | None) -> str | None:
    """Refuse a `mirror_to` URL that carries credentials, saying where they belong instead.

    The setting is saved in every checkpoint and printed in notices, so a secret in it would
    leak; the message itself never repeats the URL.
    """
    if not value or "://" not in value:
        return value
    scheme = value.split("://", 1)[0].lower()
    found = []
    userinfo = url_userinfo(value)
    if ":" in userinfo or (userinfo and scheme not in ("sftp", "ssh", "ftp", "smb")):
        found.append("a user:password before the @")
    params = secret_query_params(value)
    if params:
        found.append(f"the query parameter{'s' if len(params) > 1 else ''} {', '.join(params)}")
    if not found:
        return value
    family = _SCHEME_FAMILY.get(scheme, scheme)
    where = _CREDENTIALS_GO.get(family, "the environment or the storage library's own config file")
    raise ValueError(
        f"the URL holds credentials ({'; '.join(found)}), which would be saved in every checkpoint "
        f"and printed. Remove them from the URL and give them through {where}")


_DURATION_FORMS = "write e.g. 11h30m, 90m, 45s, 1d, or plain seconds (3600)"


def duration_text(value: Any) -> str | None:
    """time_limit as text that parse_duration reads; a bare number is seconds, as the same digits
    quoted already were (YAML and overrides give 3600 as an int, and refusing it as "not a string"
    said nothing about what to write)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"a duration is text or a number of seconds, not a {type(value).__name__}; "
                         f"{_DURATION_FORMS}")
    parse_duration(text)
    return text


def parse_duration(text: str) -> float:
    """'11h30m', '90m', '45s', '2h', or plain seconds -> seconds."""
    import re

    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", s)
    if not s or not parts or not any(parts.groups()):
        raise ValueError(f"{text!r} is not a duration; {_DURATION_FORMS}")
    d, h, m, sec = (int(g or 0) for g in parts.groups())
    return float(((d * 24 + h) * 60 + m) * 60 + sec)


def parse_timestamp(text: str) -> float:
    """ISO 8601 time -> Unix seconds; a time without a zone is local time."""
    try:
        return datetime.fromisoformat(str(text).strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO 8601 time; write e.g. 2026-12-01T06:00:00Z") from None


def tracker_names(value: Any) -> str | list[str]:
    """report_to as one name or a list of them: "a,b" and lists split, case folded, all expanded, none
    dropped; ValueError for an unknown tracker."""
    names = [value] if isinstance(value, str) else list(value or ["none"])
    names = [n.strip().lower() for item in names for n in str(item).split(",") if n.strip()]
    known = ("tensorboard", "wandb", "trackio", "mlflow")
    if "all" in names:
        names = list(known)
    bad = [n for n in names if n not in known + ("none",)]
    if bad:
        raise ValueError(f"unknown tracker {bad[0]!r}; choose from none, {', '.join(known)}, all")
    names = [n for n in names if n != "none"]
    return names if len(names) > 1 else (names[0] if names else "none")


def refuse_contradictions(cfg) -> None:
    """Settings that are each valid but cannot hold together; a ValueError names them."""
    if cfg.load_best_model_at_end and not (cfg.eval_dataset or cfg.val_set_size > 0):
        raise ValueError("load_best_model_at_end needs eval data: set eval_dataset or val_set_size")
    if cfg.fp16 and cfg.bf16:
        raise ValueError("fp16 and bf16 are both true; choose one (or leave both unset for auto)")
    if cfg.load_in_4bit and cfg.load_in_8bit:
        raise ValueError("load_in_4bit and load_in_8bit are both true; choose one")
    if cfg.fsdp is True and cfg.load_in_8bit:
        raise ValueError("fsdp: true cannot shard an 8-bit base (load_in_8bit); use load_in_4bit, "
                         "or fsdp: false to replicate it on every GPU")
    if cfg.fsdp is True and cfg.load_in_4bit and cfg.bnb_4bit_quant_storage == "uint8":
        raise ValueError("fsdp: true needs a float bnb_4bit_quant_storage (uint8 is turned into plain "
                         "tensors by FSDP and trains silently to loss 0 or NaN); set it to auto")
    if cfg.eval_steps is not None and cfg.eval_steps < 1:
        raise ValueError("eval_steps must be at least 1 (or unset)")
    if not cfg.save_every_seconds >= 0:
        raise ValueError("save_every_seconds must be 0 (off) or positive")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise ValueError("save_total_limit must be at least 1 (or unset to keep all)")
    if cfg.fp16 and cfg.adapter_dtype == "bfloat16":
        raise ValueError("adapter_dtype: bfloat16 needs bf16 (or fp32) training, and fp16: true trains with a "
                         "gradient scaler; set adapter_dtype: float32")
    if cfg.offload_activations and cfg.gradient_checkpointing is False:
        raise ValueError("offload_activations: true moves the checkpointed layer inputs to the CPU, so it "
                         "needs gradient_checkpointing: true (or auto)")
    if cfg.cuda_graphs is True:
        _check_cuda_graphs(cfg)
    if cfg.compile_checkpoint is True:
        _check_compile_checkpoint(cfg)


def _check_compile_checkpoint(cfg) -> None:
    """compile_checkpoint: true with a setting that keeps the checkpoint out of the compiled layer."""
    needs = {"torch_compile: true (or auto)": cfg.torch_compile is not False,
             "gradient_checkpointing: true (or auto)": cfg.gradient_checkpointing is not False,
             "cuda_graphs: false (or auto)": cfg.cuda_graphs is not True,
             "offload_activations: false": not cfg.offload_activations,
             "liger_kernels: [] (inside the compiled checkpoint they kept 2.7x the memory)": not cfg.liger_kernels}
    missing = [name for name, ok in needs.items() if not ok]
    if missing:
        raise ValueError(f"compile_checkpoint: true compiles each layer's checkpoint with the layer, so it "
                         f"needs {', '.join(missing)}; set those, or compile_checkpoint: auto")


def _check_cuda_graphs(cfg) -> None:
    """cuda_graphs: true with a setting it cannot run beside (the machine's own limits are notices)."""
    needs = {"torch_compile: true (or auto)": cfg.torch_compile is not False,
             "gradient_checkpointing: true (or auto)": cfg.gradient_checkpointing is not False,
             "packing: true": cfg.packing, "offload_activations: false": not cfg.offload_activations,
             "attention: auto, flex or sdpa (varlen's document starts change shape with every batch)":
                 cfg.attention != "varlen",
             "liger_kernels: [] (not measured under CUDA graphs)": not cfg.liger_kernels}
    missing = [name for name, ok in needs.items() if not ok]
    if missing:
        raise ValueError(f"cuda_graphs: true replays the compiled, checkpointed layers on fixed-width packed "
                         f"batches, so it needs {', '.join(missing)}; set those, or cuda_graphs: auto")


def odd_settings(cfg) -> list[str]:
    """Settings Hugging Face accepts that are probably not what was meant: warn, don't refuse."""
    odd = []
    if cfg.max_steps > 0 and cfg.warmup_steps >= cfg.max_steps:
        odd.append(f"warmup_steps ({cfg.warmup_steps}) is not shorter than the run (max_steps "
                   f"{cfg.max_steps}): the learning rate never reaches its peak {cfg.learning_rate:g}; "
                   "training goes on as configured, as Hugging Face's Trainer does")
    return odd


def settle_global_batch(cfg) -> None:
    """global_batch_size always holds the rows per optimizer step once validated (see its docstring)."""
    micro, accum, given = (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                           cfg.global_batch_size)
    accum_set = "gradient_accumulation_steps" in cfg.model_fields_set
    if micro == "auto":
        if given is None:
            raise ValueError(
                "per_device_train_batch_size: auto needs the global batch stated as global_batch_size: N "
                "(rows per optimizer step; e.g. global_batch_size: 16). gradient_accumulation_steps "
                "cannot state it when the micro-batch is chosen for you")
        if accum_set and accum != 1:
            raise ValueError(
                f"with per_device_train_batch_size: auto, gradient_accumulation_steps ({accum}) follows from "
                f"the micro-batch chosen; remove it and keep global_batch_size: {given}")
        return
    if given is None:
        cfg.global_batch_size = micro * accum
    elif given != micro * accum:
        if accum_set or given % micro:
            raise ValueError(
                f"global_batch_size ({given}) is not per_device_train_batch_size ({micro}) x "
                f"gradient_accumulation_steps ({accum}) = {micro * accum}; give global_batch_size with "
                "the micro-batch (it must divide it) and leave gradient_accumulation_steps out, "
                "or use per_device_train_batch_size: auto")
        cfg.gradient_accumulation_steps = given // micro
