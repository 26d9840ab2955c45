"""The speed and placement settings may change between sessions (checkpoint/resume.config_changes):
they change kernels or where frozen tensors live, not the maths; a change of the LoRA maths still stops."""

from __future__ import annotations

from relaytune.checkpoint.resume import config_changes
from relaytune.config.schema import TrainConfig


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(model="m", dataset="d.jsonl", output_dir="run", **kw)


def test_compile_checkpoint_and_offload_embeddings_change_on_resume_as_harmless():
    saved = _cfg().model_dump(mode="json")
    breaking, harmless = config_changes(saved, _cfg(compile_checkpoint=False, offload_embeddings=True))
    assert breaking == []
    assert harmless == ["compile_checkpoint 'auto' -> False", "offload_embeddings 'auto' -> True"]
    breaking, _ = config_changes(saved, _cfg(lora_r=8))
    assert breaking == ["`lora_r`: 16 -> 8"]
