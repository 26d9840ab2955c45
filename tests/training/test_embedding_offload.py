"""The input embedding in host memory (relaytune/embedding_offload.py, `offload_embeddings`): which
tables qualify, that the lookup gives the same loss and gradients bit for bit, that it reads the batch's
host copy instead of copying the ids back from the GPU, and what the planner counts."""

from __future__ import annotations

import pytest
import torch

from relaytune.config.schema import TrainConfig
from relaytune.embedding_offload import (
    AUTO_MIN_BYTES,
    HostLookup,
    offload_decision,
    offload_input_embedding,
    offloadable,
    place_input_embedding,
    prefetch_rows,
)
from relaytune.model import choose_precision, load_model
from relaytune.tiny import make_tiny_model
from relaytune.training.loss import causal_lm_loss

CUDA = torch.device("cuda")  # only a device object here: the decisions never touch a GPU


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("untied"), tie_word_embeddings=False)


def _load(folder, tmp_path, **kw):
    cfg = TrainConfig(model=str(folder), dataset="unused.jsonl", output_dir=str(tmp_path / "run"),
                      lora_dropout=0.0, **kw)
    torch.manual_seed(0)
    model = load_model(cfg, choose_precision(cfg))
    model.train()
    return cfg, model


def _loss_and_grads(model):
    ids = torch.randint(10, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = causal_lm_loss(model, {"input_ids": ids, "labels": ids.clone()}, 2 * 23)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_tied_or_trained_table_stays_where_it_is(tiny_model, untied_model, tmp_path):
    _, tied = _load(tiny_model, tmp_path)
    assert offloadable(tied) is None, "the output head reads the same weight"
    assert offload_decision("auto", tied, CUDA, sharded=False) == (False, None)
    assert offload_decision(True, tied, CUDA, sharded=False) == (
        False, "the input embedding is tied to the output head, trains, or is not a plain nn.Embedding")

    _, untied = _load(untied_model, tmp_path)
    assert offloadable(untied) is untied.get_input_embeddings()
    untied.get_input_embeddings().weight.requires_grad_(True)
    assert offloadable(untied) is None, "a table that trains keeps its gradient on the GPU"


def test_auto_moves_only_a_large_table_and_never_on_the_cpu_or_under_fsdp(untied_model, tmp_path):
    _, model = _load(untied_model, tmp_path)
    table = model.get_input_embeddings().weight
    assert table.numel() * table.element_size() < AUTO_MIN_BYTES
    assert offload_decision("auto", model, CUDA, sharded=False) == (False, None), "too small to pay"
    assert offload_decision(True, model, CUDA, sharded=False) == (True, None)
    assert offload_decision(False, model, CUDA, sharded=False) == (False, None)
    assert offload_decision(True, model, torch.device("cpu"), sharded=False) == (
        False, "the model is on the CPU already")
    assert offload_decision(True, model, CUDA, sharded=True) == (
        False, "FSDP shards the base, the table with it")
    assert offload_decision("auto", model, torch.device("cpu"), sharded=False) == (False, None)


def test_asking_on_the_cpu_says_why_and_changes_nothing(untied_model, tmp_path, capsys):
    cfg, model = _load(untied_model, tmp_path, offload_embeddings=True)
    assert place_input_embedding(model, cfg, torch.device("cpu"), sharded=False) is None
    assert "offload_embeddings: off (the model is on the CPU already)" in capsys.readouterr().err
    assert not isinstance(model.get_input_embeddings().__dict__.get("forward"), HostLookup)


def test_the_host_lookup_gives_the_same_loss_and_gradients_bit_for_bit(untied_model, tmp_path):
    _, plain = _load(untied_model, tmp_path)
    plain_loss, plain_grads = _loss_and_grads(plain)

    _, model = _load(untied_model, tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    embedding = model.get_input_embeddings()
    freed = offload_input_embedding(model, torch.device("cpu"))
    assert freed == embedding.weight.numel() * embedding.weight.element_size()
    assert isinstance(embedding.__dict__["forward"], HostLookup)
    assert offloadable(model) is None, "offloaded once, not twice"
    assert offload_input_embedding(model, torch.device("cpu")) == 0

    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    after = model.state_dict()
    assert after.keys() == before.keys(), "the adapter and the saved state see the same model"
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_the_lookup_reads_the_batchs_host_copy_instead_of_copying_the_ids_back(untied_model, tmp_path):
    """On a GPU, data/batches.to_device leaves each device tensor its pinned source as `host_copy`;
    reading `.to("cpu")` of the device tensor would wait for every kernel queued before it."""
    _, model = _load(untied_model, tmp_path)
    embedding = model.get_input_embeddings()
    offload_input_embedding(model, torch.device("cpu"))
    device_ids, host_ids = torch.tensor([[3, 4, 5]]), torch.tensor([[7, 8, 9]])
    device_ids.host_copy = host_ids
    assert torch.equal(embedding(device_ids), embedding.weight[host_ids[0]][None])
    assert torch.equal(embedding(host_ids), embedding.weight[host_ids[0]][None])
    assert torch.equal(embedding(input=device_ids), embedding.weight[host_ids[0]][None]), "forward's own name"


def test_rows_looked_up_ahead_are_what_the_forward_returns_once_then_it_looks_up_again(
        untied_model, tiny_model, tmp_path, monkeypatch):
    """training/prefetch.py looks up the next batch's rows into host memory while the GPU runs this
    step; the forward of the device ids copied from those host ids (their `host_copy`) then takes
    them instead of looking up. Other ids (an evaluation between steps), or a second forward, look
    up, and the rows made ahead still wait for their own forward. A table on the GPU has nothing to do."""
    _, model = _load(untied_model, tmp_path)
    embedding = model.get_input_embeddings()
    offload_input_embedding(model, torch.device("cpu"))
    lookup = embedding.forward
    lookups = []
    real = HostLookup.host_rows
    monkeypatch.setattr(HostLookup, "host_rows", lambda self, ids: lookups.append(ids) or real(self, ids))
    host_ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    prefetch_rows(model, host_ids)
    ahead = lookup.ahead[1]
    assert len(lookups) == 1 and torch.equal(ahead, embedding.weight[host_ids])
    device_ids = host_ids.clone()
    device_ids.host_copy = host_ids
    assert embedding(device_ids) is ahead and len(lookups) == 1, "the forward took the rows made ahead"
    assert torch.equal(embedding(device_ids), ahead) and len(lookups) == 2, "used once; a second forward looks up"

    prefetch_rows(model, host_ids)
    ahead = lookup.ahead[1]
    other_ids = torch.tensor([[9, 10, 11]])
    assert torch.equal(embedding(other_ids), embedding.weight[other_ids]) and len(lookups) == 4, "other ids look up"
    assert embedding(device_ids) is ahead and len(lookups) == 4, "and leave the rows made ahead to their forward"
    assert lookup.ahead is None

    _, on_gpu = _load(tiny_model, tmp_path)  # tied: the table stays where it is
    prefetch_rows(on_gpu, torch.tensor([[3, 4]]))
    assert not isinstance(on_gpu.get_input_embeddings().__dict__.get("forward"), HostLookup)


def test_the_plan_counts_the_table_in_host_memory_only_where_it_is_untied():
    from relaytune.plan import make_plan, parse_gpu, resolve_architecture

    def plan(model, **kw):
        cfg = TrainConfig(model=model, dataset="data.jsonl", output_dir="run", load_in_4bit=True, bf16=True,
                          gradient_checkpointing=True, packing=True, max_seq_length=2048,
                          per_device_train_batch_size=2, optim="paged_adamw_8bit", **kw)
        return make_plan(cfg, parse_gpu("H200"))

    llama = resolve_architecture("meta-llama/Meta-Llama-3-8B")
    auto, off = plan("meta-llama/Meta-Llama-3-8B"), plan("meta-llama/Meta-Llama-3-8B", offload_embeddings=False)
    frozen = "frozen weights"
    assert off.memory.parts[frozen] - auto.memory.parts[frozen] == llama.vocab_size * llama.hidden_size * 2
    qwen = "Qwen/Qwen2.5-3B-Instruct"
    assert plan(qwen).memory.parts[frozen] == plan(qwen, offload_embeddings=False).memory.parts[frozen]
    assert plan("meta-llama/Meta-Llama-3-8B", fsdp=True).memory.parts[frozen] == off.memory.parts[frozen]
    adapted = ["q_proj", "v_proj", "model.embed_tokens"]  # LoRA on the table: PEFT's wrapper stays on the GPU
    with_table = plan("meta-llama/Meta-Llama-3-8B", lora_target_modules=adapted)
    assert with_table.memory.parts[frozen] == plan("meta-llama/Meta-Llama-3-8B", lora_target_modules=adapted,
                                                   offload_embeddings=False).memory.parts[frozen]
    without = plan("meta-llama/Meta-Llama-3-8B", lora_target_modules=["q_proj", "v_proj"])
    lora = "LoRA parameters"  # the table's adapter counts too: r x (vocab + hidden) in fp32
    only = plan("meta-llama/Meta-Llama-3-8B", lora_target_modules=["embed_tokens"]).memory.parts[lora]
    assert only == 16 * (llama.vocab_size + llama.hidden_size) * 4, "the table alone is a valid target"
    assert with_table.memory.parts[lora] - without.memory.parts[lora] == 16 * (llama.vocab_size + llama.hidden_size) * 4


def test_compile_checkpoint_auto_goes_inside_only_where_the_embedding_leaves_the_gpu(
        tiny_model, untied_model, tmp_path, monkeypatch):
    """The compiled checkpoint raises the backward peak; auto takes it only where the table's move to
    host memory pays for that (speedups.checkpoint_inside_decision)."""
    from relaytune import embedding_offload
    from relaytune.training.speedups import checkpoint_inside_decision

    monkeypatch.setattr(embedding_offload, "AUTO_MIN_BYTES", 0)  # the tiny table counts as large
    cfg, untied = _load(untied_model, tmp_path)
    _, tied = _load(tiny_model, tmp_path)
    assert cfg.compile_checkpoint == "auto" and cfg.offload_embeddings == "auto"
    assert checkpoint_inside_decision(cfg, False, untied, CUDA)
    assert not checkpoint_inside_decision(cfg, False, tied, CUDA), "a tied table stays: nothing pays"
    assert not checkpoint_inside_decision(cfg, False, untied, torch.device("cpu"))
    assert not checkpoint_inside_decision(cfg.model_copy(update={"offload_embeddings": False}), False, untied, CUDA)
    assert not checkpoint_inside_decision(cfg, True, untied, CUDA), "graphed layers checkpoint their own way"
    assert not checkpoint_inside_decision(cfg.model_copy(update={"offload_activations": True}), False, untied, CUDA)
    asked = cfg.model_copy(update={"compile_checkpoint": True})
    assert checkpoint_inside_decision(asked, False, tied, torch.device("cpu")), "asked for: wherever it can run"
    assert not checkpoint_inside_decision(cfg.model_copy(update={"compile_checkpoint": False}), False, untied, CUDA)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text", "gemma4_text", "vaultgemma", "minicpm3",
                                        "biogpt", "llama", "qwen2", "mistral"])
def test_the_planner_and_the_runtime_agree_on_which_untied_tables_leave_the_gpu(model_type):
    """The planner decides from config.json alone; the runtime from the loaded module's class. For each
    model type, an untied frozen model built by the installed transformers is offloadable exactly where
    the planner counts its table in host memory: Gemma's scaled embedding stays on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relaytune.plan.architectures import Architecture
    from relaytune.plan.memory import Settings, embeddings_offloaded
    from relaytune.plan.sources import from_config_dict

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=256, tie_word_embeddings=False)
    config = AutoConfig.for_model(model_type, **small)
    model = AutoModelForCausalLM.from_config(config).requires_grad_(False)
    arch = from_config_dict(config.to_dict())
    assert isinstance(arch, Architecture) and not arch.tied_embeddings
    planned = embeddings_offloaded(arch, Settings(max_seq_length=512, offload_embeddings="on"))
    assert planned == (offloadable(model) is not None), type(model.get_input_embeddings()).__name__
    assert planned == (model_type in ("llama", "qwen2", "mistral"))
