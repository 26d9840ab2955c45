"""The recipe: LoRA / QLoRA supervised fine-tuning, top to bottom.

    set-up:  config -> data (before any model loads) -> model -> optimizer -> resume
    loop:    one global batch per optimizer step, split into micro-batches;
             log, evaluate, checkpoint; stop cleanly on a signal or the deadline
    finish:  the last evaluation, best/, final/, and return

Exactness rests on three rules: the global batch of step s is a pure function of
(seed, s); the loss is normalised by the target tokens of the whole global batch, so
the micro-batch size does not change the maths; and every piece of state is saved and
restored at a step boundary. The parts live in trainer.py (the live objects),
step.py (one optimizer step), recovery.py (OOM, NaN), stops.py (signals, deadline)
and the checkpoint package (everything on disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relaytune import faults
from relaytune.checkpoint.lock import RunLock
from relaytune.config import load_config
from relaytune.log import info
from relaytune.run_dir import RunDir
from relaytune.training.stops import StopRequest
from relaytune.training.trainer import Trainer


@dataclass
class RunResult:
    status: str  # "finished" or "already finished"
    step: int | None  # the last step trained; None when the run had already finished
    output_dir: Path
    final_adapter: Path

    @property
    def already_finished(self) -> bool:
        return self.status == "already finished"


def train(config=None, /, *, fresh: bool = False, **overrides) -> RunResult:
    """Train, or continue the run in the config's output_dir. The CLI calls exactly this."""
    cfg = load_config(config, overrides)
    run = RunDir(Path(cfg.output_dir).expanduser().resolve())
    if run.is_finished():
        info(f"{run.root} holds a finished run (final/ is committed); nothing to do")
        return RunResult("already finished", None, run.root, run.final)
    faults.reset()  # a test's fault plan is read once per run
    with RunLock(run.root):  # one training process per run folder; a second one exits 2 touching nothing
        trainer = Trainer(cfg, run)
        # Signal handlers only set a flag. Installed when the loop starts and kept until train()
        # returns, so a second signal after the stop checkpoint is committed still ends in exit 75.
        stop = trainer.stop = StopRequest()
        try:
            trainer.setup(fresh)  # everything that can reject the config happens before the model loads
            trainer.run_loop()
            final = trainer.finish()
            return RunResult("finished", trainer.state.step, run.root, final)
        except BaseException as e:
            trainer.end_session(e)
            raise
        finally:
            trainer.close()
            stop.uninstall()
