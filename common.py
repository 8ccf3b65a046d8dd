"""Shared plumbing for every script: seeding, devices, tasks and verifiers, model loading, the rollout
seam, per-token log-probs, masked reductions, the metrics tracker, checkpoints and a timer.

Rule (DESIGN.md section 4): plumbing only. Advantages, losses and rollout structures stay in the scripts.
A helper lives here only when at least three scripts need it as is. Budget: about 600 lines.
"""
from __future__ import annotations

import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent


# ---- seeding and device ----
def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable on one machine."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- tracker ----
class Tracker:
    """Writes metrics.jsonl (always), mirrors to wandb when `track` is set, and writes summary.json.

    `log({"rollout/reward": 0.5}, step)` appends one JSON line; `finish(summary)` writes summary.json
    and returns the summary. Use WANDB_MODE=offline to track without a network.
    """

    def __init__(self, out_dir: str | Path, config, track: bool = False, project: str = "rl-reference",
                 run_name: str | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cfg = asdict(config) if is_dataclass(config) else dict(config)
        (self.out_dir / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        self._file = open(self.out_dir / "metrics.jsonl", "a")
        self.wandb = None
        if track:
            import wandb  # lazy: only when asked for

            self.wandb = wandb.init(project=project, name=run_name, config=cfg, dir=str(self.out_dir))

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _to_py(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def finish(self, summary: dict) -> dict:
        summary = {k: _to_py(v) for k, v in summary.items()}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._file.close()
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        return summary


def _to_py(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


# ---- timer ----
class Timer:
    """Accumulates wall time per name: `with timer("gen"): ...`; `timer.pop()` returns and resets."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out
