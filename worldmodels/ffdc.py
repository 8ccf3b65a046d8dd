"""FFDC: verifier-gated adaptive action chunks for a world action model, on a gridworld with perturbations.

Parent: none. Borrows: the action-gated forward model of policy_eval.py (`gated_planes` in _envs.py) and the
detached chained feedback (`--feedback snap`) of ar_world_model.py's `chained_loss`.

Paper. "When to Trust Imagination: Adaptive Action Execution for World Action Models" (arXiv:2605.06222). A
world action model (WAM) predicts a chunk of future actions together with the frames they should produce. A
fixed-chunk executor runs every predicted action open loop before it asks the model again: short chunks react
to surprises but call the model often, long chunks are cheap but blind. FFDC (Future Forward Dynamics Causal
Attention) is a lightweight verifier that compares the predicted frames with the real observations step by
step and decides whether the rest of the chunk can still be trusted: execution continues while prediction and
reality agree and replans as soon as they deviate, so chunks are long where the world is predictable and short
where it is not. Mixture-of-Horizon Training trains the WAM on several chunk lengths so that long imagined
chunks stay usable. Paper (RoboTwin): WAM forward passes -69.10%, execution time -34.02%, success +2.54%
against the short-chunk baseline; real world: success +35%.

Method here. The WAM has a policy head pi(x) -> action logits and an action-gated forward model
f(x, a) -> next-frame logits; one model call predicts a chunk of H actions and frames by rolling the two out
in imagination from the current observation (`WorldActionModel.chunk`). It is trained by behaviour cloning
of the shortest-path expert on eps-greedy episodes plus next-frame prediction, on chained windows of several
lengths per batch (Mixture-of-Horizon). Two learned verifiers, trained on the WAM's own long chunks executed in
perturbed worlds: the frame verifier v(xhat, x) -> P(the current predicted frame no longer matches reality), and
the rollout verifier, the paper's question, v_R(x, the rest of the chunk) -> P(the remaining predicted rollout can
no longer be trusted); the fixed-threshold ablation flags a step when the pixel MSE between predicted and observed
frame exceeds one fully wrong pixel. At test time the world perturbs each step with probability `rate`: the agent
slips (a random other move replaces the commanded one) or the goal moves to a free neighbouring cell
(`PerturbedWorld`). Work is counted: model calls, imagined steps (a policy and a dynamics evaluation each),
verifier evaluations and the multiply-accumulates of all of them (`forward_macs`); the same-cost baseline
(`short-of-long`) predicts 8 steps per call, as a gated call does, and executes 2.

Equations (function that implements each):
  (1) chunk prediction   a_j = argmax pi(xhat_{j-1}), xhat_j = snap(sigmoid f(xhat_{j-1}, a_j)), xhat_0 = x_t,
                         j = 1..H: one model call                                       `WorldActionModel.chunk`
  (2) Mixture-of-Horizon L = 1/|S| sum_{H in S} 1/H sum_{j<H} [CE(pi(xhat_j), a*_{t+j})
                         + BCE(f(xhat_j, a_{t+j}), x_{t+j+1})], xhat_0 = x_t, xhat_{j+1} = sg[snap(sigmoid f)],
                         each H in S on its own share of the batch (a* the expert's action)        `moh_loss`
  (3) deviation label    d_j = 1[agent or goal cell decoded from xhat_j != the one in x_{t+j}]    `deviated`
  (3b) rest label        r_j = 1[executing a_{j+1..H} from the real state at t+j (true dynamics, no further
                         perturbation) shows a frame with d = 1 against xhat_{j+1..H}]       `rest_deviated`
  (4) frame verifier     v(xhat_j, x_{t+j}) = sigmoid(max over cells of conv([xhat, x, xhat - x])),
                         trained by BCE on d_j; replan when v > `verifier_threshold`           `Verifier`
      rollout verifier   v_R = sigmoid(max over the remaining transitions x_{t+j} -> xhat_{j+1} -> ... -> xhat_H
                         and over cells of conv([before, after, after - before, before gated by the action])),
                         trained by BCE on r_j; replan when v_R > `verifier_threshold`  `RolloutVerifier`
      fixed threshold    replan when mean (xhat_j - x_{t+j})^2 > tau, tau = 1 / (3 F^2)     `fixed_verifier`
  (5) gated execution    call the WAM when the chunk is used up or the verifier flagged the last step;
                         model calls, imagined steps and verifier evaluations per episode; success: the goal
                         within distance + slack steps                                              `execute`

Deviations:
- RoboTwin's video-diffusion WAM, language instruction and causal-attention verifier are replaced by a small conv
  policy head and forward model and two conv verifiers: one on (predicted frame, observed frame), one on the
  observed frame and the rest of the predicted chunk, judged transition by transition (no language, no attention).
- One model call rolls pi and f out H steps, so its cost grows with H (the paper's WAM predicts the chunk in one
  forward pass). Model calls are the paper's figure; the counted work (imagined steps, verifier evaluations,
  multiply-accumulates) says what a call costs here, and the same-cost baseline compares at equal cost per call.
- The verifiers' labels are rules: the decoded agent or goal cell of the prediction differs from reality (frame),
  and the same for the rest of the chunk executed from the real state in the true dynamics (rollout; the simulator
  supplies the counterfactual); the paper trains on executable vs failed and action-perturbed segments. Both labels
  also fire when the WAM itself drifted without any perturbation, which is when its remaining actions were computed
  from a wrong state.
- Mixture-of-Horizon Training here is chained training on windows of 1, 2, 4 and 8 steps in every batch, each
  length on an equal share of the batch's transitions, after a warm-up on single steps (`--chain-warmup`).
- Imagined frames are snapped to the pixel values {0, .5, 1} before they are fed forward (`--feedback snap`,
  the default; `soft` feeds probabilities): the paper's WAM samples sharp frames, and a snapped frame is one
  the policy head has seen in training.
- Maps have no interior walls by default (`--wall-density 0`): the policy head then only needs the direction
  to the goal; with walls it would have to plan around them, which a small conv net does not learn in a CPU
  minute. The border walls and two non-goal objects remain. The policy head reads the frame through a spatial
  softmax (the expected position of each of 16 feature maps); mean-pooled conv features did not learn at all in
  400 steps (action loss stuck at ln 5).

Commands:
  python worldmodels/ffdc.py                                  # ~3 min of one shared CPU core
  python worldmodels/ffdc.py --horizons 1                     # WAM trained on single steps only (no MoH)
  python worldmodels/ffdc.py --perturb slip --rates 0 0.1 0.3
  python worldmodels/ffdc.py --device cuda --steps 3000 --channels 64 --episodes 2000   # one GPU, larger
Expected result (means of 3 seeds, benchmarks/results/ffdc.md from `python benchmarks/ffdc_table.py`): model
calls per episode at perturbation rates 0 / 0.1 / 0.2 / 0.3: 2-step chunks 2.90 / 3.15 / 3.30 / 3.42, 8-step chunks
gated by the frame verifier 1.21 / 1.73 / 2.25 / 2.81, by the rollout verifier 1.42 / 1.95 / 2.47 / 2.97, open-loop
8-step chunks 1.14 / 1.23 / 1.26 / 1.27; success 0.99 / 0.91 / 0.75 / 0.61 with 2-step chunks, 0.97 / 0.92 / 0.78 /
0.65 gated by the frame verifier, 0.98 / 0.92 / 0.78 / 0.65 by the rollout verifier, 0.93 / 0.67 / 0.51 / 0.38
open loop. Gating keeps the success of short chunks with 45% fewer calls at rate 0.1 (frame verifier; 38% with the
rollout verifier, which also replans where the WAM's own later frames drift: 0.32 early replans per episode
without perturbation against 0.10). A call rolls the chunk out step by step, so gating imagines more steps than
2-step chunks (13.8 vs 6.3 per episode at rate 0.1) and, counting every network's multiply-accumulates, costs
2.5x as much (frame verifier) or 5.3x (rollout verifier); against the same-cost baseline, 2 of 8 predicted steps
per call, it imagines 45% fewer steps (13.8 vs 25.2): the saving is the paper's, in forward passes of a model that
predicts a chunk in one pass. Mixture-of-Horizon Training against single steps (`--horizons 1`), the claims plan's
paired fresh run of 46 seeds (300-345): the 8th imagined frame of a chunk is off in 0.159 of chunks against 0.197,
-0.038 [-0.067, -0.009] seed by seed (p 0.012, 0.028 after the claims table's multiplicity step).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from worldmodels._envs import (N_ACTIONS, N_CHANNELS, NOOP, EnvConfig, GridWorld, RunArgs, agent_cells, conv_stack,
                               gated_planes, greedy_actions, optimiser, start_run)

MODES = ("short", "long", "gated", "gated-fixed", "gated-rollout", "short-of-long")


# ---- args ----
@dataclass
class Args(RunArgs):  # the fields all world-model scripts share: RunArgs in worldmodels/_envs.py
    exp_name: str = "ffdc"
    out_dir: str = "runs/ffdc"
    wall_density: float = 0.0
    train_traj: int = 600
    traj_len: int = 16
    channels: int = 16
    steps: int = 600
    batch_size: int = 256
    """training transitions per step, shared out evenly among the horizons"""
    lr: float = 1e-2
    chain_warmup: float = 0.4
    """fraction of steps trained on single steps (horizon 1) before the mixture of horizons starts"""
    feedback: Literal["soft", "snap"] = "snap"
    """what an imagined step feeds forward: the frame snapped to the pixel values {0, .5, 1}, or probabilities"""
    train_eps: float = 0.3
    """the training episodes take a random move with this probability (labels: the expert's move)"""
    horizons: tuple[int, ...] = (1, 2, 4, 8)
    """Mixture-of-Horizon: the window lengths of every batch (eq. 2); `--horizons 1`: single steps only"""
    short_chunk: int = 2
    """actions executed per model call by the short-chunk arm"""
    long_chunk: int = 8
    """actions per model call of the long-chunk arm, and the chunk the gated arms predict"""
    verifier_steps: int = 300
    """optimiser steps of the verifier"""
    verifier_episodes: int = 256
    """perturbed episodes (long chunks, no verifier) whose steps train the verifier"""
    verifier_rate: float = 0.2
    """perturbation rate of those episodes"""
    verifier_threshold: float = 0.5
    """replan when the learned verifier's P(deviation) exceeds this"""
    fixed_threshold: float | None = None
    """pixel-MSE threshold of the fixed verifier; None: one fully wrong pixel, 1 / (3 F^2)"""
    perturb: Literal["slip", "goal", "both"] = "both"
    """what a perturbation does: the agent slips, the goal moves, or either (half the time each)"""
    rates: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3)
    """per-step perturbation probabilities evaluated"""
    modes: tuple[str, ...] = MODES
    """execution arms: short / long fixed chunks; long chunks gated by the learned frame verifier, by a fixed
    threshold, or by the learned rollout verifier; short-of-long: each call predicts long_chunk steps (the gated
    arms' cost per call) and executes short_chunk of them"""
    episodes: int = 200
    """test episodes per (mode, rate), the same maps and perturbation draws for every mode"""
    slack: int = 2
    """an episode succeeds when the agent reaches the goal within (initial distance + slack) steps"""


def check_args(args: Args) -> EnvConfig:
    if not args.horizons or min(args.horizons) < 1 or max(args.horizons) > args.traj_len:
        raise SystemExit(f"--horizons must be in [1, traj_len={args.traj_len}], got {args.horizons}")
    if args.batch_size < len(args.horizons):
        raise SystemExit(f"--batch-size must be >= the number of horizons ({len(args.horizons)})")
    if not 1 <= args.short_chunk <= args.long_chunk:
        raise SystemExit(f"need 1 <= --short-chunk <= --long-chunk, got {args.short_chunk}, {args.long_chunk}")
    if not args.rates or not all(0.0 <= r <= 1.0 for r in args.rates) or not 0.0 <= args.verifier_rate <= 1.0:
        raise SystemExit(f"--rates and --verifier-rate must be probabilities, got {args.rates}, {args.verifier_rate}")
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        raise SystemExit(f"--modes must be among {MODES}, got {args.modes}")
    counts = (args.steps, args.train_traj, args.episodes, args.verifier_steps, args.verifier_episodes)
    if min(counts) < 1 or args.slack < 0:
        raise SystemExit("--steps, --train-traj, --episodes, --verifier-steps and --verifier-episodes must be >= 1, "
                         "--slack >= 0")
    if not 0.0 <= args.train_eps <= 1.0 or not 0.0 < args.verifier_threshold < 1.0:
        raise SystemExit("--train-eps must be in [0, 1] and --verifier-threshold in (0, 1)")
    return EnvConfig(map_size=args.map_size, wall_density=args.wall_density)


# ---- the world: expert, perturbations ----
def expert_actions(env: GridWorld) -> np.ndarray:
    """The shortest-path move (ties: first action), noop on the goal."""
    best = greedy_actions(env.distance(), env.pos, 0.0, np.random.default_rng(0))
    return np.where(env.at_goal(), NOOP, best)


class PerturbedWorld(GridWorld):
    """GridWorld whose step t perturbs episode i when u[t, i] < rate: the agent slips (one of the three other
    moves replaces the commanded one) or the goal moves to a free neighbouring cell. The draws are fixed by the
    seed, so every execution mode meets the same perturbations at the same steps."""

    def __init__(self, cfg: EnvConfig, n: int, seed: int, rate: float, kind: str, horizon: int = 256):
        super().__init__(cfg, n, seed)
        rng = np.random.default_rng(seed + 1)  # draws for steps 0..horizon-1 (later steps reuse the last)
        self.u, self.coin = rng.random((horizon, n)), rng.random((horizon, n))
        self.turn, self.nb = rng.integers(1, 4, (horizon, n)), rng.integers(0, 4, (horizon, n))
        self.rate, self.kind, self.t = rate, kind, 0

    def step(self, actions: np.ndarray) -> np.ndarray:
        t, n = min(self.t, len(self.u) - 1), self.n
        hit = self.u[t] < self.rate
        slip = hit & (self.coin[t] < 0.5) if self.kind == "both" else hit & (self.kind == "slip")
        actions = np.where(slip, (np.asarray(actions) % 4 + self.turn[t]) % 4, actions)
        eff = super().step(actions)
        for i in np.flatnonzero(hit & ~slip):  # the goal moves to a neighbouring cell that is free
            tgt = self.goal[i] + np.array([[-1, 0], [1, 0], [0, -1], [0, 1]])[(self.nb[t, i] + np.arange(4)) % 4]
            ok = [c for c in tgt if not self.walls[i, c[0], c[1]] and self.objects[i, c[0], c[1]] == 0
                  and not (c == self.pos[i]).all()]
            if ok:
                self.objects[i, self.goal[i][0], self.goal[i][1]] = 0.0
                self.goal[i] = ok[0]
                self.objects[i, ok[0][0], ok[0][1]] = 1.0
                self._dist = None
        self.t += 1
        return eff


def collect_expert(cfg: EnvConfig, n: int, t: int, eps: float, seed: int):
    """Eps-greedy episodes: frames (n, t+1, C, F, F), executed effective actions (n, t), expert labels (n, t+1)."""
    env = GridWorld(cfg, n, seed)
    rng = np.random.default_rng(seed + 1)
    frames, effs, labels = [env.render()], [], [expert_actions(env)]
    for _ in range(t):
        a = np.where(rng.random(n) < eps, rng.integers(0, 4, n), labels[-1])
        effs.append(env.step(np.where(a == NOOP, rng.integers(0, 4, n), a)))  # keep moving after the goal
        frames.append(env.render())
        labels.append(expert_actions(env))
    return np.stack(frames, 1), np.stack(effs, 1), np.stack(labels, 1)


# ---- model ----
class WorldActionModel(nn.Module):
    """policy(x) -> action logits (B, A); dynamics(x, a) -> next-frame logits (B, C, F, F); chunk: eq. (1)."""

    def __init__(self, channels: int, feedback: str = "snap", keypoints: int = 16):
        super().__init__()
        self.feedback = feedback
        self.f = conv_stack(N_CHANNELS + N_ACTIONS + N_ACTIONS * N_CHANNELS, channels, N_CHANNELS)
        self.pi_body = conv_stack(N_CHANNELS, channels, keypoints)
        self.pi_head = nn.Sequential(nn.Linear(2 * keypoints, 2 * channels), nn.SiLU(),
                                     nn.Linear(2 * channels, N_ACTIONS))

    def dynamics(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        planes = F.one_hot(a, N_ACTIONS).to(x.dtype)[:, :, None, None].expand(b, N_ACTIONS, h, w)
        return self.f(torch.cat([x, planes, gated_planes(x, a)], 1))

    def policy(self, x: torch.Tensor) -> torch.Tensor:
        """Spatial softmax: each of K feature maps becomes the expected (row, col) under its softmax over cells,
        so the head sees where things are (the agent, the goal) as 2K coordinates."""
        b, _, h, w = x.shape
        att = torch.softmax(self.pi_body(x).flatten(2), -1)  # (B, K, F*F)
        r = torch.linspace(-1, 1, h, device=x.device, dtype=x.dtype).repeat_interleave(w)
        c = torch.linspace(-1, 1, w, device=x.device, dtype=x.dtype).repeat(h)
        return self.pi_head(torch.cat([att @ r, att @ c], -1))

    @torch.no_grad()
    def chunk(self, x: torch.Tensor, h: int) -> tuple[np.ndarray, torch.Tensor]:
        """Eq. (1): H actions (B, H) and the frames they should produce (B, H, C, F, F), from observation x."""
        acts, frames = [], []
        for _ in range(h):
            a = self.policy(x).argmax(-1)
            x = feed(self.dynamics(x, a), self.feedback)
            acts.append(a)
            frames.append(x)
        return torch.stack(acts, 1).cpu().numpy(), torch.stack(frames, 1)


class Verifier(nn.Module):
    """Eq. (4): (predicted frame, observed frame) (B, C, F, F) each -> logit of P(deviated) (B,)."""

    def __init__(self, channels: int):
        super().__init__()
        self.net = conv_stack(3 * N_CHANNELS, channels, 1)

    def forward(self, pred: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([pred, obs, pred - obs], 1)).amax(dim=(1, 2, 3))


class RolloutVerifier(nn.Module):
    """Eq. (4b): (observed frame, the rest of the predicted rollout) -> logit of P(the rest can no longer be trusted)
    (B,). The rest is executed from the real state, so it is trusted when every remaining predicted transition,
    starting from the observation, is one its action can make: x -> xhat_{j+1} under a_{j+1}, then xhat_{j+1} ->
    xhat_{j+2} under a_{j+2}, ... One small conv net judges each transition from (before, after, after - before,
    the before frame gated by the action as in the WAM's dynamics); the logit is the largest over cells and over
    the valid transitions. A slip or a moved goal breaks the first transition, a drifting prediction a later one."""

    def __init__(self, channels: int):
        super().__init__()
        self.net = conv_stack(3 * N_CHANNELS + N_ACTIONS * N_CHANNELS, channels, 1)

    def forward(self, obs, rest_x, rest_a, valid) -> torch.Tensor:
        """obs (B, C, F, F); rest_x (B, S, C, F, F) predicted frames; rest_a (B, S) actions; valid (B, S) bool."""
        b, s = rest_a.shape
        before = torch.cat([obs[:, None], rest_x[:, :-1]], 1).flatten(0, 1)
        after, a = rest_x.flatten(0, 1), rest_a.flatten()
        z = self.net(torch.cat([before, after, after - before, gated_planes(before, a)], 1)).amax(dim=(1, 2, 3))
        return z.view(b, s).masked_fill(~valid, -1e4).amax(1)


def forward_macs(net: nn.Module, run) -> int:
    """Multiply-accumulates of the Conv2d and Linear layers of `net` while run() runs, by hooks (run() feeds one
    example: a batch of 1, which a net may spread over several rows, as RolloutVerifier over transitions)."""
    total = [0]

    def count(m, inp, out):
        total[0] += m.weight[0].numel() * out.numel()  # (in_features, or in_channels * kh * kw) per output

    hooks = [m.register_forward_hook(count) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            run()
    finally:
        for hk in hooks:
            hk.remove()
    return total[0]


# ---- losses and labels ----
def snap(p: torch.Tensor) -> torch.Tensor:
    """A predicted frame (probabilities) snapped to the pixel values a real frame has: 0, 0.5 or 1."""
    return torch.round(p * 2) / 2


def feed(logits: torch.Tensor, feedback: str) -> torch.Tensor:
    """The imagined frame a chunk continues from: sigmoid(logits), snapped if feedback == 'snap'."""
    p = torch.sigmoid(logits)
    return snap(p) if feedback == "snap" else p


def sample_windows(horizons: tuple[int, ...], batch: int, n_traj: int, t_len: int, gen: torch.Generator):
    """Mixture-of-Horizon windows: each H in `horizons` gets an equal share of `batch` transitions, i.e.
    batch / |S| / H windows of length H. Returns trajectory rows, start steps and lengths, each (W,)."""
    n_h = torch.tensor([max(1, batch // len(horizons) // hh) for hh in horizons])
    h = torch.tensor(horizons).repeat_interleave(n_h)
    rows = torch.randint(0, n_traj, (len(h),), generator=gen)
    t0 = (torch.rand(len(h), generator=gen) * (t_len - h + 1)).long()  # uniform in [0, T - H]
    return rows, t0, h


def moh_loss(model: WorldActionModel, frames: torch.Tensor, effs: torch.Tensor, labels: torch.Tensor,
             rows: torch.Tensor, t0: torch.Tensor, h: torch.Tensor, feedback: str = "snap"):
    """Eq. (2) on windows (rows, t0, h) of the trajectories frames (N, T+1, C, F, F), effs (N, T), labels (N, T+1).

    All windows advance together, one batched call per chain position (the windows still running at position
    j); window i's terms weigh 1 / (H_i n_{H_i} |S|), n_H the windows of length H, so that each horizon's mean
    loss counts equally. Returns the loss and its action / frame parts.
    """
    lengths, counts = torch.unique(h, return_counts=True)
    w = 1.0 / (h.float() * counts[torch.searchsorted(lengths, h)].float() * len(lengths))
    x, la, lx = frames[rows, t0], 0.0, 0.0
    for j in range(int(h.max())):
        run = h > j  # windows still running; x holds their imagined frames
        r, t = rows[run], t0[run] + j
        la = la + (w[run] * F.cross_entropy(model.policy(x), labels[r, t], reduction="none")).sum()
        logits = model.dynamics(x, effs[r, t])
        bce = F.binary_cross_entropy_with_logits(logits, frames[r, t + 1], reduction="none").mean((1, 2, 3))
        lx = lx + (w[run] * bce).sum()
        x = feed(logits, feedback).detach()[h[run] > j + 1]
    return la + lx, {"loss/action": la.item(), "loss/frame": lx.item()}


def goal_cells(frames: np.ndarray) -> np.ndarray:
    """The goal's cell (.., 2): the brightest cell of the object channel (the goal is 1.0, other objects 0.5)."""
    o = frames[..., 1, :, :]
    flat = o.reshape(*o.shape[:-2], -1).argmax(-1)
    return np.stack([flat // o.shape[-1], flat % o.shape[-1]], -1)


def deviated(pred: np.ndarray, obs: np.ndarray, cfg: EnvConfig) -> np.ndarray:
    """Eq. (3): the prediction shows the agent (strictly: exactly one, see agent_cells) or the goal elsewhere."""
    agent = (agent_cells(pred, cfg, strict=True) != agent_cells(obs, cfg)).any(-1)
    return agent | (goal_cells(pred) != goal_cells(obs)).any(-1)


def rest_of_chunk(plan_x: torch.Tensor, plan_a: np.ndarray, jj: np.ndarray):
    """The chunk after position jj (n,): predicted frames (n, S, C, F, F), actions (n, S) and validity (n, S) of the
    S = H - 1 slots jj + 1, jj + 2, ... (invalid past the chunk's end: frame and action of its last step)."""
    n, h = plan_a.shape
    idx = torch.from_numpy(jj)[:, None] + 1 + torch.arange(h - 1)[None]
    valid, idx = idx < h, idx.clamp(max=h - 1)
    rows = torch.arange(n)[:, None]
    return plan_x[rows, idx], torch.from_numpy(plan_a)[rows, idx], valid


def rest_deviated(sim: GridWorld, state: tuple, plan_x: torch.Tensor, plan_a: np.ndarray, jj: np.ndarray,
                  cfg: EnvConfig) -> np.ndarray:
    """Eq. (3b), the rollout verifier's label: 1 where executing the chunk's remaining actions a_{jj+1..H-1} from the
    real state `state` (the true dynamics, no further perturbation) would show a frame that deviates (eq. 3) from
    the predicted one at some step. `sim` is a GridWorld of the same n maps, overwritten."""
    sim.set_state(state)
    n, h = plan_a.shape
    rows, out = np.arange(n), np.zeros(n, bool)
    for s in range(1, h):
        k = jj + s
        live = k < h
        if not live.any():
            break
        k = np.minimum(k, h - 1)
        sim.step(np.where(live, plan_a[rows, k], NOOP))
        out |= deviated(plan_x[torch.from_numpy(rows), torch.from_numpy(k)].numpy(), sim.render(), cfg) & live
    return out


def fixed_verifier(tau: float):
    """Eq. (4), the ablation: flag a step when the pixel MSE between prediction and observation exceeds tau."""
    return lambda pred, obs: ((pred - obs) ** 2).mean((1, 2, 3)).numpy() > tau


def learned_verifier(v: Verifier, threshold: float):
    """Eq. (4): flag a step when the frame verifier's P(deviated) exceeds the threshold."""
    return lambda pred, obs: (torch.sigmoid(v(pred, obs)) > threshold).numpy()


def rollout_verifier(v: RolloutVerifier, threshold: float):
    """Eq. (4b): flag a step when P(the rest of the chunk can no longer be trusted) exceeds the threshold; execute
    calls it with the rest of the chunk (the `rollout` attribute says so)."""
    def verify(pred, obs, plan_x, plan_a, jj):
        return (torch.sigmoid(v(obs, *rest_of_chunk(plan_x, plan_a, jj))) > threshold).numpy()

    verify.rollout = True
    return verify


# ---- execution ----
def budgets(env: GridWorld, slack: int) -> np.ndarray:
    """Steps each episode may take: the initial shortest-path distance to the goal plus `slack`."""
    d = env.distance()[np.arange(env.n), env.pos[:, 0], env.pos[:, 1]]
    return d + slack


@torch.no_grad()
def execute(wam, env: GridWorld, chunk: int, budget: np.ndarray, verify=None, record: list | None = None,
            predict: int | None = None) -> dict:
    """Eq. (5): run env.n episodes, episode i for at most budget[i] steps, with chunks of `chunk` actions; with
    `verify` a flagged step throws the rest of its chunk away: a frame verifier is called as verify(pred, obs), a
    rollout verifier (verify.rollout) as verify(pred, obs, plan_x, plan_a, jj), each -> flags (n,). A call
    `wam.chunk(x, h)` gives actions (B, h) and frames (B, h, C, F, F), h = `predict` (default: chunk; more than chunk
    imagines steps that are never executed). `record`, if a list, receives per executed step (pred, obs,
    deviated, rest_x, rest_a, valid, rest_deviated) of the active episodes (the verifiers' data, eqs. 3 and 3b).

    Per-episode arrays: success, steps, calls (model calls), evals (imagined steps: one policy and one dynamics
    evaluation each), verifier_evals (steps the verifier was asked: a step with actions left to throw away), early
    (replans that threw actions away), first_flag (the step whose observation first made the verifier throw actions
    away, -1: none), plus per chunk position j: dev_j (deviated predictions) and n_j (observations).
    """
    n, cfg, h = env.n, env.cfg, predict or chunk
    x = torch.from_numpy(env.render())
    plan_a = np.zeros((n, h), np.int64)
    plan_x = torch.zeros(n, h, *x.shape[1:])
    j = np.full(n, chunk)  # index of the next planned action; chunk = used up
    done = env.at_goal()
    out = {k: np.zeros(n, np.int64) for k in ("steps", "calls", "evals", "verifier_evals", "early")}
    out["first_flag"] = np.full(n, -1)
    dev_j, n_j = np.zeros(chunk, np.int64), np.zeros(chunk, np.int64)
    rows = np.arange(n)
    sim = GridWorld(cfg, n, 0) if record is not None else None
    for t in range(int(budget.max(initial=0))):
        active = ~done & (t < budget)
        if not active.any():
            break
        need = active & (j >= chunk)
        if need.any():
            a, xs = wam.chunk(x[torch.from_numpy(need)], h)
            plan_a[need], plan_x[torch.from_numpy(need)], j[need] = a, xs.to(plan_x.dtype), 0
            out["calls"] += need
            out["evals"] += need * h
        jj = np.minimum(j, chunk - 1)
        env.step(np.where(active, plan_a[rows, jj], NOOP))
        x = torch.from_numpy(env.render())
        pred = plan_x[torch.from_numpy(rows), torch.from_numpy(jj)]
        out["steps"] += active
        dev = deviated(pred.numpy(), x.numpy(), cfg) & active
        np.add.at(dev_j, jj[active], dev[active])
        np.add.at(n_j, jj[active], 1)
        if record is not None:
            keep = torch.from_numpy(active)
            rest = rest_deviated(sim, env.state(), plan_x[:, :chunk], plan_a[:, :chunk], jj, cfg)
            record.append((pred[keep], x[keep], dev[active],
                           *(r[keep] for r in rest_of_chunk(plan_x[:, :chunk], plan_a[:, :chunk], jj)), rest[active]))
        done = done | (env.at_goal() & active)
        if verify is not None:
            ask = active & ~done & (j < chunk - 1)  # the last action of a chunk leaves nothing to throw away
            out["verifier_evals"] += ask
            inputs = (pred, x, plan_x[:, :chunk], plan_a[:, :chunk], jj) if getattr(verify, "rollout", False) \
                else (pred, x)
            flag = np.asarray(verify(*inputs), bool) & ask
            out["early"] += flag
            out["first_flag"] = np.where(flag & (out["first_flag"] < 0), t, out["first_flag"])
            j = np.where(flag, chunk, j + 1)
        else:
            j = j + 1
    out["success"] = done.astype(np.int64)
    out["dev_j"], out["n_j"] = dev_j, n_j
    return out


def verifier_data(args: Args, cfg: EnvConfig, wam) -> dict:
    """Every executed step of perturbed long-chunk episodes (no verifier), labelled by eq. (3) (dev) and eq. (3b)
    (rest_dev), with the rest of its chunk (rest_x, rest_a, valid)."""
    rec: list = []
    env = PerturbedWorld(cfg, args.verifier_episodes, args.seed + 30_000, args.verifier_rate, args.perturb)
    execute(wam, env, args.long_chunk, budgets(env, args.slack), record=rec)
    cat = lambda i: torch.cat([r[i] for r in rec])  # noqa: E731
    lab = lambda i: torch.from_numpy(np.concatenate([r[i] for r in rec])).float()  # noqa: E731
    return {"pred": cat(0), "obs": cat(1), "dev": lab(2), "rest_x": cat(3), "rest_a": cat(4), "valid": cat(5),
            "rest_dev": lab(6)}


def fit_verifier(net: nn.Module, logits, lab: torch.Tensor, train: torch.Tensor, args: Args, gen: torch.Generator,
                 tracker, name: str) -> nn.Module:
    """BCE of logits(idx) against lab[idx] on batches of the rows `train`, positives up-weighted (deviations are
    rare), Adam with cosine decay for --verifier-steps steps."""
    opt, sched = optimiser(net, args.lr, max(args.verifier_steps, 1))
    pos_w = ((1 - lab[train].mean()) / lab[train].mean().clamp(min=1e-3)).clamp(max=20.0)
    for step in range(args.verifier_steps):
        idx = train[torch.randint(0, len(train), (args.batch_size,), generator=gen)]
        loss = F.binary_cross_entropy_with_logits(logits(idx), lab[idx], pos_weight=pos_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.verifier_steps - 1:
            tracker.log({f"loss/{name}": loss.item()}, args.steps + step)
    return net.eval()


def detection(flag: np.ndarray, y: np.ndarray, prefix: str) -> dict:
    """Recall on the positive steps and false alarms on the others."""
    return {f"{prefix}_recall": float(flag[y].mean()) if y.any() else float("nan"),
            f"{prefix}_false_alarm": float(flag[~y].mean()) if (~y).any() else float("nan")}


def train_verifier(args: Args, cfg: EnvConfig, wam, gen: torch.Generator, tracker) -> tuple:
    """Eq. (4) and (4b): fit the frame verifier on eq. (3)'s labels and the rollout verifier on eq. (3b)'s (the steps
    that have a rest of the chunk) of verifier_data; return both, the fixed threshold and held-out detection
    figures: every verifier on the frame labels, and on the rest-of-chunk labels."""
    d = verifier_data(args, cfg, wam)
    perm = torch.randperm(len(d["dev"]), generator=gen)
    test, train = perm[: len(perm) // 5], perm[len(perm) // 5:]
    v = Verifier(args.channels)
    fit_verifier(v, lambda i: v(d["pred"][i], d["obs"][i]), d["dev"], train, args, gen, tracker, "verifier")
    has_rest = d["valid"].any(1)
    rv = RolloutVerifier(args.channels)
    fit_verifier(rv, lambda i: rv(d["obs"][i], d["rest_x"][i], d["rest_a"][i], d["valid"][i]),
                 d["rest_dev"], train[has_rest[train]], args, gen, tracker, "rollout_verifier")
    tau = args.fixed_threshold if args.fixed_threshold is not None else 1.0 / (3 * cfg.frame_size ** 2)
    y = d["dev"][test].numpy() > 0.5
    rtest = test[has_rest[test]]
    ry = d["rest_dev"][rtest].numpy() > 0.5
    figs = {"verifier_deviated_frac": float(y.mean()), "rest_deviated_frac": float(ry.mean())}
    with torch.no_grad():
        for name, fn in (("learned", learned_verifier(v, args.verifier_threshold)), ("fixed", fixed_verifier(tau))):
            figs.update(detection(np.asarray(fn(d["pred"][test], d["obs"][test]), bool), y, f"verifier_{name}"))
            figs.update(detection(np.asarray(fn(d["pred"][rtest], d["obs"][rtest]), bool), ry,
                                  f"verifier_{name}_rest"))
        flag = torch.sigmoid(rv(d["obs"][rtest], d["rest_x"][rtest], d["rest_a"][rtest], d["valid"][rtest])) \
            > args.verifier_threshold
        figs.update(detection(flag.numpy(), ry, "verifier_rollout_rest"))
    return v, rv, tau, figs


def load_models(out_dir: str | Path, channels: int, feedback: str = "snap") -> tuple:
    """The WAM and the verifiers a run saved in out_dir (wam, verifier and rollout_verifier .safetensors)."""
    wam, v, rv = WorldActionModel(channels, feedback), Verifier(channels), RolloutVerifier(channels)
    for net, name in ((wam, "wam"), (v, "verifier"), (rv, "rollout_verifier")):
        net.load_state_dict(load_file(str(Path(out_dir) / f"{name}.safetensors")))
    return wam.eval(), v.eval(), rv.eval()


def work_per_eval(wam: WorldActionModel, v: Verifier, rv: RolloutVerifier, cfg: EnvConfig, horizon: int) -> dict:
    """Multiply-accumulates of one imagined step of the WAM (its policy and dynamics), of one frame-verifier and one
    rollout-verifier evaluation, on one example (forward_macs); the fixed threshold's pixel MSE counts as none."""
    f, s = cfg.frame_size, horizon - 1
    x, a = torch.zeros(1, N_CHANNELS, f, f), torch.zeros(1, dtype=torch.long)
    rest = (torch.zeros(1, s, N_CHANNELS, f, f), torch.zeros(1, s, dtype=torch.long),
            torch.ones(1, s, dtype=torch.bool))
    return {"wam_step": forward_macs(wam, lambda: (wam.policy(x), wam.dynamics(x, a))),
            "gated": forward_macs(v, lambda: v(x, x)), "gated-rollout": forward_macs(rv, lambda: rv(x, *rest))}


def save_figure(path: Path, res: dict, rates, modes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    for m in modes:
        axes[0].plot(rates, [res[f"{m}_r{r}_calls"] for r in rates], "o-", label=m)
        axes[1].plot(rates, [res[f"{m}_r{r}_success"] for r in rates], "o-", label=m)
    axes[0].set_ylabel("model calls per episode"), axes[1].set_ylabel("success rate")
    for ax in axes:
        ax.set_xlabel("perturbation probability per step"), ax.legend(fontsize=7)
    fig.suptitle("FFDC: fixed short / long chunks vs verifier-gated chunks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def evaluate_modes(args: Args, cfg: EnvConfig, wam, v: Verifier, rv: RolloutVerifier, tau: float, tracker) -> dict:
    """Every mode at every perturbation rate on the same maps and draws: per episode, success, model calls, imagined
    steps (evals), network evaluations (net_evals: a policy and a dynamics forward per imagined step),
    verifier_evals, multiply-accumulates of all of them (macs), steps, early replans, execution seconds."""
    arms = {"short": (args.short_chunk, None, None), "long": (args.long_chunk, None, None),
            "gated": (args.long_chunk, learned_verifier(v, args.verifier_threshold), None),
            "gated-fixed": (args.long_chunk, fixed_verifier(tau), None),
            "gated-rollout": (args.long_chunk, rollout_verifier(rv, args.verifier_threshold), None),
            "short-of-long": (args.short_chunk, None, args.long_chunk)}
    work, summary = work_per_eval(wam, v, rv, cfg, args.long_chunk), {}
    for i, rate in enumerate(args.rates):
        for mode in args.modes:
            chunk, verify, predict = arms[mode]
            env = PerturbedWorld(cfg, args.episodes, args.seed + 20_000, rate, args.perturb)
            t1 = time.perf_counter()
            out = execute(wam, env, chunk, budgets(env, args.slack), verify, predict=predict)
            key, mean = f"{mode}_r{rate}", lambda k: float(out[k].mean())  # noqa: E731
            summary.update({f"{key}_success": mean("success"), f"{key}_calls": mean("calls"),
                            f"{key}_evals": mean("evals"), f"{key}_net_evals": 2 * mean("evals"),
                            f"{key}_verifier_evals": mean("verifier_evals"),
                            f"{key}_macs": mean("evals") * work["wam_step"]
                            + mean("verifier_evals") * work.get(mode, 0),
                            f"{key}_steps": mean("steps"), f"{key}_early": mean("early"),
                            f"{key}_exec_s": time.perf_counter() - t1})
            if mode == "long" and rate == 0.0:  # how often the WAM's own prediction is off, by chunk position
                dev = out["dev_j"] / np.maximum(out["n_j"], 1)
                summary["pred_dev_h1"], summary[f"pred_dev_h{chunk}"] = float(dev[0]), float(dev[-1])
            tracker.log({f"eval/{mode}_{k}": summary[f"{key}_{k}"] for k in ("success", "calls", "evals")}, i)
    return summary


# ---- main ----
def main(args: Args) -> dict:
    cfg = check_args(args)
    t0 = time.perf_counter()
    device, tracker, timer = start_run(args)
    fr, eff, lab = collect_expert(cfg, args.train_traj, args.traj_len, args.train_eps, args.seed)
    frames, effs, labels = (torch.from_numpy(a).to(device) for a in (fr, eff, lab))

    wam = WorldActionModel(args.channels, args.feedback).to(device)
    opt, sched = optimiser(wam, args.lr, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc=args.exp_name, disable=None)
    for step in bar:
        with timer("train"):
            horizons = args.horizons if step >= args.chain_warmup * args.steps else (1,)
            windows = sample_windows(horizons, args.batch_size, len(frames), effs.shape[1], gen)
            loss, parts = moh_loss(wam, frames, effs, labels, *windows, args.feedback)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            tracker.log({"loss/train": loss.item(), **parts, **{f"perf/{n}_s": v for n, v in timer.pop().items()}},
                        step)
            bar.set_postfix(act=f"{parts['loss/action']:.3f}", frame=f"{parts['loss/frame']:.4f}")
    wam.eval().cpu()

    v, rv, tau, summary = train_verifier(args, cfg, wam, gen, tracker)
    for net, name in ((wam, "wam"), (v, "verifier"), (rv, "rollout_verifier")):
        save_file(net.state_dict(), str(Path(args.out_dir) / f"{name}.safetensors"))
    summary["fixed_threshold"] = tau
    summary.update(evaluate_modes(args, cfg, wam, v, rv, tau, tracker))
    if "gated" in args.modes and "short" in args.modes:
        r = max(args.rates)
        summary["calls_saved_vs_short"] = 1 - summary[f"gated_r{r}_calls"] / summary[f"short_r{r}_calls"]
        summary["success_gain_vs_short"] = summary[f"gated_r{r}_success"] - summary[f"short_r{r}_success"]
    if args.save_png:
        save_figure(Path(args.out_dir) / "ffdc.png", summary, args.rates, args.modes)
    summary["wall_s"] = time.perf_counter() - t0
    return tracker.finish(summary)


if __name__ == "__main__":
    out = main(tyro.cli(Args))
    for k, val in out.items():
        print(f"{k}: {val:.4g}" if isinstance(val, float) else f"{k}: {val}")
