"""HABC: hierarchical advantage-weighted behaviour cloning, online fine-tuning with human interventions.

Paper: Fang et al., "Hierarchical Advantage Weighting for Online RL Fine-Tuning of VLAs from Sparse Episode
Outcomes", arXiv:2606.17043 (the method: Hierarchical Advantage-Weighted Behavior Cloning, HABC). Its setting is
online RL fine-tuning of a pretrained vision-language-action policy on real bimanual tasks, with a human who takes
over when the robot is about to fail.
Parent: none (its own design). It imports algos/_offline_data.py's MLP, run set-up and optimiser step.

The idea. Every episode ends in one binary outcome, yet the actor needs a per-transition signal. A single success
critic conflates two objectives and, once the task succeeds, gives no signal to tell a fast completion from a slow
one. HABC trains two critic heads on different subsets of the data: a *viability* head (the probability that the
policy finishes the task on its own from s, on every transition the policy executed) and an *efficiency* head (the
steps still needed to reach the goal, on the transitions of the policy's successful segments only). A gate g(s)
that grows with the viability of the state merges their one-step advantages: viability first while success is
uncertain, efficiency once the state is safe; the merged advantage becomes a per-transition weight on the
behaviour-cloning loss of the actor. Outcome labels are *intervention-aware*: a rollout alternates segments that
the policy executed and segments that the expert (the human) executed; only the policy's segments get outcome
labels, a policy segment that ends in a takeover is a failure, and only the last segment of a successful episode
(the one that reached the goal) is a success. Expert segments get no label but are still cloned, with weights
from the critics.

The world. A 12 x 12 grid with pits (`MAP`): 4 moves, a step into a pit fails the episode, reaching G succeeds,
the episode times out after `--horizon` steps (a failure too; the shortest paths from the four start cells take
20-22 steps). The policy (a categorical MLP on the one-hot cell and its coordinates) starts as supervised
fine-tuning (SFT) on `--n-demos` demonstrations of a noisy expert (a random safe move with probability
`--demo-eps`, so the demos wander). Each round collects `--episodes-per-round` rollouts of the policy with
simulated interventions: the scripted expert (shortest safe path, from a BFS over the free cells) takes over for
`--intervene-steps` steps when the policy's sampled action would step into a pit (caught with probability
`--catch-prob`; otherwise the policy falls) or when it has wandered (no new closest distance to the goal in
`--patience` of its own steps). Then the critics and the actor are trained on everything collected so far.
Evaluation: the policy alone (sampled actions, no interventions) on `--eval-episodes` episodes from the same
starts, with the same random draws after every round: the success rate and the steps to the goal of the
successful episodes.

Equations (function that implements each):
- outcome labels on policy segments only (segment k of an episode ends at step e_k; success_k = the episode
  reached the goal and k is its last segment): y_t = gamma^(e_k - t) success_k, c_t = e_k - t + 1 (when
  success_k), masks m_v on every policy step, m_e on the steps of successful policy segments   -> outcome_labels
  (`--credit episode`, the naive control: every step, expert's included, takes the episode's outcome)
- viability head: L_v = sum m_v BCE(V(s_t), y_t) / sum m_v; efficiency head: L_e = sum m_e (C(s_t) - c_t)^2 /
  (H^2 sum m_e), with C in steps and H the horizon                                                 -> critic_loss
- one-step advantages: A_v = gamma V(s') - V(s) (V(s') = 1 at the goal, 0 in a pit),
                       A_e = C(s) - 1 - C(s')     (C(s') = 0 at the goal, H in a pit)          -> one_step_advantages
- gate: g(s) = clip((V(s) - v_lo) / (v_hi - v_lo), 0, 1)                                                -> gate
- merge: A = (1 - g) A_v / sigma_v + g A_e / sigma_e, sigma = the std of each advantage over the training set
  (`--method awbc`: g = 0, the viability advantage alone)                                    -> merged_advantage
- weights: w = min(exp(beta A), w_max)                                                          -> awbc_weights
- actor: L_pi = mean_t w_t CE(pi(. | s_t), a_t) over all collected transitions (demos, policy and expert steps;
  `--method bc`: w = 1 on the demos and the expert's intervention steps only, HG-DAgger-style)      -> actor_loss

Deviations:
- The abstract gives no formulas; the gate's form (a linear ramp on the viability), the per-advantage std
  normalisation, exp-weights clipped at w_max, a pit costing H steps to the efficiency head and a takeover counting
  as a failure of the policy segment before it are this file's choices.
- A grid world with a scripted expert stands in for real bimanual tasks, a VLA policy and a human operator; state
  value heads (V(s), C(s)) on a shared trunk, refit each round, stand in for the paper's critics.
- The viability target is the undiscounted success (gamma = 1); `--gamma` < 1 makes the single-critic control
  (`--method awbc --gamma 0.95`) a discounted-return critic, which carries some of the efficiency signal itself.

Commands:
    python algos/habc.py                         # HABC, 12 rounds, ~15 s on 1 CPU thread
    python algos/habc.py --method awbc           # single-advantage AWBC: the viability (success) critic alone
    python algos/habc.py --method awbc --gamma 0.95   # single critic on a discounted success return
    python algos/habc.py --method bc             # plain BC on the demos and the intervention data
    python algos/habc.py --credit episode        # episode outcomes leak across intervention boundaries
    python benchmarks/habc_table.py

Expected (seed 0, one thread, ~15 s): the policy alone succeeds in 28.5% of the evaluation episodes after SFT and
in 100% after 12 rounds; its steps to the goal fall from 33.4 to 22.9 (shortest paths 20-22); the gate's mean
rises from 0 to 0.8 and the expert's takeovers per episode fall from 0.88 to 0. Over 5 seeds
(benchmarks/results/habc.md): HABC 33.0 -> 100.0% success and 22.7 steps, AWBC on the success critic 99.0% and
26.6 steps, BC on the demos and interventions 96.4% and 28.5 steps; a single discounted-return critic matches HABC
(22.7 steps) and episode credit makes no measurable difference at this scale.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
import tyro

from algos import _offline_data as D

METHODS = ("habc", "awbc", "bc")
CREDITS = ("segment", "episode")
# the world: '.' free, 'X' pit (stepping in fails the episode), 'S' start cell, 'G' goal
MAP = (
    ".XXX.......G",
    ".X.X....XX..",
    "........X...",
    "..........X.",
    "X..X.X.X..XX",
    ".XX...X..X..",
    "............",
    "....X...X...",
    "X....X..X...",
    "S..X.X...X.X",
    "S...XX.XX...",
    "SS.........X",
)
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]])  # up, down, left, right (row, column)
NONE, SUCCESS, FAILURE = 0, 1, 2  # what s' is: an ordinary cell, the goal, a pit


# ---- args ----
@dataclass
class Args:
    exp_name: str = "habc"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for torch, numpy, the demonstrations, the rollouts and the evaluation episodes"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = ""
    """output folder (default runs/<exp_name>-<method>-<credit>-s<seed>)"""
    threads: int = 1
    """torch threads (1 is fastest on a shared 2-core machine)"""
    method: str = "habc"
    """'habc' (gated viability + efficiency advantages), 'awbc' (viability advantage alone) or 'bc' (uniform
    weights on the demos and the intervention data)"""
    credit: str = "segment"
    """'segment': outcome labels on the policy's own segments only; 'episode': the episode's outcome on every step"""
    rounds: int = 12
    """rounds of (collect rollouts with interventions, fit the critics, fit the actor)"""
    episodes_per_round: int = 32
    """rollouts collected per round"""
    horizon: int = 40
    """steps before an episode times out (a failure); the shortest paths take 20-22"""
    n_demos: int = 8
    """demonstrations of the noisy expert for the SFT policy"""
    demo_eps: float = 0.5
    """probability that the demonstrator takes a random safe move instead of the shortest-path one"""
    sft_steps: int = 400
    """gradient steps of behaviour cloning on the demos (the SFT policy, round 0)"""
    intervene_steps: int = 3
    """steps the expert drives once it takes over"""
    patience: int = 8
    """policy steps without a new closest distance to the goal before the expert takes over (wandering)"""
    catch_prob: float = 0.5
    """probability that the expert takes over when the policy's action would step into a pit"""
    slip: float = 0.0
    """probability that the executed move is a uniformly random one"""
    gamma: float = 1.0
    """discount of the viability label (1: the probability of success)"""
    v_lo: float = 0.5
    """the gate is 0 (viability only) at or below this viability"""
    v_hi: float = 0.9
    """the gate is 1 (efficiency only) at or above this viability"""
    beta: float = 1.0
    """inverse temperature of the weights exp(beta A)"""
    max_weight: float = 20.0
    """clip of the weights"""
    critic_steps: int = 300
    """critic gradient steps per round"""
    actor_steps: int = 300
    """actor gradient steps per round"""
    hidden: int = 64
    """hidden width of the MLPs (two hidden layers)"""
    lr: float = 1e-3
    """Adam learning rate (actor and critic)"""
    batch_size: int = 256
    """minibatch size"""
    eval_episodes: int = 200
    """evaluation episodes of the policy alone, after SFT and after every round"""


def check_args(args: Args) -> None:
    if args.method not in METHODS:
        raise SystemExit(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    if args.credit not in CREDITS:
        raise SystemExit(f"--credit must be one of {', '.join(CREDITS)}, got {args.credit!r}")
    for k in ("rounds", "episodes_per_round", "horizon", "n_demos", "sft_steps", "intervene_steps", "patience",
              "critic_steps", "actor_steps", "hidden", "batch_size", "eval_episodes", "threads"):
        if getattr(args, k) <= 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    for k in ("demo_eps", "catch_prob", "slip"):
        if not 0 <= getattr(args, k) <= 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be in [0, 1], got {getattr(args, k)}")
    if not 0 < args.gamma <= 1:
        raise SystemExit(f"--gamma must be in (0, 1], got {args.gamma}")
    if not 0 <= args.v_lo < args.v_hi <= 1:
        raise SystemExit(f"--v-lo and --v-hi must satisfy 0 <= v_lo < v_hi <= 1, got {args.v_lo}, {args.v_hi}")
    if args.beta < 0 or args.max_weight <= 0 or args.lr <= 0:
        raise SystemExit(f"--beta must be >= 0, --max-weight and --lr > 0; got {args.beta}, {args.max_weight}, "
                         f"{args.lr}")


# ---- the grid world and the scripted expert ----
class Grid:
    """MAP parsed: pits, goal, start cells, the BFS distance to the goal over free cells (the expert's guide)."""

    def __init__(self, rows=MAP):
        g = np.array([list(r) for r in rows])
        self.h, self.w = g.shape
        self.pit = g == "X"
        self.goal = np.argwhere(g == "G")[0]
        self.starts = np.argwhere(g == "S")
        self.dist = self._bfs()
        self.obs_dim = self.h * self.w + 2

    def _bfs(self) -> np.ndarray:
        dist = np.full((self.h, self.w), -1)
        dist[tuple(self.goal)] = 0
        queue = deque([tuple(self.goal)])
        while queue:
            r, c = queue.popleft()
            for dr, dc in MOVES:
                rr, cc = r + dr, c + dc
                if 0 <= rr < self.h and 0 <= cc < self.w and not self.pit[rr, cc] and dist[rr, cc] < 0:
                    dist[rr, cc] = dist[r, c] + 1
                    queue.append((rr, cc))
        return dist

    def move(self, pos: np.ndarray, act: np.ndarray) -> np.ndarray:
        """pos (n, 2), act (n,) -> the cells after the moves (a move off the grid stays put)."""
        return np.clip(pos + MOVES[act], 0, [self.h - 1, self.w - 1])

    def kind(self, pos: np.ndarray) -> np.ndarray:
        """NONE, SUCCESS (the goal) or FAILURE (a pit) of each cell of pos (n, 2)."""
        at_goal = (pos == self.goal).all(1)
        return np.where(at_goal, SUCCESS, np.where(self.pit[pos[:, 0], pos[:, 1]], FAILURE, NONE))

    def expert(self, pos: np.ndarray) -> np.ndarray:
        """The expert's move from each cell: the first move (up, down, left, right) to the neighbour closest to the
        goal; pits and moves off the grid count as unreachable."""
        nxt = np.clip(pos[:, None, :] + MOVES[None], 0, [self.h - 1, self.w - 1])  # (n, 4, 2)
        d = self.dist[nxt[..., 0], nxt[..., 1]].astype(float)
        d[(d < 0) | (nxt == pos[:, None, :]).all(-1)] = np.inf
        return d.argmin(1)

    def safe_random(self, pos: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A uniformly random move that neither enters a pit nor leaves the grid."""
        nxt = np.clip(pos[:, None, :] + MOVES[None], 0, [self.h - 1, self.w - 1])
        ok = ~self.pit[nxt[..., 0], nxt[..., 1]] & ~(nxt == pos[:, None, :]).all(-1)
        score = rng.random(ok.shape) + ok  # an allowed move always outranks a forbidden one
        return score.argmax(1)

    def features(self, pos: np.ndarray) -> torch.Tensor:
        """One-hot of the cell and the (row, column) scaled to [0, 1]: (n, h w + 2)."""
        x = np.zeros((len(pos), self.obs_dim), np.float32)
        x[np.arange(len(pos)), pos[:, 0] * self.w + pos[:, 1]] = 1
        x[:, -2:] = pos / [self.h - 1, self.w - 1]
        return torch.as_tensor(x)


# ---- rollouts with simulated interventions ----
def rollout(grid: Grid, act_fn, n: int, args: Args, rng: np.random.Generator, intervene: bool) -> dict:
    """n episodes in parallel. act_fn(pos (m, 2)) -> actions (m,). With `intervene`, the expert drives for
    args.intervene_steps steps when the policy's action would enter a pit (probability args.catch_prob) or after
    args.patience policy steps without a new closest distance to the goal. Returns the transitions sorted by
    (episode, t): ep, t, s (cells), a (the executed command), s2, kind (of s2), expert (who chose a); and per
    episode: outcome (SUCCESS, FAILURE or NONE for a timeout), steps, start distance, takeovers."""
    pos = grid.starts[rng.integers(len(grid.starts), size=n)].copy()
    start_dist = grid.dist[pos[:, 0], pos[:, 1]].copy()
    alive, outcome, steps = np.ones(n, bool), np.zeros(n, int), np.zeros(n, int)
    takeover, stall, takeovers = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
    best = start_dist.copy()
    rows = []
    for t in range(args.horizon):
        idx = np.flatnonzero(alive)
        if len(idx) == 0:
            break
        p = pos[idx]
        a = act_fn(p)
        if intervene:
            into_pit = grid.kind(grid.move(p, a)) == FAILURE
            trigger = (takeover[idx] == 0) & ((into_pit & (rng.random(len(idx)) < args.catch_prob))
                                              | (stall[idx] >= args.patience))
            takeover[idx[trigger]] = args.intervene_steps
            takeovers[idx[trigger]] += 1
        by_expert = takeover[idx] > 0
        a = np.where(by_expert, grid.expert(p), a)
        takeover[idx[by_expert]] -= 1
        executed = np.where(rng.random(len(idx)) < args.slip, rng.integers(4, size=len(idx)), a)
        p2 = grid.move(p, executed)
        kind = grid.kind(p2)
        rows.append((idx, np.full(len(idx), t), p, a, p2, kind, by_expert))
        d2 = grid.dist[p2[:, 0], p2[:, 1]]
        better = (d2 >= 0) & (d2 < best[idx])
        best[idx] = np.where(better, d2, best[idx])
        stall[idx] = np.where(by_expert | better, 0, stall[idx] + 1)
        pos[idx], steps[idx] = p2, t + 1
        done = kind != NONE
        outcome[idx[done]] = kind[done]
        alive[idx[done]] = False
    cols = [np.concatenate(c) for c in zip(*rows)]
    order = np.lexsort((cols[1], cols[0]))  # by episode, then t
    keys = ("ep", "t", "s", "a", "s2", "kind", "expert")
    return {**{k: c[order] for k, c in zip(keys, cols)}, "outcome": outcome, "steps": steps,
            "start_dist": start_dist, "takeovers": takeovers}


def demonstrations(grid: Grid, n: int, args: Args, rng: np.random.Generator) -> dict:
    """n episodes of the noisy expert (a random safe move with probability args.demo_eps), all steps by the expert."""
    def act(p):
        return np.where(rng.random(len(p)) < args.demo_eps, grid.safe_random(p, rng), grid.expert(p))

    out = rollout(grid, act, n, args, rng, intervene=False)
    out["expert"] = np.ones_like(out["expert"])
    return out


# ---- the idea: intervention-aware outcome labels, two critic heads, gated one-step advantages ----
def outcome_labels(ep, expert, kind, gamma: float = 1.0, credit: str = "segment"):
    """Outcome labels of transitions sorted by (episode, t). A segment is a maximal run of steps by one actor
    (`expert` True: the human / scripted expert); with credit 'segment' only the policy's segments are labelled,
    with 'episode' the whole episode is one segment. A labelled segment succeeds when the episode reached the goal
    (kind SUCCESS on its last step) and the segment is the episode's last. Returns y_v (gamma^(steps left - 1) on a
    successful segment, else 0), m_v (labelled), c (steps left to the goal, successful segments), m_e."""
    ep, expert, kind = np.asarray(ep), np.asarray(expert, bool), np.asarray(kind)
    n = len(ep)
    y, c = np.zeros(n, np.float32), np.zeros(n, np.float32)
    m_v, m_e = np.zeros(n, bool), np.zeros(n, bool)
    start = 0
    while start < n:
        end = start
        while end + 1 < n and ep[end + 1] == ep[start]:
            end += 1
        success = kind[end] == SUCCESS
        if credit == "episode":
            segments = [(start, end)]
        else:
            cuts = [start] + [i for i in range(start + 1, end + 1) if expert[i] != expert[i - 1]] + [end + 1]
            segments = [(a, b - 1) for a, b in zip(cuts[:-1], cuts[1:]) if not expert[a]]
        for a, b in segments:
            ok = success and b == end
            left = b - np.arange(a, b + 1)  # steps after this one in the segment
            m_v[a:b + 1] = True
            y[a:b + 1] = gamma ** left if ok else 0.0
            if ok:
                c[a:b + 1], m_e[a:b + 1] = left + 1, True
        start = end + 1
    return y, m_v, c, m_e


def critic_loss(critic, s, y, m_v, c, m_e, horizon: int):
    """Viability head (column 0, a logit): BCE onto y on the m_v rows; efficiency head (column 1, steps / H): MSE
    onto c / H on the m_e rows; each a mean over its own rows. Returns (L_v + L_e, L_v, L_e)."""
    out = critic(s)
    bce = F.binary_cross_entropy_with_logits(out[:, 0], y, reduction="none")
    l_v = (bce * m_v).sum() / m_v.sum().clamp_min(1)
    l_e = (((out[:, 1] - c / horizon) ** 2) * m_e).sum() / m_e.sum().clamp_min(1)
    return l_v + l_e, l_v, l_e


@torch.no_grad()
def critic_values(critic, s, horizon: int):
    """V(s) (probability) and C(s) (steps) of states s."""
    out = critic(s)
    return torch.sigmoid(out[:, 0]), out[:, 1] * horizon


def one_step_advantages(v, v2, c, c2, kind2, gamma: float, horizon: int):
    """A_v = gamma V(s') - V(s) and A_e = C(s) - 1 - C(s'), with V(s') = 1, C(s') = 0 at the goal (no discount on
    the last step: the label of the step that reaches the goal is 1) and V(s') = 0, C(s') = H in a pit."""
    kind2 = torch.as_tensor(kind2)
    v_next = torch.where(kind2 == SUCCESS, 1.0, torch.where(kind2 == FAILURE, 0.0, gamma * v2))
    c_next = torch.where(kind2 == SUCCESS, 0.0, torch.where(kind2 == FAILURE, float(horizon), c2))
    return v_next - v, c - 1 - c_next


def gate(v, v_lo: float, v_hi: float):
    """g(s) = clip((V(s) - v_lo) / (v_hi - v_lo), 0, 1): 0 (viability) where success is uncertain, 1 (efficiency)
    once the state is viable."""
    return ((v - v_lo) / (v_hi - v_lo)).clamp(0, 1)


def merged_advantage(a_v, a_e, g, sigma_v: float, sigma_e: float):
    """A = (1 - g) A_v / sigma_v + g A_e / sigma_e."""
    return (1 - g) * a_v / sigma_v + g * a_e / sigma_e


def awbc_weights(adv, beta: float, max_weight: float):
    """w = min(exp(beta A), max_weight)."""
    return torch.exp(beta * adv).clamp(max=max_weight)


def actor_loss(actor, s, a, w):
    """mean_t w_t CE(pi(. | s_t), a_t): advantage-weighted behaviour cloning of discrete actions."""
    return (w * F.cross_entropy(actor(s), a, reduction="none")).mean()


def transition_weights(critic, data: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """The actor's per-transition weights for args.method (uniform, viability alone or gated) and diagnostics."""
    if args.method == "bc":
        return torch.ones(len(data["a"])), {}
    v, c = critic_values(critic, data["x"], args.horizon)
    v2, c2 = critic_values(critic, data["x2"], args.horizon)
    a_v, a_e = one_step_advantages(v, v2, c, c2, data["kind"], args.gamma, args.horizon)
    g = gate(v, args.v_lo, args.v_hi) if args.method == "habc" else torch.zeros_like(v)
    sigma_v, sigma_e = a_v.std().item() + 1e-6, a_e.std().item() + 1e-6
    w = awbc_weights(merged_advantage(a_v, a_e, g, sigma_v, sigma_e), args.beta, args.max_weight)
    expert = data["expert"]
    diag = {"train/gate_mean": g.mean().item(), "train/sigma_v": sigma_v, "train/sigma_e": sigma_e,
            "train/w_mean": w.mean().item(), "train/w_expert": w[expert].mean().item() if expert.any() else 0.0,
            "train/w_policy": w[~expert].mean().item() if (~expert).any() else 0.0,
            "train/ess_frac": (w.sum() ** 2 / (w ** 2).sum() / len(w)).item()}
    return w, diag


# ---- training ----
def to_tensors(grid: Grid, parts: list[dict], args: Args) -> dict:
    """The transitions of all parts (demos and rounds) as tensors, with their outcome labels (computed per part:
    each part's episode ids are its own)."""
    cat = lambda k: np.concatenate([p[k] for p in parts])  # noqa: E731
    labels = [outcome_labels(p["ep"], p["expert"], p["kind"], args.gamma, args.credit) for p in parts]
    y, m_v, c, m_e = (np.concatenate(z) for z in zip(*labels))
    demo = np.concatenate([np.full(len(p["ep"]), p.get("demo", False)) for p in parts])
    return {"x": grid.features(cat("s")), "x2": grid.features(cat("s2")), "a": torch.as_tensor(cat("a")),
            "kind": torch.as_tensor(cat("kind")), "expert": torch.as_tensor(cat("expert")),
            "demo": torch.as_tensor(demo), "y": torch.as_tensor(y), "m_v": torch.as_tensor(m_v).float(),
            "c": torch.as_tensor(c), "m_e": torch.as_tensor(m_e).float()}


def fit_critic(critic, opt, data: dict, args: Args) -> dict:
    n = len(data["a"])
    for _ in range(args.critic_steps):
        i = torch.randint(0, n, (args.batch_size,))
        loss, l_v, l_e = critic_loss(critic, data["x"][i], data["y"][i], data["m_v"][i], data["c"][i],
                                     data["m_e"][i], args.horizon)
        D.update(opt, loss)
    return {"loss/viability": l_v.item(), "loss/efficiency": l_e.item()}


def fit_actor(actor, opt, x, a, w, steps: int, batch_size: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        i = torch.randint(0, len(a), (batch_size,))
        loss = actor_loss(actor, x[i], a[i], w[i])
        D.update(opt, loss)
    return loss.item()


def policy_act(grid: Grid, actor, rng: np.random.Generator):
    """Sampled actions of the actor, drawn with numpy's rng (repeatable episodes for a given seed)."""
    @torch.no_grad()
    def act(pos):
        p = torch.softmax(actor(grid.features(pos)), -1).numpy().astype(float)
        u = rng.random((len(pos), 1))
        return np.minimum((p.cumsum(1) < u).sum(1), 3)
    return act


def evaluate(grid: Grid, actor, args: Args) -> dict:
    """The policy alone on args.eval_episodes episodes (same starts and draws each call): success rate, mean steps
    and steps beyond the shortest path of the successful episodes."""
    rng = np.random.default_rng(10_000 + args.seed)
    out = rollout(grid, policy_act(grid, actor, rng), args.eval_episodes, args, rng, intervene=False)
    ok = out["outcome"] == SUCCESS
    steps = out["steps"][ok]
    return {"eval/success": ok.mean(), "eval/steps": steps.mean() if ok.any() else float(args.horizon),
            "eval/excess_steps": (steps - out["start_dist"][ok]).mean() if ok.any() else float(args.horizon),
            "eval/pit": (out["outcome"] == FAILURE).mean()}


def collect_stats(out: dict) -> dict:
    return {"collect/success": (out["outcome"] == SUCCESS).mean(),
            "collect/autonomous_success": ((out["outcome"] == SUCCESS) & (out["takeovers"] == 0)).mean(),
            "collect/takeovers": out["takeovers"].mean(), "collect/expert_frac": out["expert"].mean()}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.method}-{args.credit}-s{args.seed}"
    tracker = D.start_run(args, out_dir)
    grid, rng = Grid(), np.random.default_rng(args.seed)
    actor, critic = D.mlp(grid.obs_dim, 4, args.hidden), D.mlp(grid.obs_dim, 2, args.hidden)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    t0 = time.perf_counter()

    demos = {**demonstrations(grid, args.n_demos, args, rng), "demo": True}
    data = to_tensors(grid, [demos], args)
    fit_actor(actor, opt_a, data["x"], data["a"], torch.ones(len(data["a"])), args.sft_steps, args.batch_size)
    hist = [{"round": 0, **evaluate(grid, actor, args)}]
    tracker.log(hist[0], 0)
    print(f"round  0 (SFT): success {hist[0]['eval/success']:.3f}, steps {hist[0]['eval/steps']:.1f}", flush=True)
    parts = [demos]
    for rnd in range(1, args.rounds + 1):
        out = rollout(grid, policy_act(grid, actor, rng), args.episodes_per_round, args, rng, intervene=True)
        parts.append(out)
        data = to_tensors(grid, parts, args)
        row = {"round": rnd, **collect_stats(out)}
        if args.method != "bc":
            row.update(fit_critic(critic, opt_c, data, args))
        w, diag = transition_weights(critic, data, args)
        keep = torch.ones_like(w, dtype=torch.bool) if args.method != "bc" else data["expert"] | data["demo"]
        row["loss/actor"] = fit_actor(actor, opt_a, data["x"][keep], data["a"][keep], w[keep], args.actor_steps,
                                      args.batch_size)
        row.update({**diag, **evaluate(grid, actor, args)})
        hist.append(row)
        tracker.log(row, rnd)
        print(f"round {rnd:2d}: success {row['eval/success']:.3f}, steps {row['eval/steps']:.1f}, takeovers per "
              f"episode {row['collect/takeovers']:.2f}", flush=True)
    save_curve(Path(out_dir) / "curve.png", hist, f"{args.method} ({args.credit} credit), seed {args.seed}")
    return tracker.finish(summarise(hist, t0))


def summarise(hist: list[dict], t0: float) -> dict:
    """First (SFT) and last evaluation, the means over the rounds (area under the curve, SFT excluded), the
    expert's takeovers per collected episode (first round, last round, mean), the last gate and the wall time."""
    last, rounds = hist[-1], hist[1:]
    out = {"success_first": hist[0]["eval/success"], "success_last": last["eval/success"],
           "steps_first": hist[0]["eval/steps"], "steps_last": last["eval/steps"],
           "excess_first": hist[0]["eval/excess_steps"], "excess_last": last["eval/excess_steps"],
           "pit_last": last["eval/pit"]}
    if rounds:
        out.update({"success_auc": float(np.mean([h["eval/success"] for h in rounds])),
                    "steps_auc": float(np.mean([h["eval/steps"] for h in rounds])),
                    "takeovers_first": rounds[0]["collect/takeovers"], "takeovers_last": last["collect/takeovers"],
                    "takeovers_mean": float(np.mean([h["collect/takeovers"] for h in rounds])),
                    "gate_mean_last": last.get("train/gate_mean", 0.0)})
    return {**out, "wall_s": time.perf_counter() - t0}


def save_curve(path, hist: list[dict], title: str) -> None:
    """Success rate and steps to goal (successful episodes) against the round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    r = [h["round"] for h in hist]
    axes[0].plot(r, [h["eval/success"] for h in hist], marker="o")
    axes[1].plot(r, [h["eval/steps"] for h in hist], marker="o")
    axes[0].set(xlabel="round", ylabel="success rate", title=title)
    axes[1].set(xlabel="round", ylabel="steps to goal (successes)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(Args))
