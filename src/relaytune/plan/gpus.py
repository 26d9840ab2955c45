"""The GPUs users train on: usable memory, bf16 support and dense peak TFLOP/s, plus `NAME:GiB` custom cards."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from relaytune.errors import UserError

# What one process has to work with outside torch's allocator: the CUDA context with cuBLAS/cuDNN
# loaded. It counts in nvidia-smi and against the card, never in torch.cuda.max_memory_allocated().
CUDA_CONTEXT_GIB = 0.5


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what the card offers one process (torch's total_memory), CUDA context included
    bf16: bool
    tflops: float | None  # dense peak of the training dtype (bf16, or fp16 without bf16); None: not known
    note: str = ""
    compiles: bool = True  # Triton runs here (compute capability 7.0+), so torch_compile: auto compiles layers

    @property
    def torch_budget_gib(self) -> float:
        """What torch's allocator can get: the card's memory less the CUDA context."""
        return self.memory_gib - CUDA_CONTEXT_GIB

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16"


# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, for bf16 where the card has it and fp16
# otherwise; the P100 has no tensor cores (its fp16 vector peak). Memory is what torch reports for the
# card, rounded down, except the T4: 15 GiB, of which 14.5 GiB is left to torch after the CUDA context.
TABLE: dict[str, Gpu] = {g.name: g for g in (
    Gpu("T4", 15.0, False, 65.0, "Kaggle and Colab's free card"),
    Gpu("P100", 15.9, False, 18.7, "Kaggle's other card; no tensor cores", compiles=False),
    Gpu("L4", 22.0, True, 121.0),
    Gpu("A10G", 22.0, True, 70.0, "AWS g5 instances"),
    Gpu("A100-40", 39.4, True, 312.0),
    Gpu("A100-80", 79.1, True, 312.0),
    Gpu("H100", 79.1, True, 989.0, "SXM; the PCIe card is about 25% slower"),
    Gpu("H200", 139.8, True, 989.0),
)}

ALIASES = {"A100": None, "A100-40GB": "A100-40", "A100-80GB": "A100-80", "A100_40": "A100-40", "A100_80": "A100-80",
           "TESLA-T4": "T4", "TESLA T4": "T4", "NVIDIA-H200": "H200", "NVIDIA-H100": "H100", "H100-80": "H100"}


def names() -> list[str]:
    return list(TABLE)


def parse_gpu(text: str) -> Gpu:
    """A table name (case-insensitive), or `NAME:GiB` for a card with that much memory.

    A known NAME keeps its bf16 support and speed with the new memory (e.g. `T4:14.5`); an unknown
    NAME is assumed to have bf16, and its speed is not known.
    """
    raw = str(text).strip()
    name, _, size = raw.partition(":")
    known = _lookup(name)
    if not size:
        if known is None:
            raise UserError(_unknown(raw))
        return known
    try:
        gib = float(size.strip().lower().removesuffix("gib").removesuffix("gb"))
    except ValueError:
        raise UserError(f"--gpu {raw}: after the colon put the card's memory in GiB, e.g. {name or 'MYCARD'}:24") \
            from None
    if not 1 <= gib <= 4096 or not re.fullmatch(r"[A-Za-z0-9 _.+-]+", name.strip() or "?"):
        raise UserError(f"--gpu {raw}: write NAME:GiB with a memory between 1 and 4096 GiB, e.g. RTX4090:24")
    if known is not None:
        return replace(known, name=f"{known.name} ({gib:g} GiB)", memory_gib=gib)
    return Gpu(name.strip(), gib, True, None, "a custom card: bf16 assumed, speed not known")


def _lookup(name: str) -> Gpu | None:
    key = name.strip().upper()
    if key in ALIASES:
        return TABLE.get(ALIASES[key]) if ALIASES[key] else None
    return next((g for n, g in TABLE.items() if n.upper() == key), None)


def _unknown(raw: str) -> str:
    hint = " (A100 comes as A100-40 and A100-80)" if raw.strip().upper() == "A100" else ""
    return (f"--gpu {raw}: unknown GPU{hint}. Known: {', '.join(TABLE)}; or NAME:GiB for another card, "
            "e.g. RTX4090:24")
