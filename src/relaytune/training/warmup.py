"""The compile warm-up, reported once: how long the first training step took, how many graphs it
compiled, and whether the compiled decoder layers broke their graph or failed to compile.

A graph break splits a compiled layer into pieces with eager code between them. Code patched into
the model does this (Liger's RoPE did, on an H200: bench/results/vs-trl-h200.md). Inside a compiled
checkpoint it also makes Dynamo run the whole checkpoint eagerly around the pieces, so the speed-ups
line's "checkpoint compiled inside" no longer holds. Measured there: the step 18% slower, its peak
12% lower. Dynamo only logs breaks when asked (TORCH_LOGS=graph_breaks), so the warning says so.

A region that fails to compile runs eagerly (relaytune sets `suppress_errors`, so that a compiler bug
never stops a run). Inductor's C++ wrapper (TORCHINDUCTOR_CPP_WRAPPER=1) cannot compile the random
state a compiled checkpoint saves for its dropouts, so on the CPU the whole layer ran eagerly (an H200
run with that setting was 37% slower, most likely for this reason). Dynamo prints its error, but as a
long traceback that reads like a crash, so the warm-up says what it meant.

Dynamo remembers a region that failed, or broke its graph inside a checkpoint, for the whole process:
a notebook's next run would run it eagerly without trying again and without a warning (seen on the
CPU: 0 graphs compiled). So a run starts from clean caches after such an earlier run (start_clean).
"""

from __future__ import annotations

import time
import weakref

import torch

from relaytune.log import info, notice, warn


def _counters():
    """Dynamo's process-wide counters, or None where this torch has none to read."""
    try:
        from torch._dynamo.utils import counters

        return counters
    except Exception:  # noqa: BLE001
        return None


def compile_stats() -> dict:
    """Graphs compiled so far (dynamo's counter), for the logs and benchmarks. A recompile adds a
    graph; dynamo keeps no count of recompiles itself, it logs each with its reason."""
    counters = _counters()
    return {} if counters is None else {"graphs": int(counters["stats"].get("unique_graphs", 0))}


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason (each reason's first line)."""
    breaks: dict[str, int] = {}
    for reason, count in (_counters() or {}).get("graph_break", {}).items():
        first = str(reason).strip().splitlines()[0] if str(reason).strip() else "no reason given"
        breaks[first] = breaks.get(first, 0) + int(count)
    return breaks


def failed_frames() -> int:
    """Frames Dynamo tried to compile and gave up on (run eagerly instead) so far in this process; a
    frame that only broke its graph counts as compiled."""
    frames = (_counters() or {}).get("frames", {})
    return int(frames.get("total", 0)) - int(frames.get("ok", 0))


def new_graph_breaks(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {reason: n - before.get(reason, 0) for reason, n in after.items() if n > before.get(reason, 0)}


def graph_break_warning(breaks: dict[str, int]) -> str:
    count = sum(breaks.values())
    reasons = "; ".join(f"{reason} ({n}x)" for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:3])
    return (f"torch.compile: the first step broke the compiled graphs {count} time(s): {reasons}. "
            "The decoder layers run in pieces with eager code between them, and a checkpoint compiled with "
            "them runs eagerly around the pieces: slower than whole layers. Code patched into the model "
            "(another library's kernels) is the usual cause; TORCH_LOGS=graph_breaks shows where")


def failed_frames_warning(count: int) -> str:
    return (f"torch.compile: {count} compiled region(s) failed to compile in the first step and run "
            "eagerly instead (the compiler's error is printed above): the decoder layers in them are not "
            "compiled, and a checkpoint compiled with them is an eager one. If the error names a setting "
            "of yours (such as TORCHINDUCTOR_CPP_WRAPPER), unset it; torch_compile: false runs eagerly "
            "without trying")


_clean_start = {"failed": 0, "breaks": 0}  # the counters when this process's caches were last cleared


def start_clean() -> None:
    """Clears Dynamo's caches, with a note, when a region failed to compile or broke its graph since they
    were last cleared here, so this run tries every region afresh. Graphs that compiled whole are kept
    otherwise: a later run of the same architecture reuses them."""
    failed, breaks = failed_frames(), sum(graph_breaks().values())
    since = failed - _clean_start["failed"] + breaks - _clean_start["breaks"]
    if since <= 0:
        return
    torch._dynamo.reset()
    _clean_start.update(failed=failed, breaks=breaks)
    notice(f"torch.compile: an earlier compile in this process failed or broke its graph ({since} region(s)); "
           "Dynamo keeps its decisions for the process (a failed region runs eagerly from then on, without "
           "trying again), so its caches were cleared and this run compiles afresh")


class WarmUpTimer:
    """Prints, once, how long the first training step took (the compile warm-up): from the first
    forward in training mode with gradients to the end of the first optimizer step of this model's
    parameters (the optimizer hook is process-wide: a timer left by an earlier run in the same
    process, stopped before its first step, stays silent). Warns when that step broke graphs or failed
    to compile some."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.params = {id(p) for p in model.parameters() if p.requires_grad}
        self.t0: float | None = None
        self.handles: list = []
        self.seconds: float | None = None
        self.graphs: int | None = None
        self.breaks_before = graph_breaks()
        self.breaks: dict[str, int] = {}
        self.failed_before = failed_frames()
        self.failed = 0
        # Dynamo's counters are the process's and survive torch._dynamo.reset(): a notebook's second
        # run would otherwise report the first run's graphs as its own.
        self.graphs_before = compile_stats().get("graphs")

    @classmethod
    def install(cls, model) -> WarmUpTimer:
        timer = cls(model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # The decoder runs in every path (the chunked loss calls it directly).
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else model
        timer.handles.append(decoder.register_forward_pre_hook(timer._forward))
        from torch.optim.optimizer import register_optimizer_step_post_hook

        timer.handles.append(register_optimizer_step_post_hook(timer._stepped))
        model.relaytune_warmup = timer
        return timer

    def _forward(self, module, args):
        if self.seconds is not None:
            # Removed here, not in _stepped: removing a hook while the optimizer iterates over the
            # process's hooks breaks that iteration when another hook follows it.
            for h in self.handles:
                h.remove()
            self.handles.clear()
        elif self.t0 is None and module.training and torch.is_grad_enabled():
            self.t0 = time.perf_counter()

    def _stepped(self, optimizer, args, kwargs):
        if self.t0 is None or self.seconds is not None or self.model() is None:
            return
        if not any(id(p) in self.params for group in optimizer.param_groups for p in group["params"]):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        graphs = compile_stats().get("graphs")
        if graphs is not None and self.graphs_before is not None:
            self.graphs = graphs - self.graphs_before
        compiled = "?" if self.graphs is None else self.graphs
        info(f"torch.compile warm-up: the first step took {self.seconds:.1f}s ({compiled} graphs compiled)")
        self.breaks = new_graph_breaks(self.breaks_before, graph_breaks())
        if self.breaks:
            warn(graph_break_warning(self.breaks))
        self.failed = failed_frames() - self.failed_before
        if self.failed > 0:
            warn(failed_frames_warning(self.failed))
