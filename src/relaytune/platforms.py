"""Which platform this process runs on (Kaggle, Colab, SLURM or a plain machine), from the environment.

Torch-free and dependency-free, so that training, the Kaggle relay in checkpoint/ and any command
can ask. Tests fake a platform by handing in a dict.
"""

from __future__ import annotations

import os
from pathlib import Path

KAGGLE_PERSISTENT = Path("/kaggle/working")  # the only folder Kaggle keeps when a session ends
COLAB_DRIVE = Path("/content/drive")


def platform(env=None) -> str:
    env = os.environ if env is None else env
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env or "COLAB_BACKEND_VERSION" in env:
        return "colab"
    if "SLURM_JOB_ID" in env:
        return "slurm"
    return "local"
