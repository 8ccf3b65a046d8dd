"""Autoregressive action-conditioned world model: teacher forcing, and chained forward training (--chained).

Method. A small conv net f predicts the next frame from the last K frames and the action,
p(x_{t+1} | x_{t-K+1..t}, a_t) = Bernoulli(sigmoid(f(x_{t-K+1..t}, a_t))), per pixel. At test time it rolls
out on its own predictions (the soft probabilities are fed back), so errors compound with the horizon.
This is the baseline (PAPERS.md section 3 row 27) that diffusion_world_model.py and live.py are compared with.

Papers. Teacher forcing is the standard baseline. `--chained` is Chained Forward Training from Memory
Forcing (A-5, papers/000_*.txt line 11): train on chained model rollouts, the model's own predictions
becoming the context of later steps.

Equations (function that implements each):
  (1) teacher forcing     L_TF = 1/H sum_h BCE(f(x_{t+h-K..t+h-1}, a_{t+h-1}), x_{t+h})        `tf_loss`
  (2) chained forward     L_CF = 1/H sum_h BCE(f(xhat_{t+h-K..t+h-1}, a_{t+h-1}), x_{t+h}),
                          xhat_s = x_s for s <= t, else sg[sigmoid(f(..))]                      `chained_loss`
                          --chained trains on (L_TF + L_CF) / 2
  (3) error at horizon h  err_h = mean over pixels and test trajectories of (xhat_{t+h} - x_{t+h})^2,
                          rolled out from ground-truth context with the true actions           `rollout`
  agent_err_h: fraction of test trajectories whose decoded agent cell at step h is wrong.

Deviations:
- A-5 trains a video diffusion model in Minecraft with spatial memory; here a deterministic per-pixel
  Bernoulli predictor on a tiny gridworld, and only the chained-training idea is kept.
- Chained predictions are fed back detached (no gradient through the chain) and soft (probabilities, not
  sampled), the simplest reading of "training on its own rollouts"; the first `chain_warmup` fraction of
  steps uses teacher forcing so the chain starts from a sensible model, and afterwards the objective is
  (L_TF + L_CF) / 2: with L_CF alone the soft feedback taught the model to blur the agent away (measured:
  agent cell wrong at h=1 in 91% of test trajectories, while the pixel MSE looked good).

Commands:
  python worldmodels/ar_world_model.py                       # teacher forcing, ~1 min on 1 CPU thread
  python worldmodels/ar_world_model.py --chained             # chained forward training
  python worldmodels/ar_world_model.py --device cuda --steps 20000 --channels 128   # one GPU, larger
Expected result (benchmarks/results/world_models.md, rows `ar` and `ar-chained`, seed 0): teacher forcing
gets one step almost exactly (pixel MSE 1e-4 vs 4.8e-3 for copying the last frame, agent cell always right)
and then compounds: MSE 0.12 at h=8, 0.30 at h=32, the agent fades and the objects brighten.
--chained keeps the pixel MSE small at every horizon (0.0066 at h=32, about the copy baseline) but does so
by blurring the agent away: its agent cell is wrong in 72% of rollouts already at h=1.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common
from worldmodels._envs import N_ACTIONS, N_CHANNELS, EnvConfig, agent_cells, collect


# ---- args ----
@dataclass
class Args:
    exp_name: str = "ar_world_model"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for data, init and sampling"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = "runs/ar_world_model"
    """where metrics.jsonl, summary.json and the PNG go"""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'"""
    threads: int = 1
    """torch CPU threads"""
    map_size: int = 10
    """gridworld cells per side (frames are map_size x map_size x 3)"""
    wall_density: float = 0.12
    """interior wall probability"""
    train_traj: int = 2000
    """training trajectories (sticky random policy)"""
    traj_len: int = 32
    """steps per training trajectory"""
    context: int = 2
    """K: past frames the model sees"""
    train_horizon: int = 8
    """H: steps per training window (the chain length with --chained)"""
    chained: bool = False
    """chained forward training (A-5): later steps see the model's own predictions"""
    chain_warmup: float = 0.25
    """fraction of steps trained with teacher forcing before chaining starts"""
    channels: int = 32
    """conv width"""
    steps: int = 1000
    """optimiser steps"""
    batch_size: int = 32
    """training windows per step"""
    lr: float = 2e-3
    """Adam learning rate (cosine decay to 10%)"""
    eval_traj: int = 256
    """held-out test trajectories"""
    eval_horizons: tuple[int, ...] = (1, 8, 16, 32)
    """horizons reported as err_h{H}; the largest sets the rollout length"""
    log_every: int = 100
    """steps between metric lines"""
    save_png: bool = True
    """save the strip of predicted vs true frames and the error curve"""


def check_args(args: Args) -> EnvConfig:
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    if args.train_horizon < 1 or args.train_horizon > args.traj_len:
        raise ValueError(f"--train-horizon must be in [1, traj_len={args.traj_len}], got {args.train_horizon}")
    if not args.eval_horizons or min(args.eval_horizons) < 1:
        raise ValueError(f"--eval-horizons must be positive integers, got {args.eval_horizons}")
    if args.steps < 1 or args.batch_size < 1 or args.train_traj < 1 or args.eval_traj < 1:
        raise ValueError("--steps, --batch-size, --train-traj and --eval-traj must be >= 1")
    if not 0.0 <= args.chain_warmup < 1.0:
        raise ValueError(f"--chain-warmup must be in [0, 1), got {args.chain_warmup}")
    return EnvConfig(map_size=args.map_size, wall_density=args.wall_density)


# ---- model ----
class Predictor(nn.Module):
    """x_{t-K+1..t} (B, K, C, F, F) + action (B,) -> next-frame logits (B, C, F, F)."""

    def __init__(self, context: int, channels: int):
        super().__init__()
        cin = context * N_CHANNELS + N_ACTIONS
        self.net = nn.Sequential(
            nn.Conv2d(cin, channels, 3, padding=1), nn.SiLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.SiLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.SiLU(),
            nn.Conv2d(channels, N_CHANNELS, 3, padding=1))

    def forward(self, ctx: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        b, k, c, h, w = ctx.shape
        a = F.one_hot(action, N_ACTIONS).float()[:, :, None, None].expand(b, N_ACTIONS, h, w)
        return self.net(torch.cat([ctx.reshape(b, k * c, h, w), a], 1))


def windows(frames: torch.Tensor, acts: torch.Tensor, starts: torch.Tensor, k: int, h: int):
    """Frames x_{s-K+1..s+H} (B, K+H, C, F, F) (indices below 0 repeat x_0) and actions a_{s..s+H-1} (B, H)."""
    idx = (starts[:, None] + torch.arange(-k + 1, h + 1)[None]).clamp(min=0)
    b = torch.arange(len(starts))[:, None]
    return frames[b, idx], acts[b, starts[:, None] + torch.arange(h)[None]]


# ---- losses ----
def tf_loss(model: Predictor, win: torch.Tensor, acts: torch.Tensor, k: int) -> torch.Tensor:
    """Eq. (1): every step sees ground-truth context."""
    h = acts.shape[1]
    ctx = torch.stack([win[:, j:j + k] for j in range(h)], 1).flatten(0, 1)  # (B*H, K, C, F, F), one call
    logits = model(ctx, acts.flatten())
    return F.binary_cross_entropy_with_logits(logits, win[:, k:].flatten(0, 1))


def chained_loss(model: Predictor, win: torch.Tensor, acts: torch.Tensor, k: int) -> torch.Tensor:
    """Eq. (2): after the first step the context holds the model's own (detached) predictions."""
    h = acts.shape[1]
    ctx = list(win[:, :k].unbind(1))
    losses = []
    for j in range(h):
        logits = model(torch.stack(ctx[-k:], 1), acts[:, j])
        losses.append(F.binary_cross_entropy_with_logits(logits, win[:, j + k]))
        ctx.append(torch.sigmoid(logits).detach())
    return torch.stack(losses).mean()


# ---- eval ----
@torch.no_grad()
def rollout(model: Predictor, frames: torch.Tensor, acts: torch.Tensor, k: int, horizon: int) -> torch.Tensor:
    """Eq. (3): roll out `horizon` steps from x_0 (padded context) with the true actions -> (B, H+1, C, F, F)."""
    ctx = [frames[:, 0]] * k
    out = [frames[:, 0]]
    for j in range(horizon):
        nxt = torch.sigmoid(model(torch.stack(ctx[-k:], 1), acts[:, j]))
        ctx.append(nxt)
        out.append(nxt)
    return torch.stack(out, 1)


def horizon_errors(pred: np.ndarray, true: np.ndarray, cfg: EnvConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-horizon pixel MSE and agent-cell error rate, index h = 0..H."""
    mse = ((pred - true) ** 2).mean(axis=(0, 2, 3, 4))
    wrong = (agent_cells(pred, cfg) != agent_cells(true, cfg)).any(-1).mean(0)
    return mse, wrong


def to_rgb(frame: np.ndarray) -> np.ndarray:
    """(3, F, F) in [0, 1] -> (F, F, 3) image: walls grey-blue, goal/objects yellow, agent red."""
    w, o, a = np.clip(frame, 0, 1)
    return np.clip(np.stack([0.35 * w + 0.9 * o + a, 0.35 * w + 0.8 * o, 0.5 * w], -1), 0, 1)


def save_figure(path: Path, title: str, pred: np.ndarray, true: np.ndarray, mse: np.ndarray,
                copy_mse: np.ndarray, shown: tuple[int, ...], train_horizon: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1.6 * len(shown) + 4.5, 3.6))
    gs = fig.add_gridspec(2, len(shown) + 3)
    for i, h in enumerate(shown):
        for r, (src, name) in enumerate(((true, "true"), (pred, "pred"))):
            ax = fig.add_subplot(gs[r, i])
            ax.imshow(to_rgb(src[0, h]), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if r == 0:
                ax.set_title(f"h={h}", fontsize=9)
            if i == 0:
                ax.set_ylabel(name)
    ax = fig.add_subplot(gs[:, len(shown):])
    hs = np.arange(1, len(mse))
    ax.plot(hs, mse[1:], label="model")
    ax.plot(hs, copy_mse[1:], "--", color="grey", label="copy x_0")
    ax.axvline(train_horizon, color="k", lw=0.6, ls=":", label="train horizon")
    ax.set_xlabel("horizon"), ax.set_ylabel("pixel MSE"), ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    cfg = check_args(args)
    common.set_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = common.get_device(args.device)
    t0 = time.perf_counter()
    tracker = common.Tracker(args.out_dir, args, track=args.track, run_name=args.exp_name)
    timer = common.Timer()

    fr, _, eff = collect(cfg, args.train_traj, args.traj_len, seed=args.seed)
    frames, acts = torch.from_numpy(fr).to(device), torch.from_numpy(eff).to(device)
    hmax = max(args.eval_horizons)
    tfr, _, teff = collect(cfg, args.eval_traj, hmax, seed=args.seed + 10_000)
    test_frames, test_acts = torch.from_numpy(tfr).to(device), torch.from_numpy(teff).to(device)

    k, h = args.context, args.train_horizon
    model = Predictor(k, args.channels).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * s / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc=args.exp_name, disable=None)
    for step in bar:
        with timer("train"):
            rows = torch.randint(0, args.train_traj, (args.batch_size,), generator=gen)
            starts = torch.randint(0, args.traj_len - h + 1, (args.batch_size,), generator=gen)
            win, wacts = windows(frames[rows], acts[rows], starts, k, h)
            chain = args.chained and step >= args.chain_warmup * args.steps
            loss = tf_loss(model, win, wacts, k)
            if chain:  # chained steps extend, not replace, the teacher-forced objective
                loss = 0.5 * (loss + chained_loss(model, win, wacts, k))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            tracker.log({"loss/train": loss.item(), "loss/chained": float(chain), **{
                f"perf/{n}_s": v for n, v in timer.pop().items()}}, step)
            bar.set_postfix(loss=f"{loss.item():.4f}")

    model.eval()
    pred = rollout(model, test_frames, test_acts, k, hmax).cpu().numpy()
    mse, wrong = horizon_errors(pred, tfr, cfg)
    copy_mse, copy_wrong = horizon_errors(np.repeat(tfr[:, :1], hmax + 1, 1), tfr, cfg)
    for j in range(1, hmax + 1):
        tracker.log({"eval/err": mse[j], "eval/agent_err": wrong[j], "eval/copy_err": copy_mse[j]}, j)
    summary = {f"err_h{H}": float(mse[H]) for H in args.eval_horizons}
    summary.update({f"agent_err_h{H}": float(wrong[H]) for H in args.eval_horizons})
    summary.update({"copy_err_h1": float(copy_mse[1]), f"copy_err_h{hmax}": float(copy_mse[hmax]),
                    "train_loss_last": loss.item(), "train_horizon": h,
                    "err_curve": [float(x) for x in mse[1:]]})
    if args.save_png:
        shown = tuple(sorted({1, h // 2 or 1, h, 2 * h, hmax} & set(range(1, hmax + 1))))
        name = "chained forward training" if args.chained else "teacher forcing"
        save_figure(Path(args.out_dir) / "strip.png", f"AR world model ({name})", pred, tfr, mse, copy_mse,
                    shown, h)
    summary["wall_s"] = time.perf_counter() - t0
    return tracker.finish(summary)


if __name__ == "__main__":
    out = main(tyro.cli(Args))
    print({k: round(v, 5) if isinstance(v, float) else v for k, v in out.items() if k != "err_curve"})
