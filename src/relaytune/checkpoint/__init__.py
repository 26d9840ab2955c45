"""Checkpoints: the commit protocol, training state on disk, resume, retention, best and mirror.

The trainer talks to `Checkpointer` alone; the modules beside it are its parts.
"""

from relaytune.atomic import TMP_PREFIX, verify
from relaytune.checkpoint.checkpointer import Checkpointer
from relaytune.checkpoint.state import Live, TrainState

__all__ = ["TMP_PREFIX", "Checkpointer", "Live", "TrainState", "verify"]
