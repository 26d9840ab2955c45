"""relaytune: LoRA/QLoRA fine-tuning that survives losing the GPU.

Re-run the same command and the run continues exactly where it was.
"""

__version__ = "0.1.0"


def train(config=None, /, **kwargs):
    """Train, or continue the run in the config's output_dir. See `relaytune train --help`."""
    from relaytune.training.recipe import train as _train

    return _train(config, **kwargs)


__all__ = ["train", "__version__"]
