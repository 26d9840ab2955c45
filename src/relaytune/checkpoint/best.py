"""The best checkpoint: `best/` and `load_best_model_at_end`.

Training tracks the lowest eval loss (TrainState.best_eval_loss / best_step) and
retention never deletes that step's checkpoint. At the end, `keep_best` commits
`best/`: a copy of that adapter in PEFT format, by the same commit protocol as
every checkpoint. A copy rather than a pointer file because a pointer can dangle
(a user deletes checkpoints, a mirror restores only some, or the best is the last
step, which has no step-N folder), while best/ is a self-contained folder that
PeftModel.from_pretrained, export and compare use directly. It costs one adapter
on disk (LoRA: megabytes).

With `load_best_model_at_end` the best weights are also put into the live model,
so the recipe's ordinary final save writes them to final/. Both runs, interrupted
or not, pick the same step, so final/ stays byte-identical across resumes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from relaytune.atomic import TMP_PREFIX, commit_folder, read_manifest, verify
from relaytune.checkpoint.state import TrainState, adapter_files
from relaytune.log import info, warn
from relaytune.run_dir import ADAPTER, ADAPTER_CONFIG, RunDir


def keep_best(cfg, model, c: TrainState, run: RunDir, run_info=None) -> Path | None:
    """Call once at finish, after the last eval and before final/ is committed. `run_info(step)`: the
    config, data fingerprint and base model, kept in best/'s manifest so best/ stands alone."""
    if c.best_step is None:
        return None  # no eval data, so no best
    if c.best_step == c.step:
        files = adapter_files(model)  # the last step is the best: its adapter is the live one
    else:
        src = run.step(c.best_step)
        reason = verify(src)
        if reason is not None:
            warn(f"the best checkpoint (step {c.best_step}, eval loss {c.best_eval_loss:.4f}) is not "
                 f"available ({reason}); best/ not written and final/ keeps the last adapter")
            return None
        files = {name: (src / name).read_bytes() for name in (ADAPTER, ADAPTER_CONFIG)}
    target = run.best
    for leftover in run.root.glob(f"{TMP_PREFIX}best-*"):  # our own unfinished copy from a killed session
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        if not _same(target, files, c.best_step):  # a re-run after a kill past this point: keep it
            commit_folder(files, target, {"kind": "best", "step": c.best_step, "eval_loss": c.best_eval_loss,
                                          **({"run": run_info(c.best_step)} if run_info else {})})
        info(f"best/ holds the adapter of step {c.best_step} (eval loss {c.best_eval_loss:.4f})")
    except OSError as e:  # final/ matters more than its copy: go on and commit it
        warn(f"best/ could not be written ({e}); checkpoints/step-{c.best_step} still holds it")
        target = None
    if cfg.load_best_model_at_end and c.best_step != c.step:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load

        set_peft_model_state_dict(model, load(files[ADAPTER]))
        info(f"load_best_model_at_end: final/ gets the adapter of step {c.best_step}, not step {c.step}")
    return target


def _same(target: Path, files: dict[str, bytes], step: int) -> bool:
    import hashlib

    if verify(target) is not None:
        return False
    manifest = read_manifest(target)
    return manifest.get("step") == step and \
        manifest["files"][ADAPTER]["sha256"] == hashlib.sha256(files[ADAPTER]).hexdigest()
