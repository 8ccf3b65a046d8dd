"""ReGuide: phase-conditioned guidance of a behaviour-cloned diffusion policy, and its guided rollouts absorbed.

Parent: none.

Paper. "ReGuide: From Test-Time Guidance to Self-Improving Diffusion Policies" (Lin, Shakkottai, Kalathil and Kumar,
arXiv:2606.28939). Behaviour-cloned diffusion policies drift off the demonstrations: a small deviation puts the
policy in a state it never saw, and its errors compound. Phase-Conditioned Guidance (PCG) steers the frozen policy
with a learned dynamics model, but only in the drifted-but-recoverable regime (close to the demonstrations: no
guidance needed; far from them: the dynamics model cannot be trusted), towards a target of the current phase of the
task, and through the estimated clean action (the dynamics model is trained on clean actions, not on the noisy
samples of the denoising chain). The successful guided rollouts are then absorbed as on-policy recovery data:
ReGuide-FT fine-tunes the current policy on them, ReGuide-FS retrains from scratch on the augmented data set; either
can be iterated. Paper (Robomimic Can, Square, Transport, Tool Hang): base-policy success x1.3 to x7.7, and
matched-data ablations credit the guided recovery data rather than the extra rollouts.

Method here. A point agent in a T-shaped corridor (`is_free`): a stem x in [2, 3], y in [0, 3] and a crossbar
x in [0, 5], y in [3, 4]; it starts at the bottom of the stem and must reach the goal disc at the right end of the
crossbar; the left arm is a dead end. An action is a displacement of norm <= `max_step`; a move that ends in a wall
slides along it (`move`). Each step adds Gaussian execution noise and, with probability `push_prob`, a push of
length `push_size` in a random direction: the covariate shift. A scripted expert (`expert_action`) gives a few
demonstrations; a small DDPM diffusion policy over 2-D actions is cloned from them. An MLP dynamics model
f(s, a) -> s' is trained on random-action play around the demonstrations (`play_data`). Arms, on the same starts,
noise and pushes: the base policy; the base policy under PCG (test-time guidance alone); ReGuide (`--absorb ft` or
`fs`, `--rounds` iterations), evaluated without guidance; and the matched-data control, the same policy absorbing the
same number of its own successful *unguided* rollouts, through the same update.

Equations (function that implements each):
  (1) denoising loss    L = E_{k, eps} || eps - eps_theta(sqrt(abar_k) a + sqrt(1 - abar_k) eps, k, s) ||^2   `bc_loss`
  (2) clean action      a0_hat = (a_k - sqrt(1 - abar_k) eps_theta(a_k, k, s)) / sqrt(abar_k), clipped to [-1, 1]
                                                                                               `clean_action`
  (3) drift and phase   d(s) = min_i ||s - s_i||, p(s) = phase of the nearest demonstration state, a demonstration
                        of T steps cut into P phases by progress t / T                            `drift_and_phase`
  (4) phase targets     g_p = mean over demonstrations of the state at progress (p + 1) / P       `phase_targets`
  (5) gate              guide iff d_lo < d(s) <= d_hi (drifted but recoverable)                   `recoverable_gate`
  (6) guidance          a0_tilde = clip(a0_hat - lambda * grad_a0 || f(s, a0_hat) - g_p(s) ||, -1, 1),
                        in gated states only                                                  `guide_clean_action`
  (7) posterior step    a_{k-1} = c1_k a0_tilde + c2_k a_k + sigma_k z,
                        c1 = sqrt(abar_{k-1}) beta_k / (1 - abar_k), c2 = sqrt(alpha_k)(1 - abar_{k-1}) / (1 - abar_k),
                        sigma_k^2 = beta_k (1 - abar_{k-1}) / (1 - abar_k); a_{-1} = a0_tilde           `ddpm_step`
  (8) dynamics loss     L_f = || f(s, a) - s' ||^2, f(s, a) = s + MLP(s, a)                      `dynamics_loss`
  (9) absorption        D <- D u {(s_t, a_t), t < T_success} of the successful rollouts only      `absorb`

Deviations:
- Robomimic's image observations, visual latents and action chunks are replaced by a 2-D state, one action per
  step and the state itself as the latent (the encoder is the identity): the phase targets and the drift distance
  live in state space.
- The paper's gate and targets are built from its latent dynamics model; here the drift distance is the distance to
  the nearest demonstration state and the phase is that state's progress bucket (eq. 3), with thresholds `d_lo`,
  `d_hi` in corridor units. The guidance cost is the (unsquared) distance of the predicted next state to the phase
  target, so its gradient has a bounded norm and `guidance_scale` is a step length in normalised action units.
- The dynamics model learns from random-action play started at demonstration states (`play_data`), so its data
  thin out with the distance from the demonstrations: beyond `d_hi` it has seen little, which is what the gate's
  upper bound is for.
- The matched-data control absorbs as many successful unguided rollouts of the same policy as ReGuide absorbs
  guided ones (it collects batches of `collect_episodes` until it has them, at most `control_batches` batches); it
  matches episodes, not transitions (both are reported; at the defaults they agree within 1%).
- ReGuide-FT and the control fine-tune on the demonstrations plus everything absorbed so far, sampled uniformly.

Commands:
  python worldmodels/reguide.py                      # ~1 min on 1 CPU thread
  python worldmodels/reguide.py --absorb fs          # ReGuide-FS: retrain from scratch on the augmented data
  python worldmodels/reguide.py --rounds 3           # iterated absorption
  python worldmodels/reguide.py --d-hi 1000          # guidance wherever the policy drifted (no upper bound)
Expected result (benchmarks/results/reguide.md from `python benchmarks/reguide_table.py`, 3 seeds, 500 episodes per
arm). Seed 0 (the default command, ~65 s of one thread): base policy 79.4% success, under guidance 93.6%, ReGuide-FT
88.8% after one round and 93.2% after two (evaluated without guidance), the matched unguided data 77.6% and 77.6%;
the failures are agents pushed into a pocket that the cloned policy never leaves. Over seeds 0-2: base 88.5 +- 9.0,
guidance alone 95.7 +- 2.5, ReGuide-FT 95.9 +- 2.7, matched unguided data 87.3 +- 9.1, ReGuide-FS 94.9 +- 3.6 (its
control 87.2 +- 9.0). ReGuide beats both the base policy and the matched control on every seed (FT by 1.2 to 15.6
points, FS by 0.4 to 12.8), but the base policy's success varies so much between seeds (79 to 97%) that Welch's
interval over 3 seeds includes zero. Guidance in every state (no gate) does as well as the gated guidance here (96.3 +- 2.0): the play data
cover the few states beyond `d_hi` (0.3% of the steps), so the gate's upper bound has little to protect against.
"""
from __future__ import annotations

import copy
import dataclasses
import math
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
from tqdm import tqdm

from worldmodels._envs import optimiser, start_run


# ---- args ----
@dataclass
class Args:
    exp_name: str = "reguide"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for demonstrations, init, rollouts and sampling"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = "runs/reguide"
    """where metrics.jsonl, summary.json and the PNG go"""
    device: str = "cpu"
    """'auto', 'cpu' or 'cuda' (the networks; the corridor is numpy)"""
    threads: int = 1
    """torch CPU threads"""
    # corridor
    horizon: int = 40
    """steps per episode"""
    max_step: float = 0.25
    """largest displacement an action commands"""
    exec_noise: float = 0.03
    """std of the Gaussian execution noise added to every move"""
    push_prob: float = 0.15
    """probability per step of a push (the covariate shift)"""
    push_size: float = 0.7
    """length of a push, in a uniformly random direction"""
    # demonstrations, policy, dynamics model
    demos: int = 4
    """expert demonstrations the policy is cloned from"""
    denoise_steps: int = 10
    """K: DDPM steps of the diffusion policy"""
    hidden: int = 128
    """width of the policy's and the dynamics model's MLPs"""
    steps: int = 3000
    """optimiser steps of behaviour cloning from scratch"""
    batch_size: int = 256
    """state-action pairs per step"""
    lr: float = 1e-3
    """Adam learning rate (cosine decay to 10%)"""
    play_traj: int = 400
    """random-action play trajectories for the dynamics model, each started at a demonstration state"""
    play_len: int = 6
    """steps per play trajectory"""
    dyn_steps: int = 1500
    """optimiser steps of the dynamics model"""
    # phase-conditioned guidance
    phases: int = 4
    """P: phases per demonstration (eq. 3)"""
    d_lo: float = 0.25
    """drift distance above which a state is drifted (eq. 5)"""
    d_hi: float = 1.5
    """drift distance above which a state is beyond recovery (eq. 5)"""
    guidance_scale: float = 0.5
    """lambda of eq. (6), per denoising step"""
    # absorption
    absorb: Literal["ft", "fs"] = "ft"
    """ft: fine-tune the current policy (ReGuide-FT); fs: retrain from scratch on the augmented data (ReGuide-FS)"""
    rounds: int = 2
    """collect-and-absorb iterations"""
    collect_episodes: int = 200
    """guided rollouts collected per round"""
    control_batches: int = 4
    """most batches of collect_episodes unguided rollouts the control may draw to match ReGuide's successes"""
    ft_steps: int = 1500
    """optimiser steps of a fine-tuning (ft); fs retrains for `steps`"""
    ft_lr: float = 5e-4
    """learning rate of a fine-tuning"""
    eval_episodes: int = 500
    """evaluation episodes per arm (the same starts, noise and pushes for every arm)"""
    log_every: int = 500
    """optimiser steps between metric lines"""
    save_png: bool = True
    """save reguide.png (trajectories and success per arm) into out_dir"""


def check_args(args: Args) -> None:
    if args.horizon < 1 or args.demos < 1 or args.denoise_steps < 2 or args.phases < 1:
        raise SystemExit("--horizon, --demos and --phases must be >= 1 and --denoise-steps >= 2, got "
                         f"{args.horizon}, {args.demos}, {args.phases}, {args.denoise_steps}")
    if args.max_step <= 0 or args.exec_noise < 0 or args.push_size < 0 or not 0.0 <= args.push_prob <= 1.0:
        raise SystemExit("need --max-step > 0, --exec-noise >= 0, --push-size >= 0 and --push-prob in [0, 1]")
    if not 0.0 <= args.d_lo < args.d_hi:
        raise SystemExit(f"need 0 <= --d-lo < --d-hi, got {args.d_lo}, {args.d_hi}")
    if args.guidance_scale < 0:
        raise SystemExit(f"--guidance-scale must be >= 0, got {args.guidance_scale}")
    if args.rounds < 1 or args.collect_episodes < 1 or args.control_batches < 1 or args.eval_episodes < 2:
        raise SystemExit("--rounds, --collect-episodes and --control-batches must be >= 1, --eval-episodes >= 2")
    if min(args.steps, args.ft_steps, args.dyn_steps, args.batch_size, args.play_traj, args.play_len,
           args.hidden, args.threads, args.log_every) < 1 or args.lr <= 0 or args.ft_lr <= 0:
        raise SystemExit("steps, batch size, play data, width, threads and log interval must be >= 1, rates > 0")


# ---- the corridor ----
STEM, BAR = (2.0, 3.0, 0.0, 3.0), (0.0, 5.0, 3.0, 4.0)  # (x0, x1, y0, y1) of the free rectangles
POCKETS = ((0.5, 2.0, 0.7, 2.3), (3.0, 4.5, 0.7, 2.3))  # dead-end side pockets off the stem
FREE = (STEM, BAR) + POCKETS
JUNCTION, GOAL, GOAL_RADIUS = np.array([2.5, 3.5]), np.array([4.6, 3.5]), 0.3
START_BOX = (2.1, 2.9, 0.1, 0.6)


def is_free(p: np.ndarray) -> np.ndarray:
    """(N, 2) positions -> (N,) True inside the corridor (the stem, the crossbar or a pocket, boundary included)."""
    inside = lambda r: (p[:, 0] >= r[0]) & (p[:, 0] <= r[1]) & (p[:, 1] >= r[2]) & (p[:, 1] <= r[3])  # noqa: E731
    return np.logical_or.reduce([inside(r) for r in FREE])


def move(p: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Move by d (N, 2); a move that ends in a wall slides: along x only if that is free, else along y only, else
    the agent stays."""
    full, xs, ys = p + d, p + d * np.array([1.0, 0.0]), p + d * np.array([0.0, 1.0])
    out = np.where(is_free(ys)[:, None], ys, p)
    out = np.where(is_free(xs)[:, None], xs, out)
    return np.where(is_free(full)[:, None], full, out)


def at_goal(p: np.ndarray) -> np.ndarray:
    return np.linalg.norm(p - GOAL, axis=-1) < GOAL_RADIUS


def expert_action(p: np.ndarray) -> np.ndarray:
    """Normalised expert actions (N, 2), norm 1: up the stem to the junction, then right along the crossbar."""
    target = np.where((p[:, 1] < 3.25)[:, None], JUNCTION, GOAL)
    d = target - p
    return d / np.maximum(np.linalg.norm(d, axis=-1, keepdims=True), 1e-8)


def start_states(rng: np.random.Generator, n: int) -> np.ndarray:
    x0, x1, y0, y1 = START_BOX
    return np.stack([rng.uniform(x0, x1, n), rng.uniform(y0, y1, n)], -1)


def world_step(p: np.ndarray, a: np.ndarray, args: Args, rng: np.random.Generator) -> np.ndarray:
    """One step of N agents: the commanded move (normalised action times max_step, norm <= max_step) plus execution
    noise, then a push with probability push_prob. Every draw is made for every agent, so that two arms on the same
    seed see the same noise and pushes."""
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1.0)
    noise = rng.normal(0.0, args.exec_noise, p.shape)
    pushed, angle = rng.random(len(p)) < args.push_prob, rng.uniform(0, 2 * np.pi, len(p))
    p = move(p, a * args.max_step + noise)
    push = args.push_size * np.stack([np.cos(angle), np.sin(angle)], -1) * pushed[:, None]
    return move(p, push)


def expert_demos(args: Args, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`args.demos` expert episodes without pushes: a list of (states (T, 2), normalised actions (T, 2)), up to the
    step that reaches the goal."""
    rng, demos = np.random.default_rng(seed), []
    for _ in range(args.demos):
        p, states, acts = start_states(rng, 1), [], []
        while not at_goal(p)[0] and len(states) < 4 * args.horizon:
            a = expert_action(p)
            states.append(p[0]), acts.append(a[0])
            p = move(p, a * args.max_step + rng.normal(0.0, args.exec_noise, p.shape))
        demos.append((np.array(states), np.array(acts)))
    return demos


# ---- the diffusion policy ----
def norm_state(s: torch.Tensor) -> torch.Tensor:
    return (s - 2.5) / 2.5


class DiffusionPolicy(nn.Module):
    """eps_theta(a_k (B, 2), k (B,), s (B, 2)) -> predicted noise (B, 2); actions are normalised (norm <= 1)."""

    def __init__(self, hidden: int, denoise_steps: int):
        super().__init__()
        self.emb = nn.Embedding(denoise_steps, 32)
        self.net = nn.Sequential(nn.Linear(2 + 2 + 32, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2))

    def forward(self, a_k, k, s):
        return self.net(torch.cat([a_k, self.emb(k), norm_state(s)], -1))


def schedule(k_steps: int) -> dict:
    """Cosine noise schedule (Nichol and Dhariwal) of K steps: betas, alphas and abar, each (K,), index 0 least noisy."""
    t = torch.linspace(0, 1, k_steps + 1, dtype=torch.float64)
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    abar = (f[1:] / f[0]).clamp(min=1e-5)
    betas = (1 - abar / torch.cat([torch.ones(1, dtype=abar.dtype), abar[:-1]])).clamp(max=0.999)
    abar = torch.cumprod(1 - betas, 0)
    return {"betas": betas.float(), "alphas": (1 - betas).float(), "abar": abar.float()}


def bc_loss(policy: DiffusionPolicy, s, a, sched: dict, gen: torch.Generator):
    """Eq. (1): one noise level k and one noise draw per pair."""
    k = torch.randint(0, len(sched["abar"]), (len(a),), generator=gen).to(a.device)
    eps = torch.randn(a.shape, generator=gen).to(a.device)
    ab = sched["abar"].to(a.device)[k][:, None]
    return F.mse_loss(policy(ab.sqrt() * a + (1 - ab).sqrt() * eps, k, s), eps)


def clean_action(a_k, eps_hat, abar_k) -> torch.Tensor:
    """Eq. (2): the denoiser's estimate of the clean action from the noisy one, clipped to [-1, 1]."""
    abar_k = torch.as_tensor(abar_k)
    return ((a_k - (1 - abar_k).sqrt() * eps_hat) / abar_k.sqrt()).clamp(-1.0, 1.0)


def ddpm_step(a_k, a0, k: int, sched: dict, z) -> torch.Tensor:
    """Eq. (7): a draw of a_{k-1} from the DDPM posterior given a_k and the (guided) clean action; a0 itself at k = 0."""
    if k == 0:
        return a0
    b, al, ab, ab_prev = sched["betas"][k], sched["alphas"][k], sched["abar"][k], sched["abar"][k - 1]
    c1, c2 = ab_prev.sqrt() * b / (1 - ab), al.sqrt() * (1 - ab_prev) / (1 - ab)
    return c1 * a0 + c2 * a_k + (b * (1 - ab_prev) / (1 - ab)).sqrt() * z


# ---- phase-conditioned guidance ----
class Dynamics(nn.Module):
    """f(s (B, 2), a (B, 2) normalised) -> predicted next state s + MLP(s, a) (B, 2)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 2))

    def forward(self, s, a):
        return s + self.net(torch.cat([norm_state(s), a], -1))


def dynamics_loss(dyn: nn.Module, s, a, s_next) -> torch.Tensor:
    """Eq. (8): squared error of the predicted next state, summed over the two coordinates, mean over the batch."""
    return ((dyn(s, a) - s_next) ** 2).sum(-1).mean()


def drift_and_phase(s: torch.Tensor, demo_s: torch.Tensor, demo_phase: torch.Tensor):
    """Eq. (3): distance (B,) to the nearest demonstration state of demo_s (M, 2), and that state's phase (B,)."""
    d, i = torch.cdist(s, demo_s).min(dim=1)
    return d, demo_phase[i]


def phase_targets(demos: list, phases: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. (4): targets (P, 2), g_p the mean over demonstrations of the state at progress (p + 1) / P (the goal for
    the last phase: the state the last action reaches, taken as the last state plus one expert step); also every
    demonstration state (M, 2) with its phase floor(P t / T) (M,)."""
    ends, states, phase = [], [], []
    for s, _ in demos:
        t = len(s)
        ends.append([s[min(t - 1, round((p + 1) * t / phases))] if p < phases - 1 else GOAL for p in range(phases)])
        states.append(s)
        phase.append(np.minimum(np.arange(t) * phases // t, phases - 1))
    return (torch.tensor(np.mean(np.array(ends), 0), dtype=torch.float32),
            torch.tensor(np.concatenate(states), dtype=torch.float32), torch.tensor(np.concatenate(phase)))


def recoverable_gate(d: torch.Tensor, d_lo: float, d_hi: float) -> torch.Tensor:
    """Eq. (5): True where the state drifted (d > d_lo) but not beyond recovery (d <= d_hi)."""
    return (d > d_lo) & (d <= d_hi)


def guide_clean_action(dyn: nn.Module, s, a0, target, scale: float) -> torch.Tensor:
    """Eq. (6): one gradient step on the clean action (B, 2) down the distance of the predicted next state to the
    target (B, 2); the gradient flows through the dynamics model only, not through the denoiser."""
    a = a0.detach().requires_grad_(True)
    with torch.enable_grad():
        cost = (dyn(s, a) - target).norm(dim=-1).sum()
        (g,) = torch.autograd.grad(cost, a)
    return (a0 - scale * g).clamp(-1.0, 1.0)


class Guide:
    """PCG for one batch of states: the gate (eq. 5) and the phase target (eqs. 3-4) of every state, then
    `__call__(a0)` applies eq. (6) to the gated rows."""

    def __init__(self, dyn, targets, demo_s, demo_phase, args: Args):
        self.dyn, self.targets, self.demo_s, self.demo_phase, self.args = dyn, targets, demo_s, demo_phase, args

    def prepare(self, s: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        d, phase = drift_and_phase(s, self.demo_s, self.demo_phase)
        self.s, self.target = s, self.targets[phase]
        self.mask = recoverable_gate(d, self.args.d_lo, self.args.d_hi) & active
        self.regime = torch.where(d <= self.args.d_lo, 0, torch.where(d <= self.args.d_hi, 1, 2))
        return self.mask

    def __call__(self, a0):
        if not self.mask.any():
            return a0
        guided = guide_clean_action(self.dyn, self.s, a0, self.target, self.args.guidance_scale)
        return torch.where(self.mask[:, None], guided, a0)


@torch.no_grad()
def sample_actions(policy: DiffusionPolicy, s, sched: dict, gen: torch.Generator, guide: Guide | None = None):
    """Eqs. (2), (6), (7): K denoising steps from N(0, I); at each step the clean-action estimate is guided (gated
    rows only) before the posterior step. All noise comes from `gen` (drawn alike with or without guidance)."""
    dev = s.device
    a = torch.randn(s.shape, generator=gen).to(dev)
    for k in reversed(range(len(sched["abar"]))):
        kk = torch.full((len(s),), k, dtype=torch.long, device=dev)
        a0 = clean_action(a, policy(a, kk, s), sched["abar"][k])
        if guide is not None:
            a0 = guide(a0)
        a = ddpm_step(a, a0, k, sched, torch.randn(s.shape, generator=gen).to(dev))
    return a


# ---- rollouts and absorption ----
def rollout(policy, sched: dict, args: Args, n: int, seed: int, guide: Guide | None = None) -> dict:
    """n episodes of `policy` (under PCG when `guide` is given) from starts, noise and pushes drawn from `seed`.
    Returns states (n, H + 1, 2), actions (n, H, 2), success (n,), length (n,: steps until the goal, H if never),
    guided (n, H: the gate fired) and regime counts of the active steps (in, recoverable, beyond)."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    dev = next(policy.parameters()).device
    p = start_states(rng, n)
    states, actions = np.zeros((n, args.horizon + 1, 2)), np.zeros((n, args.horizon, 2))
    guided, done = np.zeros((n, args.horizon), bool), np.zeros(n, bool)
    length, regimes = np.full(n, args.horizon), np.zeros(3, np.int64)
    states[:, 0] = p
    for t in range(args.horizon):
        s = torch.tensor(p, dtype=torch.float32, device=dev)
        if guide is not None:
            guided[:, t] = guide.prepare(s, torch.from_numpy(~done).to(dev)).cpu().numpy()
            regimes += np.bincount(guide.regime.cpu().numpy()[~done], minlength=3)
        a = sample_actions(policy, s, sched, gen, guide).cpu().numpy().astype(np.float64)
        actions[:, t] = a
        p = np.where(done[:, None], p, world_step(p, a, args, rng))
        states[:, t + 1] = p
        reached = at_goal(p) & ~done
        length[reached], done = t + 1, done | reached
    return {"states": states, "actions": actions, "success": done, "length": length, "guided": guided,
            "regimes": regimes}


def absorb(data_s: torch.Tensor, data_a: torch.Tensor, roll: dict, keep: np.ndarray | None = None):
    """Eq. (9): append the (state, action) pairs of the successful episodes of `roll` (among `keep`, if given), up to
    the step that reached the goal. Returns the augmented (states, actions) and the number of episodes absorbed."""
    take = roll["success"] & (True if keep is None else keep)
    s = [roll["states"][i, :roll["length"][i]] for i in np.flatnonzero(take)]
    a = [roll["actions"][i, :roll["length"][i]] for i in np.flatnonzero(take)]
    if not s:
        return data_s, data_a, 0
    new_s, new_a = (torch.tensor(np.concatenate(x), dtype=torch.float32, device=data_s.device) for x in (s, a))
    return torch.cat([data_s, new_s]), torch.cat([data_a, new_a]), int(take.sum())


def first_successes(roll: dict, m: int) -> np.ndarray:
    """Mask of the first m successful episodes of `roll`."""
    return roll["success"] & (np.cumsum(roll["success"]) <= m)


# ---- training ----
def fit_policy(policy, s, a, sched, steps: int, lr: float, args: Args, gen, tracker, tag: str, step0: int = 0):
    """Eq. (1) on uniformly sampled pairs of (s, a) for `steps` Adam steps."""
    opt, sched_lr = optimiser(policy, lr, steps)
    bar = tqdm(range(steps), desc=f"{args.exp_name} {tag}", disable=None, leave=False)
    for step in bar:
        idx = torch.randint(0, len(s), (args.batch_size,), generator=gen).to(s.device)
        loss = bc_loss(policy, s[idx], a[idx], sched, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched_lr.step()
        if step % args.log_every == 0 or step == steps - 1:
            tracker.log({f"loss/{tag}": loss.item()}, step0 + step)
            bar.set_postfix(loss=f"{loss.item():.4f}")
    return policy.eval()


def play_data(demos: list, args: Args, seed: int):
    """Random-action play from demonstration states: (s, a, s') tensors of play_traj x play_len transitions
    (actions uniform in the unit disc, the world's noise and pushes included)."""
    rng = np.random.default_rng(seed)
    pool = np.concatenate([s for s, _ in demos])
    p, out = pool[rng.integers(0, len(pool), args.play_traj)], []
    for _ in range(args.play_len):
        r, ang = np.sqrt(rng.random(len(p))), rng.uniform(0, 2 * np.pi, len(p))
        a = np.stack([r * np.cos(ang), r * np.sin(ang)], -1)
        p_next = world_step(p, a, args, rng)
        out.append((p, a, p_next))
        p = p_next
    return tuple(torch.tensor(np.concatenate([o[i] for o in out]), dtype=torch.float32) for i in range(3))


def fit_dynamics(demos: list, args: Args, device, gen, tracker) -> tuple[Dynamics, float]:
    """Eq. (8) on play data; returns the model and its error on held-out play (root mean squared, corridor units)."""
    s, a, s2 = (x.to(device) for x in play_data(demos, args, args.seed + 1))
    ts, ta, ts2 = (x.to(device) for x in play_data(demos, args, args.seed + 2))
    dyn = Dynamics(args.hidden).to(device)
    opt, sched_lr = optimiser(dyn, args.lr, args.dyn_steps)
    for step in range(args.dyn_steps):
        idx = torch.randint(0, len(s), (args.batch_size,), generator=gen).to(device)
        loss = dynamics_loss(dyn, s[idx], a[idx], s2[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched_lr.step()
        if step % args.log_every == 0 or step == args.dyn_steps - 1:
            tracker.log({"loss/dynamics": loss.item()}, step)
    with torch.no_grad():
        rmse = dynamics_loss(dyn, ts, ta, ts2).sqrt().item()
    return dyn.eval(), rmse


def absorb_update(policy, data_s, data_a, sched, args: Args, gen, tracker, tag: str, step0: int):
    """ReGuide-FT (fine-tune a copy of the current policy) or ReGuide-FS (a fresh policy, trained from scratch), on
    the augmented data; the control goes through the same update."""
    if args.absorb == "ft":
        return fit_policy(copy.deepcopy(policy).train(), data_s, data_a, sched, args.ft_steps, args.ft_lr, args, gen,
                          tracker, tag, step0)
    fresh = DiffusionPolicy(args.hidden, args.denoise_steps).to(data_s.device)
    return fit_policy(fresh, data_s, data_a, sched, args.steps, args.lr, args, gen, tracker, tag, step0)


def matched_control(policy, sched, args: Args, m: int, seed: int):
    """The matched-data control's rollouts: unguided batches of collect_episodes (the first on ReGuide's collection
    seed) until m successes or control_batches batches. Returns [(rollout, keep mask)] and the episodes drawn."""
    out, got, drawn = [], 0, 0
    for b in range(args.control_batches):
        if got >= m:
            break
        roll = rollout(policy, sched, args, args.collect_episodes, seed + b)
        keep = first_successes(roll, m - got)
        out.append((roll, keep))
        got, drawn = got + int(keep.sum()), drawn + args.collect_episodes
    return out, drawn


def evaluate(policy, sched, args: Args, guide: Guide | None = None) -> dict:
    """Success on eval_episodes episodes of the evaluation seed (alike for every arm), and the gate's figures."""
    roll = rollout(policy, sched, args, args.eval_episodes, args.seed + 50_000, guide)
    n_active = max(int(roll["regimes"].sum()), 1)
    return {"success": float(roll["success"].mean()), "guided_step_frac": float(roll["guided"].sum() / n_active),
            "regimes": roll["regimes"] / n_active, "roll": roll}


def save_figure(path: Path, demos: list, rolls: dict, res: dict, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (name, roll) in zip(axes[:2], rolls.items()):
        for r in FREE:
            ax.add_patch(plt.Rectangle((r[0], r[2]), r[1] - r[0], r[3] - r[2], color="0.92"))
        for i in range(min(30, len(roll["states"]))):
            st = roll["states"][i, :roll["length"][i] + 1]
            ax.plot(st[:, 0], st[:, 1], lw=0.6, color="tab:green" if roll["success"][i] else "tab:red")
        for s, _ in demos:
            ax.plot(s[:, 0], s[:, 1], "k--", lw=1)
        ax.add_patch(plt.Circle(GOAL, GOAL_RADIUS, color="gold", alpha=0.7))
        ax.set(xlim=(-0.1, 5.1), ylim=(-0.1, 4.1), aspect="equal", title=name)
    xs = np.arange(rounds + 1)
    for key, label in (("reguide", "ReGuide"), ("control", "matched unguided data"),
                       ("reguide_guided", "ReGuide + PCG")):
        axes[2].plot(xs, [res["success_base" if r == 0 and key != "reguide_guided" else
                              "success_guided" if r == 0 else f"success_{key}_r{r}"] for r in xs], "o-", label=label)
    axes[2].set_xticks(xs)
    axes[2].set(xlabel="absorption round", ylabel="success (no guidance unless marked)", ylim=(0, 1))
    axes[2].legend(fontsize=7)
    fig.suptitle("ReGuide on the T corridor (green: success, red: failure; dashed: demonstrations)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    t0 = time.perf_counter()
    device, tracker, _ = start_run(args)
    gen = torch.Generator().manual_seed(args.seed)
    sched = schedule(args.denoise_steps)
    sched = {k: v.to(device) for k, v in sched.items()}
    demos = expert_demos(args, args.seed)
    demo_s = torch.tensor(np.concatenate([s for s, _ in demos]), dtype=torch.float32, device=device)
    demo_a = torch.tensor(np.concatenate([a for _, a in demos]), dtype=torch.float32, device=device)
    targets, demo_states, demo_phase = (x.to(device) for x in phase_targets(demos, args.phases))

    base = fit_policy(DiffusionPolicy(args.hidden, args.denoise_steps).to(device), demo_s, demo_a, sched, args.steps,
                      args.lr, args, gen, tracker, "bc")
    dyn, dyn_rmse = fit_dynamics(demos, args, device, gen, tracker)
    guide = Guide(dyn, targets, demo_states, demo_phase, args)
    ev_base, ev_guided = evaluate(base, sched, args), evaluate(base, sched, args, guide)
    ungated = Guide(dyn, targets, demo_states, demo_phase, dataclasses.replace(args, d_lo=0.0, d_hi=math.inf))
    res = {"success_base": ev_base["success"], "success_guided": ev_guided["success"],
           "success_guided_ungated": evaluate(base, sched, args, ungated)["success"],
           "guided_step_frac": ev_guided["guided_step_frac"], "dyn_rmse": dyn_rmse,
           "demo_transitions": len(demo_s), **{f"regime_{n}_frac": float(v) for n, v in
                                               zip(("in", "recoverable", "beyond"), ev_guided["regimes"])}}
    tracker.log({"eval/success_base": res["success_base"], "eval/success_guided": res["success_guided"]}, 0)

    pol_g, pol_c = base, base  # ReGuide's chain and the matched-data control's chain
    (g_s, g_a), (c_s, c_a) = (demo_s, demo_a), (demo_s, demo_a)
    for r in range(1, args.rounds + 1):
        seed_r = args.seed + 1000 * r
        roll_g = rollout(pol_g, sched, args, args.collect_episodes, seed_r, guide)
        g_s, g_a, m = absorb(g_s, g_a, roll_g)
        ctrl, drawn = matched_control(pol_c, sched, args, m, seed_r)
        m_c = 0
        for roll, keep in ctrl:
            c_s, c_a, n_abs = absorb(c_s, c_a, roll, keep)
            m_c += n_abs
        pol_g = absorb_update(pol_g, g_s, g_a, sched, args, gen, tracker, "reguide", r * 100_000)
        pol_c = absorb_update(pol_c, c_s, c_a, sched, args, gen, tracker, "control", r * 100_000 + 50_000)
        ev_g, ev_c, ev_gg = evaluate(pol_g, sched, args), evaluate(pol_c, sched, args), evaluate(pol_g, sched, args,
                                                                                                guide)
        round_res = {"success_reguide": ev_g["success"], "success_control": ev_c["success"],
                     "success_reguide_guided": ev_gg["success"], "collect_success_guided": float(roll_g["success"].mean()),
                     "absorbed_episodes": m, "control_episodes": m_c, "control_drawn": drawn,
                     "absorbed_transitions": len(g_s) - len(demo_s), "control_transitions": len(c_s) - len(demo_s)}
        res.update({f"{k}_r{r}": v for k, v in round_res.items()})
        tracker.log({f"eval/{k}": v for k, v in round_res.items()}, r)
        print(f"round {r}: ReGuide {ev_g['success']:.3f}, matched unguided data {ev_c['success']:.3f}, "
              f"absorbed {m} guided / {m_c} unguided episodes", flush=True)
    last = args.rounds
    for k in ("success_reguide", "success_control", "success_reguide_guided", "absorbed_episodes", "control_episodes",
              "absorbed_transitions", "control_transitions"):
        res[k] = res[f"{k}_r{last}"]
    res["gain_reguide"] = res["success_reguide"] - res["success_base"]
    res["gain_vs_control"] = res["success_reguide"] - res["success_control"]
    res["gain_guided"] = res["success_guided"] - res["success_base"]
    if args.save_png:
        save_figure(Path(args.out_dir) / "reguide.png", demos,
                    {"base policy": ev_base["roll"], "base policy + PCG": ev_guided["roll"]}, res, args.rounds)
    res["wall_s"] = time.perf_counter() - t0
    return tracker.finish(res)


if __name__ == "__main__":
    out = main(tyro.cli(Args))
    for k, val in out.items():
        print(f"{k}: {val:.4g}" if isinstance(val, float) else f"{k}: {val}")
