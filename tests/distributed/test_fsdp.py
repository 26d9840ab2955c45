"""FSDP2 on CPU (gloo, 2 ranks of the tiny model): the base sharded, the LoRA maths and the
checkpoint files unchanged (distributed/fsdp.py).

Only the frozen base weights are sharded; the LoRA weights stay whole on every rank and their
gradients are summed exactly as without FSDP. So with shares aligned to the micro-batch a
sharded 2-process run gives the very bytes of one process, and its checkpoints resume
unsharded and the other way round. Tolerances where the split regroups rows: support/ranks.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import step_records
from support.ranks import ADAPTER, assert_close, config, expected_rows, rows_by_step, run_ok

from relaytune.checkpoint import verify


def test_sharded_two_processes_give_the_bytes_of_one(tmp_path, tiny_model, data_file, fork_cli, one_process):
    rows = tmp_path / "rows"
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=2, fsdp=True)
    r = run_ok(fork_cli, cfg, env={"RELAYTUNE_RECORD_ROWS": str(rows)})
    assert "FSDP2: the base sharded over 2 processes, LoRA replicated" in r.stderr
    assert rows_by_step(rows) == expected_rows()
    assert (tmp_path / "run" / ADAPTER).read_bytes() == (one_process / ADAPTER).read_bytes()
    state = json.loads((tmp_path / "run/checkpoints/step-10/trainer_state.json").read_text())
    assert (state["world_size"], state["strategy"]) == (2, "fsdp")


def test_uneven_shares_run_as_many_passes_on_every_rank(tmp_path, tiny_model, data_file, fork_cli):
    """Global batch 5 at micro-batch 1: rank 0 trains 3 rows, rank 1 two and a zero-weight third
    pass (each pass all-gathers the layers, so a rank with fewer would leave the other waiting)."""
    kw = dict(lora_dropout=0.0, per_device_train_batch_size=1, gradient_accumulation_steps=5)
    run_ok(fork_cli, config(tmp_path / "one", tiny_model, data_file, **kw))
    run_ok(fork_cli, config(tmp_path / "two", tiny_model, data_file, num_gpus=2, fsdp=True, **kw))
    worst = assert_close(tmp_path / "one/run", tmp_path / "two/run")
    print(f"uneven sharded shares vs 1 process: max abs difference {worst:.3g}")


@pytest.mark.parametrize("first,second", [("fsdp=true", "num_gpus=1"), ("num_gpus=1", "fsdp=true")])
def test_a_sharded_checkpoint_resumes_unsharded_and_back(tmp_path, tiny_model, data_file, fork_cli, one_process,
                                                         first, second):
    rows = tmp_path / "rows"
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=2)
    r = fork_cli.run("train", str(cfg), "max_restarts=0", first, env={"RELAYTUNE_CRASH_AT": "step:end:7"})
    assert r.returncode in (-9, 1), r.stderr[-3000:]
    ckpts = sorted((tmp_path / "run/checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    assert ckpts and all(verify(p) is None for p in ckpts)
    resumed_from = int(ckpts[-1].name[5:])
    saved = json.loads((ckpts[-1] / "trainer_state.json").read_text())
    assert saved["strategy"] == ("fsdp" if first == "fsdp=true" else "single")
    run_ok(fork_cli, cfg, second, env={"RELAYTUNE_RECORD_ROWS": str(rows)})
    later = rows_by_step(rows)
    assert later == {s: v for s, v in expected_rows().items() if s >= resumed_from}
    worst = assert_close(tmp_path / "run", one_process)
    print(f"{first} -> {second} from step {resumed_from}: max abs difference {worst:.3g}")


def test_an_oom_on_rank_1_restarts_both_ranks_with_half_the_micro_batch(tmp_path, tiny_model, data_file, fork_cli,
                                                                      one_process):
    """Under FSDP rank 0 waits in an all-gather while rank 1 runs out of memory: rank 1 writes the
    halved micro-batch down and fails, the agent restarts both from the last checkpoint, and they
    take it (the injected OOM fires in the first round only, as a real one would not recur)."""
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, num_gpus=2, fsdp=True)
    r = run_ok(fork_cli, cfg, env={"RELAYTUNE_OOM_AT": "3:0", "RELAYTUNE_OOM_RANK": "1"})
    assert "out of memory at step 4 with the base sharded (FSDP)" in r.stderr
    run = tmp_path / "run"
    assert json.loads((run / "oom_request.json").read_text()) == {"step": 3, "micro_batch_size": 2}
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ooms = [e for e in events if e.get("event") == "oom"]
    assert [(e["step"], e["micro_batch_size"], e["was"], e["restarted"]) for e in ooms] == [(3, 2, 4, True)]
    starts = [json.loads(x) for x in (run / "sessions.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "start"]
    assert [s["from_step"] for s in starts] == [0, 2], "the restart continues from the last checkpoint"
    assert [r["step"] for r in step_records(run / "metrics.jsonl")] == list(range(1, 13))
    state = json.loads((run / "checkpoints/step-10/trainer_state.json").read_text())
    assert state["recovery"]["micro_batch_size"] == 2
    assert_close(run, one_process)  # same rows, same maths, smaller micro-batches


def test_fsdp_refuses_what_it_cannot_shard(tmp_path, tiny_model, data_file, fork_cli):
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, fsdp=True, load_in_8bit=True)
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2
    assert "fsdp: true cannot shard an 8-bit base (load_in_8bit)" in r.stderr and "Traceback" not in r.stderr
    cfg = config(tmp_path, tiny_model, data_file, num_gpus=2, fsdp=True, load_in_4bit=True,
                 bnb_4bit_quant_storage="uint8")
    r = fork_cli.run("train", str(cfg))
    assert r.returncode == 2
    assert "fsdp: true needs a float bnb_4bit_quant_storage" in r.stderr and "Traceback" not in r.stderr


def test_fsdp_with_one_process_trains_unsharded(tmp_path, tiny_model, data_file, fork_cli, one_process):
    cfg = config(tmp_path, tiny_model, data_file, lora_dropout=0.0, fsdp=True)
    r = run_ok(fork_cli, cfg)
    assert "fsdp: true with one process: there is nothing to shard over" in r.stderr
    assert (tmp_path / "run" / ADAPTER).read_bytes() == (one_process / ADAPTER).read_bytes()


def test_auto_shards_only_a_base_that_would_fill_a_gpu():
    from relaytune.config import TrainConfig
    from relaytune.distributed.fsdp import sharded
    from relaytune.distributed.world import World

    two, one = World(rank=0, size=2), World()
    cfg = TrainConfig(model="m", dataset="d.jsonl", output_dir="run")
    gib = 1024 ** 3
    assert sharded(cfg, two, 13 * gib, [15 * gib, 15 * gib]) is True  # 13 > 0.8 x 15
    assert sharded(cfg, two, 11 * gib, [15 * gib, 15 * gib]) is False
    assert sharded(cfg, two, 11 * gib, [15 * gib, 13 * gib]) is True  # the fullest GPU decides
    assert sharded(cfg, two, None, []) is False  # no GPU, or a model the planner does not know
    assert sharded(cfg, one, 13 * gib, [15 * gib]) is False
    assert sharded(cfg.model_copy(update={"fsdp": False}), two, 13 * gib, [15 * gib]) is False
    assert sharded(cfg.model_copy(update={"fsdp": True}), two, 1, [15 * gib]) is True


def test_sharded_4bit_loads_with_float_storage_of_the_parameter_dtype():
    import torch

    from relaytune.config import TrainConfig
    from relaytune.distributed.fsdp import load_settings
    from relaytune.errors import UserError

    cfg = TrainConfig(model="m", dataset="d.jsonl", output_dir="run", load_in_4bit=True)
    assert load_settings(cfg, torch.bfloat16) == {"bnb_4bit_quant_storage": "bfloat16", "torch_compile": False,
                                                  "compile_checkpoint": False}
    asked = cfg.model_copy(update={"torch_compile": True, "compile_checkpoint": True})
    assert load_settings(asked, torch.float16) == {"bnb_4bit_quant_storage": "float16"}
    with pytest.raises(UserError) as e:
        load_settings(cfg.model_copy(update={"bnb_4bit_quant_storage": "float16"}), torch.bfloat16)
    assert str(e.value) == ("`bnb_4bit_quant_storage`: float16 cannot be sharded with FSDP (FSDP all-gathers the "
                            "weights as bfloat16, the parameters' dtype); set it to bfloat16 or auto, or set "
                            "fsdp: false")
    with pytest.raises(UserError, match="uint8 storage is turned into plain tensors by FSDP"):
        load_settings(cfg.model_copy(update={"bnb_4bit_quant_storage": "uint8"}), torch.bfloat16)
    plain = TrainConfig(model="m", dataset="d.jsonl", output_dir="run")
    assert load_settings(plain, torch.float32) == {"torch_compile": False, "compile_checkpoint": False}
