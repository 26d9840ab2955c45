"""The compile warm-up report (training/warmup.py): a graph break in the compiled decoder layers (as
code patched into the model makes one) or a layer that fails to compile is warned about after the
first step; whole compiled layers are not."""

from __future__ import annotations

import pytest
import torch
import transformers.models.llama.modeling_llama as llama
from support.layer_cases import layer_model, loss_and_grads

from relaytune.layers import checkpoints_inside, decoder_layers
from relaytune.tiny import make_tiny_model
from relaytune.training import warmup


def first_step(model) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_and_grads(model)
    optimizer.step()


@pytest.mark.slow  # inductor's C++ compile: ~20 s each on a 2-core machine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_compiled_checkpoint_keeps_each_layer_whole(arch, tmp_path, one_thread, capsys):
    """Under the transformers that setup installs (5.25 wraps every attention forward for hub kernels)."""
    model = layer_model(make_tiny_model(tmp_path / arch, arch=arch), tmp_path, gradient_checkpointing=True,
                        torch_compile=True, compile_checkpoint=True)
    assert all(checkpoints_inside(layer) for layer in decoder_layers(model))
    first_step(model)
    assert model.relaytune_warmup.seconds is not None
    assert model.relaytune_warmup.breaks == {} and model.relaytune_warmup.failed == 0
    assert "relaytune: warning" not in capsys.readouterr().err


@pytest.mark.slow  # inductor's C++ compile: ~20 s on a 2-core machine
def test_a_graph_break_in_the_compiled_layers_is_warned_about(tiny_model, tmp_path, one_thread, capsys,
                                                              monkeypatch):
    rope = llama.apply_rotary_pos_emb

    def patched_rope(*args, **kwargs):  # as a library's RoPE kernel behind a call Dynamo cannot trace
        torch._dynamo.graph_break()
        return rope(*args, **kwargs)

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", patched_rope)
    # Dynamo's caches, reset on both sides: a layer graph compiled earlier in the process passed its
    # guards with the patch in place, and after the break the checkpoint's code ran eagerly for the
    # later tests' models too.
    torch._dynamo.reset()
    try:
        broken = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=True,
                             compile_checkpoint=True)
        first_step(broken)
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()
    err = capsys.readouterr().err
    assert sum(broken.relaytune_warmup.breaks.values()) >= 1
    assert "relaytune: warning: torch.compile: the first step broke the compiled graphs" in err
    assert "a checkpoint compiled with them runs eagerly around the pieces" in err
    assert "TORCH_LOGS=graph_breaks shows where" in err


@pytest.mark.slow  # one failed inductor C++ compile: ~15 s on a 2-core machine
def test_a_layer_that_fails_to_compile_is_warned_about(tiny_model, tmp_path, one_thread, capsys):
    """Inductor's C++ wrapper cannot compile the random state a compiled checkpoint saves for its
    dropouts (an InductorError): Dynamo runs that layer eagerly, and the warm-up says so."""
    import torch._inductor.config as inductor

    torch._dynamo.reset()  # after the failure Dynamo would not try these frames again in this process
    try:
        with inductor.patch(cpp_wrapper=True):
            model = layer_model(tiny_model, tmp_path, gradient_checkpointing=True, torch_compile=True,
                                compile_checkpoint=True, lora_dropout=0.1)
            first_step(model)
    finally:
        torch._dynamo.reset()
    err = capsys.readouterr().err
    assert model.relaytune_warmup.failed >= 1
    assert "relaytune: warning: torch.compile: " in err
    assert "compiled region(s) failed to compile in the first step and run eagerly instead" in err
    assert "(such as TORCHINDUCTOR_CPP_WRAPPER), unset it" in err


def test_graph_breaks_are_counted_from_the_timers_start():
    before = {"Call to `torch._dynamo.graph_break()`": 2, "Unsupported: a variadic call": 1}
    after = {"Call to `torch._dynamo.graph_break()`": 3, "Unsupported: a variadic call": 1, "Other": 4}
    assert warmup.new_graph_breaks(before, after) == {"Call to `torch._dynamo.graph_break()`": 1, "Other": 4}
    text = warmup.graph_break_warning({"Other": 4, "Call to `torch._dynamo.graph_break()`": 1})
    assert text.startswith("torch.compile: the first step broke the compiled graphs 5 time(s): "
                           "Other (4x); Call to `torch._dynamo.graph_break()` (1x). ")


def test_a_run_after_a_failed_compile_in_the_same_process_compiles_afresh(tiny_model, tmp_path, one_thread, capsys,
                                                                         monkeypatch):
    """Dynamo remembers a frame that failed to compile for the whole process: without the clean start, a
    notebook's next run compiled 0 graphs and ran eagerly, silently. The failure is injected where
    Inductor's own errors come from (its compile_fx, which the `inductor` backend calls); the later
    runs compile with a backend that returns the traced graph, so no C++ compiler runs."""
    import torch._inductor.compile_fx as inductor

    def failing_compile(*args, **kwargs):
        raise RuntimeError("injected Inductor failure")

    def traced_graph(graph_module, example_inputs, **kwargs):
        return graph_module.forward

    torch._dynamo.reset()
    try:
        monkeypatch.setattr(inductor, "compile_fx", failing_compile)
        failed = layer_model(tiny_model, tmp_path / "failed", torch_compile=True)
        first_step(failed)
        assert failed.relaytune_warmup.failed >= 1 and failed.relaytune_warmup.graphs == 0
        capsys.readouterr()
        monkeypatch.setattr(inductor, "compile_fx", traced_graph)
        afresh = layer_model(tiny_model, tmp_path / "afresh", torch_compile=True)
        first_step(afresh)
        err = capsys.readouterr().err
        again = layer_model(tiny_model, tmp_path / "again", torch_compile=True)
        first_step(again)
        err_again = capsys.readouterr().err
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()
    assert afresh.relaytune_warmup.graphs >= 1 and afresh.relaytune_warmup.failed == 0
    assert ("relaytune: note: torch.compile: an earlier compile in this process failed or broke its graph "
            f"({failed.relaytune_warmup.failed} region(s)); Dynamo keeps its decisions for the process (a failed "
            "region runs eagerly from then on, without trying again), so its caches were cleared and this run "
            "compiles afresh") in err
    assert "(0 graphs compiled)" not in err and "warning" not in err
    # A run after whole compiles keeps the graphs: the same architecture reuses them.
    assert again.relaytune_warmup.graphs == 0 and "compiles afresh" not in err_again
