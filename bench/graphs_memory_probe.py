"""Which step's checkpointed layer inputs are still alive, and who holds them, under CUDA graphs.

With `cuda_graphs` on, each decoder layer's input is a clone made by `layers.RecomputedLayer` (the
first forward's output, copied out of the graphs' pool). A step needs its own 36 of them (Qwen2.5-3B)
until its backward; bench/results/cuda-graphs-h200.md found about twice that many alive at the peak
from the fourth step on. This probe trains the case of bench/vs_trl.py in-process through
`relaytune.train` and
  - keeps a storage weak reference to every clone, tagged with the step and the layer that made it;
  - at the head loss's forward (the peak) and after each optimizer step, counts the live clones by
    the step that made them;
  - after each optimizer step, for each live clone of an earlier step, lists the Python objects
    that refer to a tensor on that storage (none: a C++ owner, such as an autograd node or a graph);
  - prints each step's peak allocated memory (reset per step), and what a gc.collect() at the step's
    end frees (GPU memory held only by reference cycles).
`--mark-step-begin` calls torch.compiler.cudagraph_mark_step_begin() after every optimizer step.
What it found, and the fix (layers._drop_recompute_graph): bench/results/cuda-graphs-h200.md.

    python bench/graphs_memory_probe.py --arch qwen2.5-3b --quant 4bit --batch 4 --seq 512 --packing --steps 8
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402  (puts src/ on sys.path; the model, data and config of the comparison)


def main() -> None:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_trl.case_arguments(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mark-step-begin", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("graphs_memory_probe.py needs a GPU: CUDA graphs only replay there. Run it on the H200.",
              file=sys.stderr)
        raise SystemExit(2)
    from gpu_bench import WORK, build_model
    from vs_trl_workers import relaytune_config

    import relaytune
    from relaytune import layers
    from relaytune.training import loss as loss_module
    from relaytune.training import step as _step  # noqa: F401  (imports causal_lm_loss by name: patched below)

    args.warmup, args.save_steps = 0, 0
    args.relaytune_set = (args.relaytune_set or []) + ["cuda_graphs=true"]
    args.model = str(build_model(args.arch))
    args.data = str(vs_trl.data_for(args, args.batch))
    out_dir = WORK / "graphs_probe"
    shutil.rmtree(out_dir, ignore_errors=True)

    state = {"step": 1, "call": 0}
    clones: list[tuple[int, int, object, int]] = []  # (step, call in step, weakref, storage pointer)
    original_forward = layers.RecomputedLayer.forward

    def forward(ctx, hidden, run, kwargs):
        out = original_forward(ctx, hidden, run, kwargs)
        state["call"] += 1
        t = out if isinstance(out, torch.Tensor) else out[0]
        clones.append((state["step"], state["call"], StorageWeakRef(t.untyped_storage()),
                       t.untyped_storage().data_ptr()))
        return out

    layers.RecomputedLayer.forward = staticmethod(forward)

    def live_by_step() -> dict[int, int]:
        return dict(sorted(Counter(s for s, _, ref, _ in clones if not ref.expired()).items()))

    original_loss = loss_module.causal_lm_loss

    def causal_lm_loss(*a, **k):
        print(f"step {state['step']}: at the head loss, live clones by step {live_by_step()} "
              f"allocated {torch.cuda.memory_allocated() / 2**30:.3f} GiB", flush=True)
        return original_loss(*a, **k)

    loss_module.causal_lm_loss = causal_lm_loss
    for name, module in list(sys.modules.items()):  # modules that imported the function by name
        if name.startswith("relaytune") and getattr(module, "causal_lm_loss", None) is original_loss:
            module.causal_lm_loss = causal_lm_loss

    def holders(storage_ptr: int) -> list[str]:
        found = []
        for obj in gc.get_objects():
            try:  # compile's fake tensors have no storage
                same = isinstance(obj, torch.Tensor) and obj.is_cuda and obj.untyped_storage().data_ptr() == storage_ptr
            except RuntimeError:
                continue
            if same:
                for ref in gc.get_referrers(obj):
                    if ref is not None and not isinstance(ref, type(gc.get_objects)):
                        kind = type(ref).__name__
                        extra = ""
                        if isinstance(ref, dict):
                            extra = " keys " + ",".join(map(str, list(ref)[:6]))
                        elif isinstance(ref, (list, tuple)):
                            extra = f" len {len(ref)}"
                        found.append(f"{kind}{extra}")
                found.append(f"tensor shape {tuple(obj.shape)} grad_fn {type(obj.grad_fn).__name__}")
        return found

    def after_step(optimizer, *_):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        unreachable = gc.collect()
        freed = (before - torch.cuda.memory_allocated()) / 2**30
        print(f"step {state['step']}: gc.collect() found {unreachable} objects and freed {freed:.3f} GiB", flush=True)
        step = state["step"]
        old = [(s, c, ptr) for s, c, ref, ptr in clones if not ref.expired() and s <= step]
        print(f"step {step} done: peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, "
              f"allocated {torch.cuda.memory_allocated() / 2**30:.3f}; live clones by step {live_by_step()}",
              flush=True)
        if old and step in (2, 4, 5):
            for s, c, ptr in old[:3]:
                print(f"  clone step {s} call {c}: holders {holders(ptr)[:8]}", flush=True)
        if args.mark_step_begin:
            torch.compiler.cudagraph_mark_step_begin()
        clones[:] = [x for x in clones if not x[2].expired()]
        state["step"], state["call"] = step + 1, 0
        torch.cuda.reset_peak_memory_stats()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(after_step)
    cfg = relaytune_config(args, out_dir)
    cfg["max_steps"] = args.steps
    relaytune.train(cfg)


if __name__ == "__main__":
    main()
