"""Where relaytune's peak GPU memory goes: a CUDA memory-history recording, attributed at the peak.

Trains a few steps (with one checkpoint save inside them) through `relaytune.train`, with
torch.cuda.memory._record_memory_history(max_entries=200000) on from before the model loads.
Then, from torch.cuda.memory._snapshot() (segments/blocks and device_traces):
  1. every allocation's lifetime is rebuilt from the trace (alloc .. free_requested, which is when
     torch's allocated-bytes counter drops), and allocated(t) and reserved(t) are replayed;
  2. the peak of allocated bytes after training starts (the first allocation made from
     relaytune/training/step.py) is found;
  3. the blocks live at that moment are grouped by their allocation stacks:
       frozen weights            allocated before training started, not LoRA parameters
       LoRA params               pointers of the optimizer's parameters (global step hook)
       LoRA grads                AccumulateGrad frames, or the optimizer's .grad pointers
       LoRA optimizer state      torch/optim or bitsandbytes/optim frames, or the optimizer's state pointers
       checkpoint staging        relaytune/checkpoint/ frames (state.py clones the tensors to save)
       loss chunks               relaytune/training/loss.py frames (_chunk_loss, and the label gather)
       recomputed layer          torch/utils/checkpoint.py frames outside the loss: the layer being recomputed
       saved activations         forward allocations (under step.py) still live: checkpointed layer inputs
       backward temporaries      allocations with no Python frames (autograd engine): activation grads
       other                     the rest, with its top call sites
     plus allocator slack = reserved - allocated at the peak.
Prints a table in GiB and writes a JSON summary (no pickle is written anywhere).

The run is bench/vs_trl.py's relaytune worker's config for the same case arguments (--packing,
--adapter-dtype, --relaytune-set), so a snapshot explains a row of the side-by-side table.

    python bench/memory_snapshot.py --arch qwen2.5-3b --quant none --batch 4 --packing --out lora.json
    python bench/memory_snapshot.py --arch qwen2.5-3b --quant 4bit --batch 4 --seq 512 --packing --out ...
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402  (puts src/ on sys.path; the model, data and config of the comparison)

GIB = 2**30
CATEGORIES = ["frozen weights", "LoRA params", "LoRA grads", "LoRA optimizer state", "checkpoint staging",
              "loss chunks", "recomputed layer", "saved activations", "backward temporaries",
              "allocated before the trace (unknown)", "other"]


# --- reading the trace -------------------------------------------------------------------------
def _files(frames) -> list[str]:
    return [f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames or []]


def _has(frames, text: str) -> bool:
    return any(text in s for s in _files(frames))


def _python_frames(frames) -> list[dict]:
    return [f for f in frames or [] if str(f.get("filename", "")).endswith(".py")]


def lifetimes(trace: list[dict], end_blocks: list[dict]):
    """[(start_index, end_index, addr, size, frames)] for every block live at some point of the trace.

    start -1: allocated before the trace began; end len(trace): still live at the snapshot.
    """
    n = len(trace)
    live: dict[int, tuple[int, int, list]] = {}
    pending: set[int] = set()  # free requested, not yet completed
    out = []
    for i, e in enumerate(trace):
        a, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if a == "alloc":
            live[addr] = (i, size, e.get("frames") or [])
        elif a == "free_requested":
            if addr in live:
                s, sz, fr = live.pop(addr)
                out.append((s, i, addr, sz, fr))
            else:
                out.append((-1, i, addr, size, []))
            pending.add(addr)
        elif a == "free_completed":
            if addr in pending:
                pending.discard(addr)
            elif addr in live:
                s, sz, fr = live.pop(addr)
                out.append((s, i, addr, sz, fr))
            else:
                out.append((-1, i, addr, size, []))
    allocated_in_trace = {addr for addr in live}
    for addr, (s, sz, fr) in live.items():
        out.append((s, n, addr, sz, fr))
    for b in end_blocks:  # live at the end, allocated before the trace began
        if b["address"] not in allocated_in_trace:
            out.append((-1, n, b["address"], b["size"], b.get("frames") or []))
    return out


def reserved_series(trace: list[dict], reserved_end: int) -> list[int]:
    """Reserved bytes just after each trace event, replayed backwards from the snapshot's segments."""
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    series = [0] * len(trace)
    r = reserved_end
    for i in range(len(trace) - 1, -1, -1):
        series[i] = r
        d = delta.get(trace[i].get("action"))
        if d:
            r -= d * trace[i].get("size", 0)
    return series


def classify(block, training_start: int, ptrs: dict[str, list[int]]) -> str:
    start, _, addr, size, frames = block

    def hit(kind):
        lst = ptrs.get(kind) or []
        j = bisect.bisect_left(lst, addr)
        return j < len(lst) and lst[j] < addr + size

    if hit("lora_params"):
        return "LoRA params"
    if start >= 0 and start < training_start:
        return "frozen weights"
    if start < 0 and not frames:
        return "allocated before the trace (unknown)"
    if _has(frames, "relaytune/checkpoint/"):
        return "checkpoint staging"
    if hit("optimizer_state") or _has(frames, "torch/optim/") or _has(frames, "bitsandbytes/optim"):
        return "LoRA optimizer state"
    if _has(frames, "AccumulateGrad") or hit("grads"):
        return "LoRA grads"
    if _has(frames, "relaytune/training/loss.py:_chunk_loss"):
        return "loss chunks"
    if _has(frames, "torch/utils/checkpoint.py") and not _has(frames, "relaytune/training/step.py"):
        return "recomputed layer"
    if _has(frames, "relaytune/training/loss.py"):
        # under causal_lm_loss but not in a chunk: the decoder forward, or the label/hidden gather
        own = [f for f in _python_frames(frames) if "/torch/" not in str(f.get("filename", ""))]
        if own and own[0].get("name") == "causal_lm_loss":  # allocated by the loss code itself
            return "loss chunks"
        return "saved activations"
    if _has(frames, "relaytune/training/step.py"):
        return "saved activations"
    if not _python_frames(frames):
        return "backward temporaries"
    return "other"


def _frame_text(f: dict) -> str:
    """`dir/dir/file.py:line name`: a frame as the reports print it."""
    return f"{'/'.join(str(f.get('filename', '')).split('/')[-3:])}:{f.get('line')} {f.get('name')}"


def call_site(frames) -> str:
    """The innermost Python frame outside torch's own files, for the 'top sites' lists."""
    py = _python_frames(frames)
    for f in py:
        name = str(f.get("filename", ""))
        if "/torch/" not in name or "/torch/utils/checkpoint.py" in name:
            return _frame_text(f)
    if py:
        return _frame_text(py[0])
    cpp = [f.get("name", "") for f in frames or []][:2]
    return "C++: " + " < ".join(cpp) if cpp else "(no stack)"


def step_of(time_us: float | None, step_ends_us: list[float]) -> int | None:
    """The optimizer step (1-based) during which an event at `time_us` happened: one more than the
    steps that had ended by then. None without a time (an event from before the trace)."""
    return None if time_us is None else bisect.bisect_right(step_ends_us, time_us) + 1


def stack(frames, depth: int = 24) -> list[str]:
    """A block's Python stack, innermost first."""
    return [_frame_text(f) for f in _python_frames(frames)[:depth]]


def analyse(snapshot: dict, device: int, ptrs: dict[str, list[int]], max_entries: int = 0,
            step_ends_us: list[float] | None = None, peak_blocks: int = 0) -> dict:
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    end_blocks = [b for s in segments for b in s.get("blocks", []) if b.get("state") == "active_allocated"]
    reserved_end = sum(s.get("total_size", 0) for s in segments)
    blocks = lifetimes(trace, end_blocks)
    n = len(trace)
    training_start = next((i for i, e in enumerate(trace) if e.get("action") == "alloc"
                           and _has(e.get("frames"), "relaytune/training/step.py")), 0)
    # allocated just after event i = sum of blocks with start <= i < end
    diff = [0] * (n + 2)
    for s, e, _, size, _ in blocks:
        diff[s + 1] += size  # s = -1 -> index 0
        diff[e + 1] -= size
    allocated, running = [0] * (n + 1), 0
    for i in range(n + 1):
        running += diff[i]
        allocated[i] = running  # allocated[i] = after event i-1 (allocated[0] = before the trace)
    if n == 0:
        raise SystemExit("the memory history is empty: was recording on?")
    window = range(training_start + 1, n + 1)
    peak_i = max(window, key=lambda i: allocated[i])
    t = peak_i - 1  # the event at the peak
    at_peak = [b for b in blocks if b[0] <= t < b[1]]
    reserved = reserved_series(trace, reserved_end)
    groups: dict[str, dict] = {c: {"bytes": 0, "blocks": 0, "sites": defaultdict(int), "steps": defaultdict(int)}
                               for c in CATEGORIES}
    ends = sorted(step_ends_us or [])
    for b in at_peak:
        g = groups[classify(b, training_start, ptrs)]
        g["bytes"] += b[3]
        g["blocks"] += 1
        g["sites"][call_site(b[4])] += b[3]
        if ends:  # which step allocated it: a block from an earlier step than the peak's outlived its step
            g["steps"][step_of(trace[b[0]].get("time_us") if b[0] >= 0 else None, ends)] += b[3]
    largest = sorted(at_peak, key=lambda b: -b[3])[:peak_blocks]
    peak_bytes = allocated[peak_i]
    peak_reserved = reserved[t] if t < len(reserved) else reserved_end
    event = trace[t]
    return {
        "trace_events": n, "training_starts_at_event": training_start, "peak_event": t,
        "peak_event_action": event.get("action"), "peak_event_site": call_site(event.get("frames")),
        "peak_time_us": event.get("time_us"),
        "peak_allocated_gib": round(peak_bytes / GIB, 3),
        "reserved_at_peak_gib": round(peak_reserved / GIB, 3),
        "allocator_slack_gib": round((peak_reserved - peak_bytes) / GIB, 3),
        "trace_wrapped": bool(max_entries) and n >= max_entries,
        "training_start_found": training_start > 0,
        "peak_step": step_of(event.get("time_us"), ends) if ends else None,
        "categories": {c: {"gib": round(g["bytes"] / GIB, 3), "blocks": g["blocks"],
                           "top_sites": [{"site": k, "gib": round(v / GIB, 3)} for k, v in
                                         sorted(g["sites"].items(), key=lambda kv: -kv[1])[:8]],
                           "gib_by_allocating_step": {str(k): round(v / GIB, 3) for k, v in
                                                      sorted(g["steps"].items(), key=lambda kv: str(kv[0]))}}
                       for c, g in groups.items() if g["blocks"]},
        # --peak-blocks: what allocated the largest live blocks, and the peak event's own stack, in full
        "peak_event_stack": stack(event.get("frames")) if peak_blocks else [],
        "largest_blocks_at_peak": [
            {"mib": round(b[3] / 2**20, 2), "part": classify(b, training_start, ptrs),
             "step": step_of(trace[b[0]].get("time_us"), ends) if ends and b[0] >= 0 else None,
             "stack": stack(b[4])} for b in largest],
    }


# --- the run ---------------------------------------------------------------------------------------
def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_trl.case_arguments(p)  # the case exactly as bench/vs_trl.py runs it (packing, adapter dtype, ...)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; a checkpoint is saved at --save-at")
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--max-entries", type=int, default=200000)
    p.add_argument("--stacks", default="python", choices=["all", "python"],
                   help="python (default, fast); all: C++ frames too (finds AccumulateGrad; symbolizing is slow)")
    p.add_argument("--peak-blocks", type=int, default=0,
                   help="also write the N largest blocks live at the peak, and the peak event, with full Python stacks")
    p.add_argument("--out", help="JSON summary path (default: BENCH_WORK/memory-<case>.json)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("memory_snapshot.py needs a GPU: it records CUDA allocator history "
              "(torch.cuda.memory._record_memory_history), which the CPU has none of. Run it on the H200.",
              file=sys.stderr)
        raise SystemExit(2)
    from gpu_bench import RELAYTUNE_SRC, WORK, build_model
    from vs_trl_workers import relaytune_config

    import relaytune

    case = f"{args.arch}-{args.quant}-s{args.seq}-b{args.batch}{'-packed' if args.packing else ''}"
    args.warmup, args.save_steps = 0, args.save_at  # every step is recorded; vs_trl's names
    args.model = str(build_model(args.arch))
    args.data = str(vs_trl.data_for(args, args.batch))
    out_dir = WORK / "memory" / case
    shutil.rmtree(out_dir, ignore_errors=True)

    # Pointers of what the optimizer owns, from a global step hook (public API, no relaytune internals).
    seen: dict[str, set[int]] = {"lora_params": set(), "grads": set(), "optimizer_state": set()}

    step_ends_us: list[float] = []  # the trace's time_us is the wall clock in microseconds

    def after_step(optimizer, *_):
        step_ends_us.append(time.time() * 1e6)
        for group in optimizer.param_groups:
            for q in group["params"]:
                if q.is_cuda:
                    seen["lora_params"].add(q.data_ptr())
                    if q.grad is not None:
                        seen["grads"].add(q.grad.data_ptr())
                for v in optimizer.state.get(q, {}).values():
                    if torch.is_tensor(v) and v.is_cuda:
                        seen["optimizer_state"].add(v.data_ptr())

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(after_step)
    cfg = relaytune_config(args, out_dir)
    device = torch.cuda.current_device()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks=args.stacks,
                                             max_entries=args.max_entries)
    t0 = time.time()
    try:
        relaytune.train(cfg)
    finally:
        train_seconds = time.time() - t0
        torch_peak = torch.cuda.max_memory_allocated()
        t1 = time.time()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        handle.remove()
    snapshot_seconds = time.time() - t1
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    ptrs = {k: sorted(v) for k, v in seen.items()}
    result = analyse(snap, device, ptrs, args.max_entries, step_ends_us, args.peak_blocks)
    del snap
    result.update(
        case=case, arch=args.arch, quant=args.quant, seq=args.seq, batch=args.batch, accum=args.accum,
        packing=args.packing, adapter_dtype=cfg["adapter_dtype"], relaytune_set=args.relaytune_set or [],
        steps=args.steps, checkpoint_at=args.save_at, optim=args.optim, lora_dropout=args.lora_dropout,
        device=torch.cuda.get_device_name(device), torch=torch.__version__,
        relaytune_src=RELAYTUNE_SRC,
        torch_max_memory_allocated_gib=round(torch_peak / GIB, 3),
        metrics_peak_memory_gib=max((r.get("peak_memory_gib", 0) for r in records if "loss" in r), default=None),
        checkpoint_events=[r for r in records if r.get("event") == "checkpoint"],
        oom_events=[r for r in records if r.get("event") == "oom"],
        train_seconds=round(train_seconds, 1), snapshot_seconds=round(snapshot_seconds, 1),
        expandable_segments="expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    )
    print(f"### memory at the peak: relaytune {case} ({result['device']}, {time.strftime('%Y-%m-%d')})\n")
    print("| part | GiB | blocks | largest call site |\n|---|---|---|---|")
    for c in CATEGORIES:
        g = result["categories"].get(c)
        if g:
            top = g["top_sites"][0]["site"] if g["top_sites"] else ""
            print(f"| {c} | {g['gib']:.3f} | {g['blocks']} | `{top}` |")
    print(f"| **allocated at the peak** | **{result['peak_allocated_gib']:.3f}** | | "
          f"event {result['peak_event']} ({result['peak_event_action']} at `{result['peak_event_site']}`) |")
    print(f"| allocator slack (reserved - allocated) | {result['allocator_slack_gib']:.3f} | | "
          f"reserved {result['reserved_at_peak_gib']:.3f} |")
    print(f"\n- torch.cuda.max_memory_allocated since relaytune's reset after load: "
          f"{result['torch_max_memory_allocated_gib']} GiB; metrics.jsonl peak over steps: "
          f"{result['metrics_peak_memory_gib']} GiB")
    print(f"- the peak came in step {result['peak_step']}; live at it, by the step that allocated them: "
          + "; ".join(f"{c} {g['gib_by_allocating_step']}" for c, g in result["categories"].items()
                      if len(g["gib_by_allocating_step"]) > 1))
    if result["trace_wrapped"] or not result["training_start_found"]:
        print("- WARNING: the trace filled --max-entries or does not reach back to the first training step "
              "(raise --max-entries): blocks allocated before it are 'unknown'")
    out = Path(args.out) if args.out else WORK / f"memory-{case}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"- JSON summary: {out}")


if __name__ == "__main__":
    main()
