"""Several processes (GPUs) on one run: the launcher, the process group, and agreement.

    launch.py  `relaytune train` with num_gpus > 1: torch's elastic agent starts the workers
    world.py   rank / world size / device, the process group, small collectives
    agree.py   what every rank must decide together: stop, OOM, a non-finite step

With one process nothing here runs: no process group, no collective, the same code path as
before. Import `current()` to ask which rank this is.
"""

from relaytune.distributed.world import World, current

__all__ = ["World", "current"]
