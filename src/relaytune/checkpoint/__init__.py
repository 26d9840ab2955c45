"""Checkpoints: the commit protocol, training state on disk, resume, retention, best and mirror."""

from relaytune.atomic import TMP_PREFIX, verify

__all__ = ["TMP_PREFIX", "verify"]
