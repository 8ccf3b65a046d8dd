"""Tiny batched gridworlds for the world-model scripts (a shared module, not a script).

A map is an M x M grid with a wall border, random interior walls and a few objects; one of the objects is
the goal. An agent moves with five discrete actions whose inverses are known:

    0 up, 1 down, 2 left, 3 right, 4 noop        INVERSE = [1, 0, 3, 2, 4]

A move into a wall leaves the agent in place; `step` then reports the *effective* action (noop), and the
effective action followed by its inverse always returns the same state (LIVE's reverse pass needs this).

Frames (`render`) are float32 arrays in [0, 1] of shape (N, 3, F, F):
    channel 0 walls (1 = wall), channel 1 objects (1.0 = goal, 0.5 = other object), channel 2 the agent.
- `view=None` (default): the whole map, allocentric, F = M * cell_px. The next frame is a function of the
  current frame and the action (the world is Markov in pixels).
- `view=V` (odd): an egocentric V x V window centred on the agent, F = V * cell_px; cells outside the map
  read as wall. With V < 2M - 1 part of the map is out of sight, so revisiting a place tests memory.

Everything is batched numpy: `collect(EnvConfig(), 1000, 32, seed=0)` draws 33,000 frames in well under a
second. Scripted policies of graded quality (`greedy_actions` with an epsilon) walk the shortest path to
the goal, with a probability `eps` of a random action instead.

The end of the file holds what the world-model scripts share beyond the world itself: the Args fields they
all have (`RunArgs` and `RolloutArgs`, which each script's `Args` extends, checked by `check_rollout_args`),
the start of a run (`start_run`, `optimiser`, `load_data`), the conv net they all use (`conv_stack`), training
windows (`windows`, `random_windows`), and the evaluation of a rollout against the true frames
(`horizon_errors`, `report_rollouts`, which logs, summarises and plots it with `save_figure`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import common

N_ACTIONS = 5
NOOP = 4
INVERSE = np.array([1, 0, 3, 2, 4], dtype=np.int64)
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1], [0, 0]], dtype=np.int64)  # (drow, dcol) per action
N_CHANNELS = 3
GOAL, OBJECT = 1.0, 0.5


@dataclass(frozen=True)
class EnvConfig:
    map_size: int = 10
    """M: cells per side, border walls included (>= 5)"""
    wall_density: float = 0.12
    """probability that an interior cell is a wall"""
    n_objects: int = 3
    """objects per map; the first is the goal"""
    view: int | None = None
    """None: whole map; odd V: egocentric V x V window"""
    cell_px: int = 1
    """pixels per cell side"""

    def __post_init__(self):
        if self.map_size < 5:
            raise ValueError(f"map_size must be >= 5, got {self.map_size}")
        if not 0.0 <= self.wall_density < 0.5:
            raise ValueError(f"wall_density must be in [0, 0.5), got {self.wall_density}")
        if self.n_objects < 1:
            raise ValueError(f"n_objects must be >= 1 (the goal), got {self.n_objects}")
        if self.view is not None and (self.view < 3 or self.view % 2 == 0):
            raise ValueError(f"view must be None or an odd number >= 3, got {self.view}")
        if self.cell_px < 1:
            raise ValueError(f"cell_px must be >= 1, got {self.cell_px}")

    @property
    def frame_size(self) -> int:
        return (self.view or self.map_size) * self.cell_px


def inverse(actions: np.ndarray) -> np.ndarray:
    """The action that undoes each (effective) action."""
    return INVERSE[np.asarray(actions)]


def _free_cells_reachable(walls: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Boolean (N, M, M): cells reachable from `start` (N, 2) without crossing walls (batched flood fill)."""
    n, m, _ = walls.shape
    reach = np.zeros_like(walls)
    reach[np.arange(n), start[:, 0], start[:, 1]] = True
    free = ~walls
    for _ in range(m * m):
        grown = reach.copy()
        grown[:, 1:] |= reach[:, :-1]
        grown[:, :-1] |= reach[:, 1:]
        grown[:, :, 1:] |= reach[:, :, :-1]
        grown[:, :, :-1] |= reach[:, :, 1:]
        grown &= free
        if (grown == reach).all():
            break
        reach = grown
    return reach


def distance_map(walls: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Shortest-path distance (N, M, M) from every free cell to `goal` (N, 2); unreachable = large."""
    n, m, _ = walls.shape
    big = m * m + 1
    dist = np.full(walls.shape, big, dtype=np.int64)
    dist[np.arange(n), goal[:, 0], goal[:, 1]] = 0
    free = ~walls
    for _ in range(m * m):
        nb = dist.copy()
        nb[:, 1:] = np.minimum(nb[:, 1:], dist[:, :-1] + 1)
        nb[:, :-1] = np.minimum(nb[:, :-1], dist[:, 1:] + 1)
        nb[:, :, 1:] = np.minimum(nb[:, :, 1:], dist[:, :, :-1] + 1)
        nb[:, :, :-1] = np.minimum(nb[:, :, :-1], dist[:, :, 1:] + 1)
        nb = np.where(free, nb, big)
        if (nb == dist).all():
            break
        dist = nb
    return dist


class GridWorld:
    """N independent maps stepped together. State: walls (N,M,M) bool, objects (N,M,M), pos (N,2), goal (N,2)."""

    def __init__(self, cfg: EnvConfig, n: int, seed: int):
        self.cfg, self.n = cfg, n
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> np.ndarray:
        cfg, n, m, rng = self.cfg, self.n, self.cfg.map_size, self.rng
        walls = rng.random((n, m, m)) < cfg.wall_density
        walls[:, 0, :] = walls[:, -1, :] = walls[:, :, 0] = walls[:, :, -1] = True
        # the agent starts on a random interior cell (cleared if it was a wall)
        pos = rng.integers(1, m - 1, size=(n, 2))
        walls[np.arange(n), pos[:, 0], pos[:, 1]] = False
        reach = _free_cells_reachable(walls, pos)
        small = reach.sum((1, 2)) < cfg.n_objects + 1  # boxed in: clear that map's interior walls
        walls[small, 1:-1, 1:-1] = False
        reach[small] = ~walls[small]
        walls |= ~reach  # fill unreachable pockets so every free cell is reachable
        objects = np.zeros((n, m, m), dtype=np.float32)
        goal = np.zeros((n, 2), dtype=np.int64)
        for i in range(n):
            cells = np.argwhere(reach[i])
            cells = cells[(cells != pos[i]).any(1)]  # never on the start cell
            k = min(cfg.n_objects, len(cells))
            pick = cells[rng.choice(len(cells), size=k, replace=False)]
            objects[i, pick[:, 0], pick[:, 1]] = OBJECT
            objects[i, pick[0, 0], pick[0, 1]] = GOAL
            goal[i] = pick[0]
        self.walls, self.objects, self.pos, self.goal = walls, objects, pos, goal
        self._dist = None
        return self.render()

    def state(self) -> tuple:
        return self.walls.copy(), self.objects.copy(), self.pos.copy(), self.goal.copy()

    def set_state(self, state: tuple) -> None:
        self.walls, self.objects, self.pos, self.goal = (s.copy() for s in state)
        self._dist = None

    def step(self, actions: np.ndarray) -> np.ndarray:
        """Apply actions (N,) in place; return the effective actions (noop where a wall blocked the move)."""
        actions = np.asarray(actions, dtype=np.int64)
        if actions.shape != (self.n,) or actions.min() < 0 or actions.max() >= N_ACTIONS:
            raise ValueError(f"actions must be ints in [0, {N_ACTIONS}) of shape ({self.n},)")
        target = self.pos + MOVES[actions]
        blocked = self.walls[np.arange(self.n), target[:, 0], target[:, 1]]
        self.pos = np.where(blocked[:, None], self.pos, target)
        return np.where(blocked, NOOP, actions)

    def at_goal(self) -> np.ndarray:
        return (self.pos == self.goal).all(1)

    def distance(self) -> np.ndarray:
        if self._dist is None:
            self._dist = distance_map(self.walls, self.goal)
        return self._dist

    def render(self) -> np.ndarray:
        return render(self.cfg, self.walls, self.objects, self.pos)


def render(cfg: EnvConfig, walls: np.ndarray, objects: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Frames (N, 3, F, F) float32 in [0, 1] (see the module docstring)."""
    n, m, _ = walls.shape
    img = np.zeros((n, N_CHANNELS, m, m), dtype=np.float32)
    img[:, 0] = walls
    img[:, 1] = objects
    img[np.arange(n), 2, pos[:, 0], pos[:, 1]] = 1.0
    if cfg.view is not None:
        v, h = cfg.view, cfg.view // 2
        pad = np.zeros((n, N_CHANNELS, m + 2 * h, m + 2 * h), dtype=np.float32)
        pad[:, 0] = 1.0  # outside the map reads as wall
        pad[:, :, h:h + m, h:h + m] = img
        rows = pos[:, 0, None] + np.arange(v)[None]  # (N, V) in padded coordinates
        cols = pos[:, 1, None] + np.arange(v)[None]
        img = pad[np.arange(n)[:, None, None, None], np.arange(N_CHANNELS)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
    if cfg.cell_px > 1:
        img = img.repeat(cfg.cell_px, axis=2).repeat(cfg.cell_px, axis=3)
    return np.ascontiguousarray(img)


# ---- policies ----
def random_actions(rng: np.random.Generator, n: int, t: int, repeat_p: float = 0.5) -> np.ndarray:
    """Sticky random moves (N, T): each step repeats the previous action with probability repeat_p."""
    acts = rng.integers(0, 4, size=(n, t))
    for j in range(1, t):
        keep = rng.random(n) < repeat_p
        acts[:, j] = np.where(keep, acts[:, j - 1], acts[:, j])
    return acts


def greedy_actions(dist: np.ndarray, pos: np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
    """Shortest-path move towards the goal (ties: first action), a uniform random move with probability eps.

    dist: (N, M, M) distance map; pos: (N, 2) agent cells. Works on positions decoded from imagined frames.
    """
    n, m, _ = dist.shape
    cand = pos[:, None, :] + MOVES[None, :4]  # (N, 4, 2)
    cand = np.clip(cand, 0, m - 1)
    d = dist[np.arange(n)[:, None], cand[..., 0], cand[..., 1]]  # (N, 4)
    best = d.argmin(1)
    rand = rng.integers(0, 4, size=n)
    return np.where(rng.random(n) < eps, rand, best)


def collect(cfg: EnvConfig, n: int, t: int, seed: int, repeat_p: float = 0.5, eps: float | None = None):
    """n trajectories of t steps. Returns frames (n, t+1, 3, F, F), actions (n, t), effective actions (n, t).

    eps=None: sticky random actions; else the greedy policy with that epsilon (the episode keeps going
    after the goal, so all trajectories have the same length).
    """
    if n < 1 or t < 1:
        raise ValueError(f"need n >= 1 and t >= 1, got n={n}, t={t}")
    env = GridWorld(cfg, n, seed)
    rng = np.random.default_rng(seed + 1)
    plan = random_actions(rng, n, t, repeat_p) if eps is None else None
    frames = [env.render()]
    acts, effs = [], []
    for j in range(t):
        a = plan[:, j] if plan is not None else greedy_actions(env.distance(), env.pos, eps, rng)
        effs.append(env.step(a))
        acts.append(a)
        frames.append(env.render())
    return np.stack(frames, 1), np.stack(acts, 1), np.stack(effs, 1)


def agent_cells(frames: np.ndarray, cfg: EnvConfig, strict: bool = False) -> np.ndarray:
    """Decode the agent's cell (.., 2) from (.., 3, F, F) frames (argmax of the agent channel, per cell).

    strict=True (what the error tables use): a frame that does not show exactly one agent, i.e. exactly one
    cell whose agent channel is >= 0.5, decodes to (-1, -1), which matches no true cell. An agent that was
    blurred away or drawn twice is then an error, not whichever cell happens to be brightest.
    """
    a = frames[..., 2, :, :]
    if cfg.cell_px > 1:
        s = a.shape
        a = a.reshape(*s[:-2], s[-2] // cfg.cell_px, cfg.cell_px, s[-1] // cfg.cell_px, cfg.cell_px).mean((-3, -1))
    flat_a = a.reshape(*a.shape[:-2], -1)
    flat = flat_a.argmax(-1)
    cells = np.stack([flat // a.shape[-1], flat % a.shape[-1]], -1)
    if strict:
        cells[(flat_a >= 0.5).sum(-1) != 1] = -1
    return cells


# ---- shared by the world-model scripts: common Args, run set-up, model body, windows, rollout evaluation ----
@dataclass
class RunArgs:
    """The fields every world-model script has; a script's `Args(RunArgs)` changes defaults and adds its own."""

    exp_name: str = "world_model"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for data, init and sampling"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = "runs/world_model"
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
    """training trajectories (sticky random policy by default)"""
    traj_len: int = 32
    """steps per training trajectory"""
    channels: int = 32
    """conv width"""
    steps: int = 1000
    """optimiser steps"""
    batch_size: int = 256
    """training transitions per step"""
    lr: float = 2e-3
    """Adam learning rate (cosine decay to 10%)"""
    log_every: int = 100
    """steps between metric lines"""
    save_png: bool = True
    """save the run's figure (see the script's header) into out_dir"""


@dataclass
class RolloutArgs(RunArgs):
    """RunArgs plus the fields of the scripts that roll a next-frame model out from held-out test frames."""

    context: int = 2
    """K: past frames the model sees"""
    eval_traj: int = 256
    """held-out test trajectories"""
    eval_horizons: tuple[int, ...] = (1, 8, 16, 32)
    """horizons reported as err_h{H}; the largest sets the rollout length"""


def check_rollout_args(args: RolloutArgs) -> EnvConfig:
    """The checks every rollout script makes, each error naming its flag; returns the gridworld's config."""
    if args.context < 1:
        raise SystemExit(f"--context must be >= 1, got {args.context}")
    if not args.eval_horizons or min(args.eval_horizons) < 1:
        raise SystemExit(f"--eval-horizons must be positive integers, got {args.eval_horizons}")
    if args.steps < 1 or args.batch_size < 1 or args.train_traj < 1 or args.eval_traj < 1:
        raise SystemExit("--steps, --batch-size, --train-traj and --eval-traj must be >= 1")
    return EnvConfig(map_size=args.map_size, wall_density=args.wall_density)


def check_run_args(args: RunArgs) -> None:
    """The RunArgs checks (start_run makes them): each size at least 1 and the learning rate positive, naming the
    flag, instead of a failure deep inside torch (a zero-width conv, a modulo by a zero log interval)."""
    for name in ("threads", "channels", "steps", "batch_size", "train_traj", "traj_len", "log_every"):
        if hasattr(args, name) and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if hasattr(args, "lr") and not args.lr > 0:
        raise SystemExit(f"--lr must be positive, got {args.lr}")


def start_run(args: RunArgs):
    """Check the RunArgs (check_run_args), seed everything, set the CPU threads, pick the device, open the tracker ->
    (device, tracker, timer)."""
    check_run_args(args)
    common.set_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = common.get_device(args.device)
    tracker = common.Tracker(args.out_dir, args, track=args.track, run_name=args.exp_name)
    return device, tracker, common.Timer()


def optimiser(model: nn.Module, lr: float, steps: int):
    """Adam, its learning rate decayed along a cosine from lr to lr / 10 over `steps` -> (opt, scheduler)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return opt, sched


def gated_planes(frame: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Multiplicative action input: the frame (B, C, F, F) times each action's indicator -> (B, C * N_ACTIONS, F, F).

    With the action as constant one-hot planes only, moving the agent needs the net to learn a product of the
    action and the agent channel; here channel (a, c) holds channel c of the frame when the action is a and
    zeros otherwise, so one 3x3 convolution can shift the agent in the action's direction.
    """
    onehot = torch.nn.functional.one_hot(action, N_ACTIONS).to(frame.dtype)  # (B, A)
    return (onehot[:, :, None, None, None] * frame[:, None]).flatten(1, 2)


def conv_stack(cin: int, ch: int, cout: int) -> nn.Sequential:
    """Four 3x3 convolutions (SiLU between them) that keep the frame size: the body of every model here."""
    return nn.Sequential(nn.Conv2d(cin, ch, 3, padding=1), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(),
                         nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(), nn.Conv2d(ch, cout, 3, padding=1))


def windows(frames: torch.Tensor, acts: torch.Tensor, starts: torch.Tensor, k: int, h: int):
    """Frames x_{s-K+1..s+H} (B, K+H, C, F, F) (indices below 0 repeat x_0) and actions a_{s..s+H-1} (B, H)."""
    idx = (starts[:, None] + torch.arange(-k + 1, h + 1)[None]).clamp(min=0)
    b = torch.arange(len(starts))[:, None]
    return frames[b, idx], acts[b, starts[:, None] + torch.arange(h)[None]]


def random_windows(frames: torch.Tensor, acts: torch.Tensor, n: int, k: int, h: int, gen: torch.Generator):
    """`windows` at n random (trajectory, start) pairs drawn with `gen`; frames (N, T+1, ...), acts (N, T)."""
    rows = torch.randint(0, frames.shape[0], (n,), generator=gen)
    starts = torch.randint(0, acts.shape[1] - h + 1, (n,), generator=gen)
    return windows(frames[rows], acts[rows], starts, k, h)


def load_data(cfg: EnvConfig, args: RolloutArgs, device):
    """Training trajectories (sticky random policy, seed args.seed) and args.eval_traj test trajectories of
    max(args.eval_horizons) steps (seed args.seed + 10000).

    Returns train frames (N, T+1, C, F, F) in [0, 1] and effective actions (N, T) on `device`, and the test
    frames as numpy (what the errors are measured against) and on `device`, with the test actions.
    """
    fr, _, eff = collect(cfg, args.train_traj, args.traj_len, seed=args.seed)
    tfr, _, teff = collect(cfg, args.eval_traj, max(args.eval_horizons), seed=args.seed + 10_000)
    to = lambda x: torch.from_numpy(x).to(device)
    return to(fr), to(eff), tfr, to(tfr), to(teff)


def horizon_errors(pred: np.ndarray, true: np.ndarray, cfg: EnvConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-horizon pixel MSE and agent-cell error rate of (N, H+1, C, F, F) rollouts in [0, 1], index h = 0..H.

    The agent is right when the prediction shows exactly one agent, in the true cell (`agent_cells`, strict).
    """
    mse = ((pred - true) ** 2).mean(axis=(0, 2, 3, 4))
    wrong = (agent_cells(pred, cfg, strict=True) != agent_cells(true, cfg)).any(-1).mean(0)
    return mse, wrong


def to_rgb(frame: np.ndarray) -> np.ndarray:
    """(3, F, F) in [0, 1] -> (F, F, 3) image: walls grey-blue, goal/objects yellow, agent red."""
    w, o, a = np.clip(frame, 0, 1)
    return np.clip(np.stack([0.35 * w + 0.9 * o + a, 0.35 * w + 0.8 * o, 0.5 * w], -1), 0, 1)


def save_figure(path: Path, title: str, pred: np.ndarray, true: np.ndarray, mse: np.ndarray,
                copy_mse: np.ndarray, shown: tuple[int, ...], train_horizon: int) -> None:
    """True and predicted frames of the first rollout at the `shown` horizons, and the error curves."""
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


def report_rollouts(tracker, pred: np.ndarray, true: np.ndarray, cfg: EnvConfig, eval_horizons: tuple[int, ...],
                    train_horizon: int, png: Path | None = None, title: str = "") -> dict:
    """Evaluate rollouts `pred` against `true` (N, H+1, C, F, F) in [0, 1], H = max(eval_horizons).

    Logs eval/err, eval/agent_err and eval/copy_err (copying x_0 forward) for h = 1..H, saves the strip
    figure to `png` (None: no figure) and returns the summary keys err_h{H}, agent_err_h{H}, copy_err_h1,
    copy_err_h{H}, train_horizon and err_curve (pixel MSE at h = 1..H).
    """
    hmax = max(eval_horizons)
    mse, wrong = horizon_errors(pred, true, cfg)
    copy_mse, _ = horizon_errors(np.repeat(true[:, :1], hmax + 1, 1), true, cfg)
    for j in range(1, hmax + 1):
        tracker.log({"eval/err": mse[j], "eval/agent_err": wrong[j], "eval/copy_err": copy_mse[j]}, j)
    summary = {f"err_h{h}": float(mse[h]) for h in eval_horizons}
    summary.update({f"agent_err_h{h}": float(wrong[h]) for h in eval_horizons})
    summary.update({"copy_err_h1": float(copy_mse[1]), f"copy_err_h{hmax}": float(copy_mse[hmax]),
                    "train_horizon": train_horizon, "err_curve": [float(x) for x in mse[1:]]})
    if png is not None:
        h = train_horizon
        shown = tuple(sorted({1, h // 2 or 1, h, 2 * h, hmax} & set(range(1, hmax + 1))))
        save_figure(png, title, pred, true, mse, copy_mse, shown, h)
    return summary
