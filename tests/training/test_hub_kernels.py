"""The model loads and trains without the Hub's kernels: transformers 5.25 swaps layers for kernels it
fetches from the Hub wherever the `kernels` package is installed, and on a GPU again at every
`model.train()`. Offline (a lent GPU, a firewalled cluster) that raised at the first `model.train()`,
and relaytune reported it as a model that ships its own code."""

from __future__ import annotations

import pytest
import transformers.modeling_utils

from relaytune.config.schema import TrainConfig
from relaytune.model import choose_precision, load_model

# The error transformers raised on an H100 without network, from kernels' publisher check.
OFFLINE = ("Kernel repository 'kernels-community/rotary' could not verify publisher trust status. Set "
           "trust_remote_code=True or add the repository ID to the trust_remote_code allowlist to allow loading "
           "kernels from untrusted sources.")


def _offline_hub(*args, **kwargs):
    raise ValueError(OFFLINE)


@pytest.mark.skipif(not hasattr(transformers.modeling_utils, "kernelize"), reason="transformers without hub kernels")
def test_the_model_loads_and_trains_without_fetching_hub_kernels(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.modeling_utils, "kernelize", _offline_hub)
    cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"))
    model = load_model(cfg, choose_precision(cfg))
    model.train()
    model.eval()
    assert not model.use_kernels
