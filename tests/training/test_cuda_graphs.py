"""When the compiled layers replay CUDA graphs (training/cuda_graphs.py), and the config's refusals.

The decision runs before any GPU work, so its CUDA cases run here with the device's name faked:
it reads only the name (for the peak) and the layer's weights.
"""

from __future__ import annotations

import pytest
import torch
from support.run_helpers import make_config

from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.layers import decoder_layers, is_compiled, layer_forward
from relaytune.model import choose_precision, load_model
from relaytune.training.cuda_graphs import AUTO_MAX_LAYER_MS, graphs_decision, layer_forward_ms

CUDA = torch.device("cuda", 0)


def _cfg(tiny_model, tmp_path, **kw) -> TrainConfig:
    base = dict(gradient_checkpointing=True, packing=True, per_device_train_batch_size=4, max_seq_length=512)
    return TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                       **{**base, **kw})


@pytest.fixture
def layers(tiny_model, tmp_path):
    cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "m"))
    return decoder_layers(load_model(cfg, choose_precision(cfg)))


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


def test_a_layer_forward_is_two_flops_per_weight_per_token_at_the_gpus_peak(layers, h200):
    weights = sum(p.numel() for p in layers[0].parameters() if p.dim() >= 2)  # the frozen and LoRA matrices
    assert weights > 0
    assert layer_forward_ms(layers[0], 2048, CUDA) == pytest.approx(2 * weights * 2048 / 989e12 * 1e3, rel=1e-12)
    assert layer_forward_ms(layers[0], None, CUDA) is None  # micro-batch still auto
    assert layer_forward_ms(layers[0], 2048, torch.device("cpu")) is None


def test_an_unknown_gpu_keeps_auto_off(layers, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert layer_forward_ms(layers[0], 2048, CUDA) is None
    assert graphs_decision(_cfg(tiny_model, tmp_path), CUDA, layers) == (False, None)


def test_auto_turns_graphs_on_where_a_layers_work_is_short_and_off_where_it_is_long(layers, tiny_model, tmp_path,
                                                                                     h200):
    assert graphs_decision(_cfg(tiny_model, tmp_path), CUDA, layers) == (True, None)  # a tiny layer: host-bound
    weights = sum(p.numel() for p in layers[0].parameters() if p.dim() >= 2)
    rows = int(AUTO_MAX_LAYER_MS / 1e3 * 989e12 / (2 * weights) / 512) + 1  # just past the threshold
    long = _cfg(tiny_model, tmp_path, per_device_train_batch_size=rows)
    assert layer_forward_ms(layers[0], rows * 512, CUDA) > AUTO_MAX_LAYER_MS
    assert layer_forward_ms(layers[0], (rows - 1) * 512, CUDA) < AUTO_MAX_LAYER_MS
    assert graphs_decision(long, CUDA, layers) == (False, None)
    assert graphs_decision(_cfg(tiny_model, tmp_path, cuda_graphs=False), CUDA, layers) == (False, None)


def test_auto_needs_bf16_and_true_does_not(layers, tiny_model, tmp_path, h200):
    """Graphs were proven on a GPU in bf16 only: a T4's fp16 (gradient scaler) keeps auto off."""
    assert graphs_decision(_cfg(tiny_model, tmp_path), CUDA, layers, bf16=False) == (False, None)
    assert graphs_decision(_cfg(tiny_model, tmp_path, cuda_graphs=True), CUDA, layers, bf16=False) == (True, None)


@pytest.mark.parametrize("setting, device, blocker", [
    (dict(), torch.device("cpu"), "CUDA graphs need a CUDA GPU"),
    (dict(gradient_checkpointing="auto"), CUDA, "gradient checkpointing is off"),  # left auto: not resolved to on
])
def test_what_keeps_graphs_off_is_said_when_they_were_asked_for_and_silent_on_auto(
        layers, tiny_model, tmp_path, h200, setting, device, blocker):
    asked = graphs_decision(_cfg(tiny_model, tmp_path, cuda_graphs=True, **setting), device, layers)
    assert asked[0] is False and asked[1].startswith(blocker)
    assert graphs_decision(_cfg(tiny_model, tmp_path, **setting), device, layers) == (False, None)


@pytest.mark.parametrize("setting", [dict(offload_activations=True), dict(packing=False)])
def test_auto_keeps_graphs_off_beside_offloading_and_unpacked_batches(layers, tiny_model, tmp_path, h200, setting):
    assert graphs_decision(_cfg(tiny_model, tmp_path), CUDA, layers) == (True, None)
    assert graphs_decision(_cfg(tiny_model, tmp_path, **setting), CUDA, layers) == (False, None)


def test_several_processes_keep_graphs_off(layers, tiny_model, tmp_path, h200, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert graphs_decision(_cfg(tiny_model, tmp_path, cuda_graphs=True), CUDA, layers) == (
        False, "one GPU only (FSDP's hooks run between the layers' kernels)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model would load onto the CUDA GPU")
def test_on_the_cpu_the_layers_compile_without_graphs_and_it_says_why(tiny_model, tmp_path, capsys):
    cfg = _cfg(tiny_model, tmp_path, cuda_graphs=True, torch_compile=True)
    model = load_model(cfg, choose_precision(cfg))
    assert "cuda_graphs: off (CUDA graphs need a CUDA GPU)" in capsys.readouterr().err
    assert all(is_compiled(layer) and not layer_forward(layer).graphed for layer in decoder_layers(model))


def test_cuda_graphs_true_beside_a_setting_it_cannot_run_with_is_a_config_error(tiny_model, chat_data, tmp_path):
    from relaytune.config.loader import load_config

    cfg = make_config(tmp_path, tiny_model, chat_data, cuda_graphs=True, torch_compile=False, packing=False)
    with pytest.raises(UserError) as e:
        load_config(str(cfg))
    assert str(cfg) in str(e.value)
    assert ("cuda_graphs: true replays the compiled, checkpointed layers on fixed-width packed batches, so it "
            "needs torch_compile: true (or auto), gradient_checkpointing: true (or auto), packing: true; "
            "set those, or cuda_graphs: auto") in str(e.value)
    ok = make_config(tmp_path / "ok", tiny_model, chat_data, cuda_graphs=True, packing=True,
                     gradient_checkpointing="auto")
    assert load_config(str(ok)).cuda_graphs is True


def test_compile_checkpoint_true_beside_a_setting_it_cannot_run_with_is_a_config_error(tiny_model, chat_data,
                                                                                       tmp_path):
    from relaytune.config.loader import load_config

    cfg = make_config(tmp_path, tiny_model, chat_data, compile_checkpoint=True, torch_compile=False,
                      offload_activations=True, gradient_checkpointing=True)
    with pytest.raises(UserError) as e:
        load_config(str(cfg))
    assert str(cfg) in str(e.value)
    assert ("compile_checkpoint: true compiles each layer's checkpoint with the layer, so it needs "
            "torch_compile: true (or auto), offload_activations: false; set those, or compile_checkpoint: auto"
            ) in str(e.value)
    ok = make_config(tmp_path / "ok", tiny_model, chat_data, compile_checkpoint=True, gradient_checkpointing="auto")
    assert load_config(str(ok)).compile_checkpoint is True
