"""The scaffold both local training stages (SFT, GRPO) share: seed and load the start policy,
resume only the run's own checkpoints, and end with the same outputs and MLflow logging.

    stage = TrainingStage.start(p.out, p.policy, seed=p.seed, threads=p.threads, device=p.device,
                                dtype=p.dtype)
    ...                                          # optimiser and scheduler of the trainer
    state = stage.resume(p.resume, identity, sources, opt, sched)
    while state.step < total:
        ...; stage.checkpoint(opt, sched, state, keep_last=p.keep_checkpoints)
    stage.finish(manifest, metrics, state.history, plots, prefix="sft_final")

Writes under `out`: `checkpoints/` (while the run goes), `model/` (HF folder with
`policy.json` = `manifest`), `metrics.json`, `history.jsonl`, `plots/*.png`. The trainers
keep their own loops (`mempo.training.sft`, `mempo.training.grpo`); only what they did the
same way lives here, so a change to seeding, resume or the final save is made once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CurvePlot:
    """One PNG of the training history: `keys` of the history rows against the step."""

    keys: Sequence[str]
    file: str  # under OUT/plots/
    title: str


def tracked(stage: str, tracking: bool, run: Callable[[], T], params: Any = None,
            data: Mapping[str, Any] | None = None) -> T:
    """`run()` inside an MLflow stage run `stage` (`mempo.tracking.stage_run`: an exception
    ends it FAILED), or plainly with `tracking` off."""
    if not tracking:
        return run()
    from mempo.tracking import stage_run

    with stage_run(stage, params=params, data=data):
        return run()


@dataclass
class TrainingStage:
    """A started training stage: its output folder, the start policy on its device."""

    out: Path
    model: Any
    tokenizer: Any
    device: Any

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    @classmethod
    def start(cls, out: str | Path, policy: str | Path, *, seed: int, threads: int | None, device: str,
              dtype: str) -> TrainingStage:
        """Seed everything (deterministic kernels; `threads` 0/None = torch's default), pick
        the device and load the start policy and its tokenizer."""
        from mempo.training.runtime import load_policy, resolve_device, seed_everything

        seed_everything(seed, deterministic=True, threads=threads or None)
        dev = resolve_device(device)
        model, tok = load_policy(policy, dev, dtype)
        return cls(Path(out), model, tok, dev)

    def resume(self, mode: str | None, identity: Mapping[str, Any], sources: Mapping[str, str | Path | None],
               optimizer: Any, scheduler: Any) -> Any:
        """The `TrainerState` to continue from: the newest checkpoint of this very run
        (`mode` "auto"; params `identity` and the contents of `sources` make its fingerprint:
        a changed start policy, data or index is another run, whose checkpoints are moved
        aside), loaded into model, optimiser and scheduler; else a fresh state."""
        from mempo.training.checkpoint import TrainerState, resume_training
        from mempo.training.fingerprint import HASH_CACHE_FILE, run_fingerprint

        fingerprint = run_fingerprint(identity, sources, self.ckpt_root / HASH_CACHE_FILE)
        return resume_training(mode, self.ckpt_root, fingerprint, self.model, optimizer, scheduler) \
            or TrainerState(extra={"fingerprint": fingerprint})

    def checkpoint(self, optimizer: Any, scheduler: Any, state: Any, keep_last: int) -> None:
        """Save model, optimiser, scheduler and `state` atomically, keeping the last `keep_last`."""
        from mempo.training.checkpoint import save_checkpoint

        save_checkpoint(self.ckpt_root, self.model, optimizer, scheduler, state, keep_last=keep_last)

    def finish(self, manifest: Mapping[str, Any], metrics: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
               plots: Sequence[CurvePlot], prefix: str) -> None:
        """Save OUT/model (with `manifest` as its policy.json), metrics.json, history.jsonl and
        the curves; log metrics (`prefix`/...), metrics.json, plots and the model to the active
        MLflow run; then delete the checkpoints: a finished run is never resumed again."""
        from mempo.io import write_json, write_jsonl
        from mempo.tracking import log_file, log_json, log_metrics, log_plot
        from mempo.training.checkpoint import retire_checkpoints
        from mempo.training.plots import plot_curves
        from mempo.training.runtime import save_policy

        save_policy(self.model, self.tokenizer, self.out / "model", dict(manifest))
        write_json(self.out / "metrics.json", dict(metrics))
        write_jsonl(self.out / "history.jsonl", history)
        for plot in plots:
            plot_curves(history, list(plot.keys), self.out / "plots" / plot.file, title=plot.title)
        log_metrics(metrics, prefix=prefix)
        log_json(self.out / "metrics.json")
        log_plot(self.out / "plots")
        log_file(self.out / "model", artifact_path="model")
        retire_checkpoints(self.ckpt_root)
