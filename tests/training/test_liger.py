"""liger_kernels: Liger's RMSNorm and SwiGLU kernels on the decoder layers.

On the CPU (Liger's kernels are Triton's, so CUDA only) the run keeps transformers' layers, says so,
and ends byte-identical to a run without the key; the settings that cannot run beside it are config
errors; a GPU without the liger-kernel package, or a model Liger's patch does not fit, is exit 2 with
what to do; and Liger's process-wide class swap is undone, so the next model loaded gets
transformers' own layers. The CUDA test compares loss and gradients with and without the kernels.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from support.run_helpers import make_config
from transformers.models.llama import modeling_llama

from relaytune.config.loader import load_config
from relaytune.config.schema import TrainConfig
from relaytune.errors import UserError
from relaytune.liger import apply_liger_kernels, load_liger, quiet_dynamo_about_liger
from relaytune.model import choose_precision, load_model

CUDA = torch.device("cuda")


def _base(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model))


def test_on_the_cpu_the_run_keeps_transformers_layers_and_ends_byte_identical(tiny_model, dropout_reference,
                                                                               fork_cli, tmp_path):
    data, reference = dropout_reference
    cfg = make_config(tmp_path, tiny_model, data, lora_dropout=0.1, liger_kernels=["rms_norm", "swiglu"])
    done = fork_cli.run("train", str(cfg))
    assert done.returncode == 0, done.stderr
    assert "liger_kernels: Liger's kernels run on CUDA GPUs only; this run keeps transformers' layers" in done.stderr
    assert (tmp_path / "run/final/adapter_model.safetensors").read_bytes() == reference


@pytest.mark.parametrize("setting, needs", [
    ({"compile_checkpoint": True, "gradient_checkpointing": True},
     "compile_checkpoint: true compiles each layer's checkpoint with the layer, so it needs liger_kernels: [] "
     "(inside the compiled checkpoint they kept 2.7x the memory); set those, or compile_checkpoint: auto"),
    ({"cuda_graphs": True, "packing": True, "gradient_checkpointing": True},
     "cuda_graphs: true replays the compiled, checkpointed layers on fixed-width packed batches, so it needs "
     "liger_kernels: [] (not measured under CUDA graphs); set those, or cuda_graphs: auto"),
], ids=["compile_checkpoint", "cuda_graphs"])
def test_a_setting_that_cannot_run_beside_liger_is_a_config_error(tiny_model, chat_data, tmp_path, setting, needs):
    cfg = make_config(tmp_path, tiny_model, chat_data, liger_kernels=["swiglu"], **setting)
    with pytest.raises(UserError) as e:
        load_config(str(cfg))
    assert e.value.exit_code == 2
    assert str(cfg) in str(e.value)
    assert needs in str(e.value)


def test_an_unknown_kernel_is_a_config_error_naming_the_key(tiny_model, chat_data, tmp_path):
    cfg = make_config(tmp_path, tiny_model, chat_data, liger_kernels=["rms_norm", "rope"])
    with pytest.raises(UserError) as e:
        load_config(str(cfg))
    assert e.value.exit_code == 2
    assert str(cfg) in str(e.value)
    assert str(e.value).endswith(":11: `liger_kernels`: not one of the allowed values; got 'rope' "
                                 "(allowed: 'rms_norm', 'swiglu')")


def test_a_gpu_without_the_liger_package_is_exit_2_with_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # importing it now raises ImportError
    with pytest.raises(UserError) as e:
        load_liger(["swiglu"], CUDA)
    assert e.value.exit_code == 2
    assert str(e.value).startswith("`liger_kernels` needs the liger-kernel package, which did not import (")
    assert str(e.value).endswith("install it with `pip install liger-kernel`, or remove liger_kernels from the config")


def test_a_model_liger_does_not_fit_is_refused_by_name(tiny_model):
    model = _base(tiny_model)
    model.config.model_type = "gemma2"
    with pytest.raises(UserError) as e:
        apply_liger_kernels(model, ["rms_norm"], None)  # as on the CPU: refused there too
    assert str(e.value) == ("`liger_kernels`: relaytune puts Liger's kernels on llama, mistral, qwen2, qwen3 models, "
                            "and this model is 'gemma2'; remove liger_kernels from the config")


def test_an_mlp_that_is_not_silu_is_refused_for_swiglu_but_not_for_rms_norm(tiny_model):
    model = _base(tiny_model)
    model.config.hidden_act = "gelu"
    with pytest.raises(UserError) as e:
        apply_liger_kernels(model, ["rms_norm", "swiglu"], None)
    assert str(e.value) == ("`liger_kernels`: Liger's SwiGLU computes silu(gate) * up, and this model's MLP uses "
                            "'gelu'; remove swiglu from liger_kernels")
    assert apply_liger_kernels(model, ["rms_norm"], None) is False


def test_liger_s_class_swap_is_undone_and_its_instance_patch_kept(tiny_model, monkeypatch):
    """A stand-in for liger_kernel.transformers that does what Liger 0.8.5's patch does: rebinds the
    modeling module's classes, adds a name, and rebinds the loaded model's MLP forward."""
    calls = []
    original_mlp, original_norm = modeling_llama.LlamaMLP, modeling_llama.LlamaRMSNorm

    def liger_forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def apply_liger_kernel_to_llama(**kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "model"})
        modeling_llama.LlamaMLP = type("LigerSwiGLUMLP", (original_mlp,), {})
        modeling_llama.LlamaRMSNorm = type("LigerRMSNorm", (original_norm,), {})
        modeling_llama.liger_added_name = True
        for layer in kwargs["model"].model.layers:
            layer.mlp.forward = types.MethodType(liger_forward, layer.mlp)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(logging.getLogger("torch._dynamo"), "filters", [])
    model = _base(tiny_model)

    assert apply_liger_kernels(model, ["swiglu"], load_liger(["swiglu"], CUDA)) is True
    assert [type(f).__name__ for f in logging.getLogger("torch._dynamo").filters] == ["_LigerKernelReadFailure"]

    assert calls == [{"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False,
                      "rms_norm": False, "swiglu": True}]
    assert modeling_llama.LlamaMLP is original_mlp and modeling_llama.LlamaRMSNorm is original_norm
    assert not hasattr(modeling_llama, "liger_added_name")
    assert all(layer.mlp.forward.__func__ is liger_forward for layer in model.model.layers)
    assert type(_base(tiny_model).model.layers[0].mlp) is original_mlp


def test_torchs_traceback_for_a_liger_kernel_it_cannot_read_is_dropped_and_others_kept(monkeypatch):
    """Dynamo logs a traceback when it cannot read which tensors a Triton kernel writes; on the H100 that
    was Liger's SwiGLU kernels failing at `gate_multiplier.to(...)`, ~100 lines per kernel and compile."""
    log = logging.getLogger("torch._dynamo")
    monkeypatch.setattr(log, "filters", [])
    quiet_dynamo_about_liger()
    quiet_dynamo_about_liger()
    assert len(log.filters) == 1
    kept = []
    handler = logging.Handler()
    handler.emit = kept.append
    log.addHandler(handler)

    class CompilationError(Exception):  # Triton's: the kernel's source, the node, the message
        def __init__(self, src):
            super().__init__("at 15:78: AttributeError(\"'float' object has no attribute 'to'\")")
            self.src = src

    try:
        for source in ("@triton.jit\ndef _swiglu_forward_kernel(\n    a_ptr, b_ptr, c_ptr, stride, gate_multiplier",
                       "@triton.jit\ndef my_kernel(x_ptr, scale):", None):
            try:
                raise CompilationError(source)
            except CompilationError:
                log.warning("Encountered an exception in identify_mutated_tensors, assuming every input is mutated",
                            exc_info=True)
        log.warning("another warning")
    finally:
        log.removeHandler(handler)
    assert [(r.getMessage()[:22], r.exc_info and r.exc_info[1].src) for r in kept] == [
        ("Encountered an excepti", "@triton.jit\ndef my_kernel(x_ptr, scale):"), ("Encountered an excepti", None),
        ("another warning", None)]


def test_no_kernels_asked_imports_and_touches_nothing(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    assert load_liger([], CUDA) is None
    assert apply_liger_kernels(_base(tiny_model), [], None) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels are Triton kernels: CUDA only")
@pytest.mark.parametrize("half", ["bf16", "fp16"])  # fp16 is a T4's, where the plan's advice can propose the kernels
def test_cuda_liger_kernels_keep_the_loss_and_gradients(tiny_model, tmp_path, half):
    pytest.importorskip("liger_kernel")
    results = []
    for kernels in ([], ["rms_norm", "swiglu"]):
        cfg = TrainConfig(model=str(tiny_model), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                          bf16=half == "bf16", fp16=half == "fp16", lora_dropout=0.0, gradient_checkpointing=True,
                          torch_compile=False, liger_kernels=kernels)
        precision = choose_precision(cfg)
        assert precision.autocast == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[half])
        torch.manual_seed(0)
        model = load_model(cfg, precision)
        forward = model.base_model.model.model.layers[0].mlp.forward
        assert forward.__func__.__qualname__.startswith("LigerSwiGLUMLP") == bool(kernels)
        ids = torch.randint(0, model.config.vocab_size, (2, 64), device=precision.device)
        with torch.autocast("cuda", dtype=precision.autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.item(), grads))
    (loss0, g0), (loss1, g1) = results
    # Both runs are half precision; the bound is the bf16 CUDA tests' (test_attention.py), fp16 rounds finer.
    assert abs(loss1 - loss0) / abs(loss0) < 1e-2
    assert (g1 - g0).norm() / g0.norm() < 2e-2


def test_the_memory_plan_runs_what_relaytune_runs_beside_liger_and_says_what_it_counts():
    """Under liger_kernels the plan keeps the checkpoint outside the layers and CUDA graphs off, as
    speedups.py and cuda_graphs.py do, passes the kernels on, says how it counts their saving, and says
    that rms_norm saves nothing in compiled layers."""
    from relaytune.plan.architectures import from_table
    from relaytune.plan.gpus import parse_gpu
    from relaytune.plan.planner import plan_notes, settings_from_config

    gpu, arch = parse_gpu("H100"), from_table("meta-llama/Meta-Llama-3-8B")
    resolved = {}
    for kernels, compile_ in (([], "auto"), (["swiglu"], "auto"), (["rms_norm", "swiglu"], "auto"),
                              (["rms_norm", "swiglu"], False)):
        cfg = TrainConfig(model="m", dataset="d.jsonl", output_dir="out", bf16=True, packing=True,
                          load_in_4bit=True, liger_kernels=kernels, torch_compile=compile_)
        settings = settings_from_config(cfg, gpu)
        liger_notes = [n for n in plan_notes(arch, settings, gpu, cfg) if n.startswith("liger_kernels")]
        resolved[(*kernels, compile_)] = (settings.compile_checkpoint, settings.graphs, settings.liger_kernels,
                                          liger_notes)
    counted = ("liger_kernels: their SwiGLU's in-place backward is counted at the least its H100 measurements "
               "saved, so the memory here is an upper bound")
    assert resolved[("auto",)] == ("auto", "auto", (), [])
    assert resolved[("swiglu", "auto")] == ("off", "off", ("swiglu",), [counted])
    assert resolved[("rms_norm", "swiglu", "auto")] == ("off", "off", ("rms_norm", "swiglu"), [counted, (
        "liger_kernels: rms_norm saves no memory in compiled layers, which already keep the norm's input in the "
        "compute dtype, and it cost 2% of tokens/s beside swiglu on an H100; liger_kernels: [swiglu] keeps the "
        "saving")])
    # Eager layers save the norm's input in fp32, which Liger's kernel does not, so there it is no waste.
    assert resolved[("rms_norm", "swiglu", False)][3] == [counted]


# H100 peaks (GiB) with offload_activations, Liger's kernels and the checkpoint outside the compiled layers,
# QLoRA r16 dropout 0.05, bf16 adapters, seq 2048, the defaults otherwise (bench/results/planner.md): both
# kernels in the fifth session of 2026-12-05; SwiGLU alone and the cap32 case again in the ninth (2026-12-06).
BOTH, SWIGLU = ("rms_norm", "swiglu"), ("swiglu",)
LIGER_MEASURED = [("Qwen/Qwen2.5-3B", 4, BOTH, 3.51), ("meta-llama/Meta-Llama-3-8B", 2, BOTH, 5.83),
                  ("Qwen/Qwen2.5-3B", 32, BOTH, 12.58), ("Qwen/Qwen2.5-3B", 32, BOTH, 12.83),
                  ("Qwen/Qwen2.5-3B", 4, SWIGLU, 3.51), ("meta-llama/Meta-Llama-3-8B", 2, SWIGLU, 5.82),
                  ("Qwen/Qwen2.5-3B", 32, SWIGLU, 12.58)]


@pytest.mark.parametrize("model,micro_batch,kernels,measured", LIGER_MEASURED)
def test_the_planned_peak_with_liger_is_above_what_the_h100_measured_and_within_20_percent(
        model, micro_batch, kernels, measured):
    from relaytune.plan import GIB, Settings, estimate_memory
    from relaytune.plan.architectures import from_table
    from relaytune.plan.calibration import LIGER_SWIGLU_IN_PLACE

    arch = from_table(model)

    def planned(kernels):
        s = Settings(max_seq_length=2048, quantization="nf4", lora_dropout=0.05, adapter_bytes=2,
                     compiled_layers=True, offload_activations=True, staging=False, liger_kernels=kernels,
                     offload_embeddings="auto")
        return estimate_memory(arch, s, micro_batch, True).total_allocated

    with_liger = planned(kernels)
    assert measured < with_liger / GIB < 1.2 * measured
    saved = LIGER_SWIGLU_IN_PLACE * 2 * arch.intermediate_size * micro_batch * 2048
    assert planned(()) - with_liger == pytest.approx(saved, abs=1)
    assert planned(("rms_norm",)) == planned(()), "a compiled layer already keeps the norm's input in bf16"


def test_in_eager_layers_the_plan_saves_what_ligers_kernels_save():
    """Eager transformers layers keep each RMSNorm's fp32 upcast and the SiLU product; Liger's RMSNorm keeps
    its bf16 input (and one fp32 per row), its SwiGLU the gate and up halves only."""
    from relaytune.plan.architectures import from_table
    from relaytune.plan.memory import Settings, layer_saved_bytes

    arch = from_table("meta-llama/Meta-Llama-3-8B")
    saved = {kernels: layer_saved_bytes(arch, Settings(max_seq_length=2048, liger_kernels=kernels))
             for kernels in ((), ("rms_norm",), ("swiglu",), ("rms_norm", "swiglu"))}
    norms = (4 - 2) * arch.hidden_size * arch.norms_per_layer
    assert saved[()] - saved[("rms_norm",)] == norms
    assert saved[()] - saved[("swiglu",)] == 2 * arch.intermediate_size
    assert saved[()] - saved[("rms_norm", "swiglu")] == norms + 2 * arch.intermediate_size
