"""Plan a run before spending GPU time: peak memory by part, fit verdict, micro-batch, disk, speed and ETA.

Torch-free on purpose: `relaytune plan` answers in well under a second on any machine, and the
trainer can ask the same questions (`largest_micro_batch`, `checkpointing_off`) for
`per_device_train_batch_size: auto` and `gradient_checkpointing: auto` before loading a model.

    from relaytune.plan import make_plan, format_plan, parse_gpu
    print(format_plan(make_plan(cfg, parse_gpu("T4"))))
"""

from relaytune.plan.advice import (
                                   FITS,
                                   NO_FIT,
                                   TIGHT,
                                   Change,
                                   CheckpointingOff,
                                   changes_when_nothing_fits,
                                   checkpoint_in_force,
                                   checkpointing_off,
                                   choose_auto,
                                   fit_status,
                                   largest_micro_batch,
)
from relaytune.plan.architectures import Architecture, known_ids
from relaytune.plan.gpus import Gpu, parse_gpu
from relaytune.plan.memory import GIB, MemoryEstimate, Settings, estimate_memory
from relaytune.plan.planner import Plan, checkpoint_bytes, make_plan, settings_from_config
from relaytune.plan.report import format_plan
from relaytune.plan.sources import from_config_dict, resolve_architecture
from relaytune.plan.throughput import estimate_eta, estimate_throughput

__all__ = [
    "FITS", "GIB", "NO_FIT", "TIGHT", "Architecture", "Change", "CheckpointingOff", "Gpu", "MemoryEstimate", "Plan",
    "Settings", "changes_when_nothing_fits", "checkpoint_bytes", "checkpoint_in_force", "checkpointing_off",
    "choose_auto", "estimate_eta", "estimate_memory", "estimate_throughput", "fit_status", "format_plan",
    "from_config_dict", "known_ids", "largest_micro_batch", "make_plan", "parse_gpu", "resolve_architecture",
    "settings_from_config",
]
