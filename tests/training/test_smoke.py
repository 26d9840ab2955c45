"""End to end: one small run through the CLI produces the contract's layout."""

from conftest import make_config, run_cli


def test_train_writes_contract_layout(tmp_path, tiny_model, chat_data):
    cfg = make_config(tmp_path, tiny_model, chat_data)
    r = run_cli("train", str(cfg))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4", "step-8"]
    assert sorted(p.name for p in (run / "checkpoints" / "step-8").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json", "metrics.jsonl",
        "optimizer.safetensors", "rng.safetensors", "trainer_state.json"]
    assert sorted(p.name for p in (run / "final").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    again = run_cli("train", str(cfg))
    assert again.returncode == 0
    assert "nothing to do" in again.stderr
