"""What this machine's GPU and torch can run: the facts the speed-up decisions read.

Each answer is None or False on the CPU, so a decision made from them stays off there.
"""

from __future__ import annotations

import torch


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def capability(device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device`, None when it is not a CUDA GPU."""
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def shared_memory_per_block(device) -> int:
    """Bytes of shared memory one block may opt into on `device` (a CUDA GPU)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton as triton_found

        return bool(triton_found())
    except Exception:  # noqa: BLE001
        return False
