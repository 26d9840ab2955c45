"""bench/gpu_bench.cuda_graphs_held counts every graph a cudagraph tree holds: each root, each child
down a step's path, and a call recorded again beside its first recording. The tree here stands in for
Inductor's (its manager's `roots` and each node's `children`, function id -> nodes), which needs CUDA."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402


def node(**children) -> SimpleNamespace:
    return SimpleNamespace(children=children)


def test_without_cuda_there_is_nothing_to_count():
    if not torch.cuda.is_available():
        assert gpu_bench.cuda_graphs_held() is None


def test_every_node_of_the_tree_is_counted_once(monkeypatch):
    import torch._inductor.cudagraph_trees as trees

    backward = node()
    rerecorded = [node(), node()]  # one backward recorded twice: its saved input moved
    layer2 = node(bwd=rerecorded)
    layer1 = node(fwd=[layer2], other=[backward])
    manager = SimpleNamespace(roots={"fwd": [layer1], "eval": [node()]})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists=True: manager)
    assert gpu_bench.cuda_graphs_held() == 6
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists=True: None)
    assert gpu_bench.cuda_graphs_held() is None
