"""The Trainer: holds a run's live objects and does each part of the recipe.

recipe.py reads top to bottom (setup, run, finish); the mechanics of each part are here.
Saved progress is `TrainState`; what the run learned about itself (micro-batch in force,
learning-rate scale, bad steps in a row) is `Recovery`; the logging window is `LogWindow` (step_log.py).
The data cursor is not stored: the global batch of step s is a pure function of (seed, s).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaytune import faults
from relaytune.checkpoint import Checkpointer, Live, TrainState
from relaytune.checkpoint.load import Damaged, Loaded
from relaytune.checkpoint.state import capture_rng, nonfinite, progress_of, recovery_of, reset_rng
from relaytune.config import TrainConfig
from relaytune.data import prepare_data
from relaytune.data.batches import DataOrder, total_steps
from relaytune.data.packing import check_isolation
from relaytune.distributed import agree, fsdp, world
from relaytune.embedding_offload import place_input_embedding
from relaytune.errors import StoppedEarly, StopReason, UserError
from relaytune.log import info, warn
from relaytune.model import (
    check_trainable,
    choose_precision,
    enable_checkpointing,
    load_model,
    load_tokenizer,
    resolve_source,
)
from relaytune.observe.metrics import MetricsLog, SessionLog
from relaytune.observe.trackers import open_trackers
from relaytune.run_dir import RunDir
from relaytune.training import autobatch, continuation, rollback, step_log, stopping
from relaytune.training.environment import time_budget, warn_storage
from relaytune.training.evaluation import eval_loss
from relaytune.training.optim import build_optimizer, build_scheduler, warn_short_schedule
from relaytune.training.preflight import Report, check_built, check_gpu
from relaytune.training.recovery import (
    NoSmallerBatch,
    Recovery,
    forget_unscale,
    free_memory,
    prefer_expandable_segments,
    redo_after_oom,
    release_gpu,
)
from relaytune.training.speedups import batch_width, restore_compiler_settings
from relaytune.training.step import StepParts, StepResult, optimizer_step
from relaytune.training.step_log import LogWindow, peak_memory
from relaytune.training.stops import Abandoned, StoppedBeforeTraining, StopRequest, safe_points


class Trainer:
    world = world.World()  # one process unless __init__ finds a process group (world.current())

    def __init__(self, cfg: TrainConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.checkpointer = Checkpointer(cfg, run)
        self.sessions: SessionLog | None = None
        self.state = TrainState()
        self.window = LogWindow()
        self.step_seconds = 0.0
        self.bar = None
        self.trackers = None
        self.stop: StopRequest | None = None  # set by the recipe: the signal flag, held for the whole run
        self.scaler_skips = 0  # fp16: updates the gradient scaler skipped this session (logged, not bad steps)
        self.rollbacks: list[tuple[int, int]] = []  # (step rolled back to, step that failed), this session
        self.world = world.current()  # rank and world size; one process: every helper is a no-op

    # --- set-up ----------------------------------------------------------------------------
    def setup(self, fresh: bool) -> None:
        """Everything that can reject the config or the data happens before the model loads."""
        cfg = self.cfg
        self.run.root.mkdir(parents=True, exist_ok=True)
        warn_storage(self.run.root)
        # Rank 0 alone cleans up and chooses the checkpoint; every rank gets its choice.
        start_from = self.world.decide(lambda: self.checkpointer.resume_point(fresh))
        prefer_expandable_segments()  # before the first CUDA allocation
        self.precision = choose_precision(cfg)
        check_trainable(cfg, self.precision)
        self.deadline = time_budget(cfg)
        report = Report()
        report.add("time", self.deadline.describe())
        with self.world.rank0_first():  # rank 0 fills the caches (model decoding, tokenization); the others read
            source = resolve_source(cfg)
            self.tokenizer = load_tokenizer(cfg, source)
            from relaytune.data.cache import reading_from  # a relayed run reads its source's cache (read only)
            with reading_from(self.checkpointer.relay_caches()):
                self.data = prepare_data(cfg, self.tokenizer)
        start_from = self.world.decide(lambda: self.checkpointer.relay_pick(start_from, self.data.fingerprint))
        self.order = DataOrder(len(self.data.train), cfg.global_batch_size, cfg.seed)
        self.total = total_steps(len(self.data.train), cfg.global_batch_size, cfg.num_train_epochs, cfg.max_steps)
        warn_short_schedule(cfg, self.total)
        loaded = continuation.load_agreed(self.world, self.checkpointer, start_from, self._check_resumable)
        # `auto` micro-batch / checkpointing planned for this GPU (or kept from the checkpoint if made on it)
        self.auto = autobatch.choose(cfg, loaded.state if loaded else None,
                                     source.path if not source.gguf_file else None)
        # FSDP (distributed/fsdp.py) when asked, or when the replicated base would not leave room
        self.sharded = fsdp.sharded(cfg, self.world, self.auto.frozen_bytes)
        if self.sharded:  # planned again with each GPU's share of the base
            loads = cfg.model_copy(update={"fsdp": True, **fsdp.load_settings(cfg, self.precision.dtype)})
            autobatch.shard(self.auto, loads, self.world.size)
        check_gpu(report, self.auto.frozen_bytes)
        faults.model_loading()
        self._build(source, report)
        self._start(loaded)

    def _check_resumable(self, saved: dict) -> None:
        continuation.check_resumable(saved, self.cfg, self.data.fingerprint, self.precision.device)

    def _build(self, source, report: Report) -> None:
        """The model with its adapter, the optimizer, schedule and scaler; then the disk check."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the LoRA initialisation; a resume overwrites it
        auto = self.auto
        update = auto.load_settings()
        if self.sharded:
            update.update(fsdp.load_settings(cfg, self.precision.dtype))
        model = load_model(cfg.model_copy(update=update), self.precision, source, to_shard=self.sharded)
        if self.sharded:
            fsdp.shard(model, self.world)
            report.add("strategy", f"FSDP2: the base sharded over {self.world.size} processes, LoRA replicated")
        if row := place_input_embedding(model, cfg, self.precision.device, self.sharded):
            report.add("input embedding", row)
        if cfg.packing and (why := check_isolation(model)):
            raise UserError(f"`packing`: {why}; set packing: false")
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer, self.total)
        scaler = torch.amp.GradScaler("cuda") if self.precision.use_grad_scaler else None
        self.live = Live(model, optimizer, scheduler, scaler)
        self.parts = StepParts(model, optimizer, scaler, self.precision, self.tokenizer.pad_token_id,
                               cfg.max_grad_norm, width=batch_width(model, cfg))
        if not self.sharded:  # a trial OOM on one rank would leave the others in an all-gather
            autobatch.confirm(auto, self.parts, self.data.train, cfg, enable_checkpointing)
        for row in autobatch.table_rows(auto, cfg.global_batch_size):
            report.add(*row)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # loading (bf16 shards before quantizing) is not training
        check_built(report, model, cfg, auto, self.precision, self.run.root)
        if self.world.is_main:  # every rank checked its own GPU and disk; one table is enough
            report.print()

    def _start(self, loaded: Loaded | None) -> None:
        """Restore the checkpoint (or take the state to roll back to), open the logs.

        A checkpoint that does not fit the live objects, or fails to go in, is set aside and the one
        before it restored instead; applying is all or nothing (checkpoint/load.py), so the live
        objects are never left half restored, and with none left the run starts fresh."""
        cfg = self.cfg
        main = self.world.is_main  # only rank 0 writes metrics.jsonl, sessions.jsonl and the trackers
        self.metrics = MetricsLog(self.run.metrics) if main else world.Silent()
        micro = self.auto.micro_batch  # the configured micro-batch, or the one `auto` chose
        self.recovery = Recovery(micro, math.ceil(cfg.global_batch_size / micro))
        while loaded is not None:
            try:
                self._restore(loaded)
                break
            except Damaged as e:
                older = self.checkpointer.give_up_on(loaded.path, str(e))
                loaded = continuation.load_resumable(self.checkpointer, older, self._check_resumable)
        start_from = loaded.path if loaded else None
        if loaded:
            self.metrics.reset_to(loaded.metrics)
            continuation.follow_micro_batch_setting(self.recovery, self.auto, self.cfg.global_batch_size,
                                                    loaded.state["config"]["per_device_train_batch_size"],
                                                    loaded.state.get("auto_choice"))
        else:
            self.metrics.reset_to("")
        self._follow_oom_request()
        self.sessions = SessionLog(self.run.sessions) if main else world.Silent()
        self.sessions.start(from_step=self.state.step, total_steps=self.total, world_size=self.world.size)
        self.trackers = open_trackers(cfg, self.run.root, self.state.step, self.sessions.session) if main \
            else world.Silent()
        self.world.broadcast_params([p for p in self.live.model.parameters() if p.requires_grad])
        self.metrics.add_sink(self.trackers)
        info(f"{len(self.data.train)} training rows, global batch {cfg.global_batch_size}, "
             f"{self.total} steps; starting at step {self.state.step}; {self.precision.device} "
             f"{str(self.precision.dtype)[6:]}")
        # The rollback point for repeated NaNs when no checkpoint exists yet.
        self.initial_state = self.snapshot() if not start_from else None

    def _follow_oom_request(self) -> None:
        """Under FSDP an OOM restarted the workers (continuation.restart_after_oom): take its micro-batch."""
        applied = continuation.follow_oom_request(self.run, self.recovery, self.cfg, self.state.step, self.world,
                                                  self.checkpointer.rollback_point)
        if applied is not None:
            step, old, new = applied
            self.metrics.write({"step": step, "event": "oom", "micro_batch_size": new, "was": old, "restarted": True})

    def _restore(self, loaded: Loaded) -> None:
        saved = self.checkpointer.restore(loaded, self.live)
        self.state = progress_of(saved)
        extra = recovery_of(saved)
        self.recovery = Recovery(**{k: extra[k] for k in Recovery.__dataclass_fields__})
        window = saved.get("log_window") or extra
        self.window = LogWindow(window["window_loss"], window["window_steps"])

    @property
    def strategy(self) -> str:
        """How the ranks share the work, as the checkpoint records it (its files are the same for all)."""
        return "fsdp" if self.parts.sharded else ("replicated" if self.world.distributed else "single")

    def snapshot(self) -> dict:
        """Every file of a checkpoint at this step boundary (tensors serialised later)."""
        from relaytune.checkpoint.state import snapshot

        state = {"progress": asdict(self.state), "recovery": asdict(self.recovery),
                 "log_window": asdict(self.window), "config": self.cfg.model_dump(mode="json"),
                 "data_fingerprint": self.data.fingerprint, "total_steps": self.total,
                 "torch_threads": torch.get_num_threads(), "auto_choice": self.auto.record(),
                 "world_size": self.world.size, "strategy": self.strategy}
        return snapshot(self.live, state, self.metrics.text(), include_optimizer=not self.cfg.save_only_model)

    # --- the loop --------------------------------------------------------------------------
    def run_loop(self) -> None:
        """One global batch per optimizer step; log, evaluate, checkpoint; stop on a signal or the deadline."""
        self.live.model.train()
        self.bar = tqdm(total=self.total, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not self.world.is_main)
        own = self.stop is None  # the Python API's Trainer used on its own: handlers for the loop only
        stop = self.stop = self.stop or StopRequest()
        stop.eta, stop.finish_writes = self._seconds_to_stop, self.checkpointer.close
        # A second signal abandons the step at the next layer; not under FSDP, where a rank that left
        # mid-forward would leave the others in an all-gather: there the step ends, then the save.
        hooks = [] if self.parts.sharded else \
            [m.register_forward_pre_hook(stop.check) for m in safe_points(self.live.model)]
        self.parts.prefetch.rows_of = self.global_batch
        self.parts.prefetch.steps = self.total
        self.step_started = time.monotonic()
        try:
            stop.install()
            while self.state.step < self.total:
                t0 = self.step_started = time.monotonic()
                ids, rows = self.parts.prefetch.rows(self.state.step)  # made ahead while the last step ran
                faults.rows_trained(self.state.step, self.world.rank, self.world.share(ids))
                result = self.step(rows)
                if not self.record(result, rows, t0):
                    continue  # rolled back to a checkpoint: the steps after it are redone
                self.maybe_evaluate()
                faults.step_ended(self.state.step)
                stop.check()  # a second signal during this step: leave without saving it
                if self.world.distributed:  # a stop on any rank stops every rank at this step boundary
                    stopping.agreed_stop(self, stop)
                elif stop.requested or self.deadline.must_stop(self.step_seconds, self.checkpointer.save_seconds):
                    self.stop_and_save(stop)
                self.maybe_save()
        except Abandoned:
            self.abandon_step(stop)
        finally:
            for h in hooks:
                h.remove()
            if own:
                stop.uninstall()

    def global_batch(self, step: int) -> tuple[list[int], list]:
        """The row ids of `step`'s global batch (a pure function of seed and step) and their rows."""
        ids = self.order.batch_rows(step)
        return ids, [self.data.train[i] for i in ids]

    def _seconds_to_stop(self) -> float | None:
        if not self.step_seconds:
            return None
        left = max(0.0, self.step_seconds - (time.monotonic() - self.step_started))
        return left + self.checkpointer.save_seconds

    def step(self, rows: list) -> StepResult:
        """One optimizer step. An OOM redoes it from the same RNG state: at the same micro-batch when
        it could give up CUDA graphs or the compiled checkpoint (recovery.free_memory), else at half."""
        if self.world.distributed:
            # Each rank's dropout stream is a function of (seed, step, rank): the same for the same
            # world size whatever was killed and resumed; no per-rank RNG state to checkpoint.
            torch.manual_seed(hash((self.cfg.seed, self.state.step, self.world.rank)) & 0x7FFF_FFFF_FFFF_FFFF)
        step_rng = capture_rng()
        while True:
            try:
                return optimizer_step(self.parts, rows, self.recovery.micro_batch_size, self.state.step)
            except torch.OutOfMemoryError as e:
                if self.parts.sharded:  # the peers wait in an all-gather: only a restart of all brings them back
                    continuation.restart_after_oom(self.run, self.recovery, self.cfg.global_batch_size,
                                                   self.state.step, e)
                failed_peak = peak_memory()  # the failed attempt's, for the event; later steps report their own
                forget_unscale(self.live.scaler)
                released = agree.all_released(self.world, free_memory(self.live.optimizer, self.live.model))
                reset_rng(step_rng)
                try:
                    how = redo_after_oom(self.recovery, self.cfg.global_batch_size, self.state.step, e, released)
                except NoSmallerBatch:
                    self.stop_after_oom()
                self.metrics.write({"step": self.state.step, "event": "oom", **how, **failed_peak})

    def record(self, result: StepResult, rows: list, t0: float) -> bool:
        """Count the step, log it; False when repeated non-finite steps rolled the run back."""
        return step_log.record_step(self, result, rows, t0)

    def maybe_evaluate(self) -> None:
        steps = self.cfg.eval_steps
        if self.data.eval and steps and self.state.step % steps == 0 and self.state.step < self.total:
            self.evaluate()

    def evaluate(self) -> float:
        """Token-weighted mean loss over the eval rows. Uses no RNG (dropout is off)."""
        value, _ = eval_loss(self.live.model, self.data.eval, self.recovery.micro_batch_size,
                             self.tokenizer.pad_token_id, self.precision, batch_width(self.live.model, self.cfg))
        self.live.model.train()
        s = self.state
        s.last_eval_loss = value
        if s.best_eval_loss is None or value < s.best_eval_loss:
            s.best_eval_loss, s.best_step = value, s.step
            self.checkpointer.mark_best(s.step)
        self.metrics.write({"step": s.step, "eval_loss": round(value, 6)})
        return value

    def unsafe_to_save(self) -> str | None:
        """Why the live state must not become a checkpoint (a non-finite weight or optimizer state:
        a rollback would land on it for ever), logged as an event; None if it is safe."""
        why = nonfinite(self.live)
        if why is not None:
            warn(f"not saving a checkpoint at step {self.state.step}: {why} is not finite "
                 "(the last committed checkpoint stays the one to return to)")
            self.metrics.write({"step": self.state.step, "event": "checkpoint_skipped", "reason": f"non-finite {why}"})
        return why

    def maybe_save(self) -> None:
        step = self.state.step
        # Rank 0 alone snapshots and commits: every rank holds the same adapter and optimizer state
        # at this step boundary (their summed gradients are equal), so rank 0's copy is the run's.
        if self.world.is_main and self.checkpointer.due(step, self.total):
            if not self.unsafe_to_save():
                self.checkpointer.save(self.snapshot, step)
                self.metrics.write({"step": step, "event": "checkpoint",
                                    "blocked_seconds": round(self.checkpointer.blocked_seconds, 4)})
        if not self.world.distributed:  # several ranks: agreed in stopping.agreed_stop, before the next save
            self.checkpointer.raise_if_failing(step)

    # --- recovery and stopping ---------------------------------------------------------------
    def roll_back(self) -> None:
        """Repeated non-finite steps: return to the last committed state, then lower the LR or stop."""
        rollback.roll_back(self)

    def stop_after_oom(self) -> None:
        stopping.stop_after_oom(self)

    def stop_and_save(self, stop: StopRequest, signal: bool | None = None) -> None:
        stopping.stop_and_save(self, stop, signal)

    def abandon_step(self, stop: StopRequest) -> None:
        stopping.abandon_step(self, stop)

    # --- the end -----------------------------------------------------------------------------
    def finish(self) -> Path:
        """The last evaluation, best/, final/; the session is recorded as finished."""
        if self.data.eval:
            self.evaluate()
        final = self.world.decide(lambda: self.checkpointer.finish(self.live, self.state))  # rank 0 commits final/
        self.metrics.write({"step": self.state.step, "event": "finished", "skipped_steps": self.state.skipped_steps})
        self.sessions.end("finished", self.state.step)
        self.checkpointer.drain_mirror()
        return final

    def end_session(self, error: BaseException) -> None:
        """Record how the session ended; a stop on purpose gives the mirror a minute to catch up."""
        if self.sessions is None:
            return
        if isinstance(error, StoppedEarly):
            self.sessions.end(error.how, self.state.step)
            self.checkpointer.drain_mirror(timeout=60)
        elif isinstance(error, StoppedBeforeTraining):
            self.sessions.end(StopReason.SIGNAL, self.state.step)
        else:
            self.sessions.end(f"error: {type(error).__name__}", self.state.step)

    def close(self) -> None:
        """Every way out: close the sinks, let the writer finish, free model and GPU memory, restore Dynamo's config."""
        if self.trackers is not None:
            self.trackers.close()
        if self.bar is not None:
            self.bar.close()
        self.checkpointer.close()
        # An exception kept by the caller holds this frame: drop every reference to the model here.
        self.__dict__.clear()
        release_gpu()
        restore_compiler_settings()
