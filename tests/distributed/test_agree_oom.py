"""After an OOM every rank redoes the step the same way: at the same micro-batch only where every rank
gave something up (CUDA graphs, the compiled checkpoint), else all halve."""

from __future__ import annotations

from relaytune.distributed import agree


class TwoRanks:
    """One rank's view of a two-rank world; `any(flag)` ORs this rank's flag with its peer's."""

    distributed = True

    def __init__(self, peer_gave_up: bool):
        self.peer_gave_up = peer_gave_up

    def any(self, flag: bool) -> bool:
        return flag or not self.peer_gave_up  # the peer's own flag is "nothing given up"


class OneProcess:
    distributed = False


def test_the_same_micro_batch_only_where_every_rank_gave_something_up():
    assert agree.all_released(TwoRanks(peer_gave_up=True), ["compile_checkpoint"]) == ["compile_checkpoint"]
    assert agree.all_released(TwoRanks(peer_gave_up=False), ["compile_checkpoint"]) == []
    assert agree.all_released(TwoRanks(peer_gave_up=True), []) == []
    assert agree.all_released(OneProcess(), ["cuda_graphs"]) == ["cuda_graphs"]
    assert agree.all_released(OneProcess(), []) == []
