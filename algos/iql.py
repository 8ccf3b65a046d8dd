"""IQL: offline RL with implicit Q-learning (baseline).

Paper: Kostrikov, Nair & Levine, "Offline Reinforcement Learning with Implicit Q-Learning", arXiv:2110.06169.
Parent: none
The second model-free baseline of the offline RL table (benchmarks/README.md).

Equations (function that implements each):
- (5) value: L_V = E[ L2^tau(min_i Q'_i(s, a) - V(s)) ],  L2^tau(u) = |tau - 1(u < 0)| u^2   -> expectile_loss, value_loss
- (6) critic: L_Q = E[ (r + gamma (1 - d) V(s') - Q_i(s, a))^2 ] for both Q heads              -> q_loss
- (7) policy extraction (advantage-weighted regression):
      L_pi = E[ min(exp(beta (Q'(s, a) - V(s))), 100) * ||pi(s) - a||^2 ]                     -> awr_loss
- states normalised with the dataset's mean and std.

Deviations:
- Deterministic actor with advantage-weighted MSE (CORL's deterministic IQL variant) instead of a Gaussian
  log-likelihood: the same fixed point for a unimodal policy and one less hyperparameter.
- Small networks (2 x 128), 10k updates, no learning-rate schedule: 20k-transition datasets, ~1 min on 1 CPU.
- Locally generated datasets (algos/_offline_data.py), not D4RL.

Commands:
    python algos/iql.py                                        # pendulum-medium, ~1 min on 1 CPU thread
    python algos/iql.py --dataset pendulum-medium-replay --expectile 0.9 --beta 10
    python algos/iql.py --dataset halfcheetah-medium --total-steps 10000 --hidden 256   # ~2 min (+2 min CEM once)
    python benchmarks/offline_rl_table.py

Expected: on pendulum-medium (behaviour 62) and halfcheetah-medium (behaviour 43) the normalised score ends
at or above the behaviour policy's; see the offline RL table of benchmarks/README.md.
"""
from __future__ import annotations

import copy
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
from tqdm.auto import tqdm

import common
from algos import _offline_data as D


# ---- args ----
@dataclass
class Args:
    exp_name: str = "iql"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for torch, numpy and the evaluation episodes"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = ""
    """output folder (default runs/<exp_name>-<dataset>-s<seed>)"""
    dataset: str = "pendulum-medium"
    """dataset name (see algos/_offline_data.py)"""
    data_seed: int = 0
    """seed of the dataset generator"""
    rho: float = 0.0
    """fraction of episodes replaced by bad behaviour (degraded data)"""
    expectile: float = 0.7
    """expectile tau of the value loss (0.5 = mean, -> 1 = max over dataset actions)"""
    beta: float = 3.0
    """inverse temperature of the advantage weights"""
    max_weight: float = 100.0
    """clip of the advantage weights exp(beta A)"""
    gamma: float = 0.99
    """discount"""
    tau: float = 0.005
    """target network soft-update rate"""
    hidden: int = 128
    """hidden width of the two-layer MLPs"""
    lr: float = 3e-4
    """Adam learning rate"""
    batch_size: int = 256
    """minibatch size"""
    total_steps: int = 10_000
    """gradient steps"""
    eval_every: int = 1000
    """evaluate every this many steps"""
    eval_episodes: int = 10
    """evaluation episodes (run in parallel)"""
    normalize_states: bool = True
    """normalise states with the dataset mean/std"""
    threads: int = 1
    """torch threads (1 is fastest on a shared 2-core machine)"""


def check_args(args: Args) -> None:
    if args.dataset not in D.DATASETS:
        raise ValueError(f"--dataset {args.dataset!r} unknown; choose one of {', '.join(D.DATASETS)}")
    if not 0 < args.expectile < 1:
        raise ValueError(f"--expectile must be in (0, 1), got {args.expectile}")
    if args.beta < 0:
        raise ValueError(f"--beta must be >= 0, got {args.beta}")
    if not 0 <= args.rho <= 1:
        raise ValueError(f"--rho must be in [0, 1], got {args.rho}")
    for k in ("total_steps", "eval_every", "eval_episodes", "batch_size", "hidden", "threads"):
        if getattr(args, k) <= 0:
            raise ValueError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if not 0 < args.gamma <= 1:
        raise ValueError(f"--gamma must be in (0, 1], got {args.gamma}")


# ---- networks ----
def mlp(i, o, h):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


class Actor(nn.Module):
    def __init__(self, obs_dim, act_dim, h):
        super().__init__()
        self.net = mlp(obs_dim, act_dim, h)

    def forward(self, s):
        return torch.tanh(self.net(s))


class Critic(nn.Module):
    """Twin Q networks; forward returns (Q1, Q2), each (B,)."""

    def __init__(self, obs_dim, act_dim, h):
        super().__init__()
        self.q1, self.q2 = mlp(obs_dim + act_dim, 1, h), mlp(obs_dim + act_dim, 1, h)

    def forward(self, s, a):
        x = torch.cat([s, a], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


# ---- losses ----
def expectile_loss(diff, expectile):
    """L2^tau(u) = |tau - 1(u < 0)| u^2, averaged; diff = Q(s, a) - V(s), shape (B,)."""
    weight = torch.where(diff < 0, 1 - expectile, expectile)
    return (weight * diff ** 2).mean()


def value_loss(vf, critic_t, s, a, expectile):
    """Eq. (5): expectile regression of V(s) onto min_i Q'_i(s, a)."""
    with torch.no_grad():
        q = torch.min(*critic_t(s, a))
    v = vf(s).squeeze(-1)
    return expectile_loss(q - v, expectile), (q - v).detach()


def q_loss(critic, vf, s, a, r, s2, d, gamma):
    """Eq. (6): TD regression of both Q heads onto r + gamma (1 - d) V(s')."""
    with torch.no_grad():
        y = r + gamma * (1 - d) * vf(s2).squeeze(-1)
    q1, q2 = critic(s, a)
    return F.mse_loss(q1, y) + F.mse_loss(q2, y), q1


def awr_loss(actor, s, a, adv, beta, max_weight):
    """Eq. (7): advantage-weighted regression, weights min(exp(beta A), max_weight) (detached)."""
    w = torch.exp(beta * adv).clamp(max=max_weight)
    return (w * ((actor(s) - a) ** 2).sum(-1)).mean()


# ---- data ----
def load_data(args, device):
    data = D.get_dataset(args.dataset, seed=args.data_seed, rho=args.rho)
    D.check_dataset(data)
    t = {k: torch.as_tensor(data[k], device=device) for k in D.KEYS}
    mean, std = t["observations"].mean(0), t["observations"].std(0) + 1e-3
    if not args.normalize_states:
        mean, std = torch.zeros_like(mean), torch.ones_like(std)
    t["observations"] = (t["observations"] - mean) / std
    t["next_observations"] = (t["next_observations"] - mean) / std
    return data["meta"], t, mean, std


def make_policy_fn(actor, mean, std, device):
    @torch.no_grad()
    def act(obs):
        s = (torch.as_tensor(obs, device=device) - mean) / std
        return actor(s).cpu().numpy()
    return act


def save_curve(path, steps, scores, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(steps, scores, marker="o")
    ax.set_xlabel("gradient step")
    ax.set_ylabel("normalised score")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device("cpu")
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.dataset}-s{args.seed}"
    tracker = common.Tracker(out_dir, args, track=args.track, run_name=Path(out_dir).name)
    meta, t, mean, std = load_data(args, device)
    env_name, n = meta["env"], len(t["rewards"])
    obs_dim, act_dim = t["observations"].shape[1], t["actions"].shape[1]
    actor, critic = Actor(obs_dim, act_dim, args.hidden), Critic(obs_dim, act_dim, args.hidden)
    vf = mlp(obs_dim, 1, args.hidden)
    critic_t = copy.deepcopy(critic)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    opt_v = torch.optim.Adam(vf.parameters(), lr=args.lr)
    policy = make_policy_fn(actor, mean, std, device)

    def eval_now():
        ret = D.evaluate(env_name, policy, args.eval_episodes, seed=10_000 + args.seed)[0].mean()
        return float(ret), D.normalized_score(env_name, float(ret))

    t0 = time.perf_counter()
    ret0, score0 = eval_now()
    steps, scores, rets = [0], [score0], [ret0]
    bar = tqdm(range(1, args.total_steps + 1), desc=f"iql {args.dataset}", mininterval=1.0)
    for step in bar:
        idx = torch.randint(0, n, (args.batch_size,))
        s, a, r, s2, d = (t[k][idx] for k in ("observations", "actions", "rewards", "next_observations",
                                             "terminals"))
        lv, adv = value_loss(vf, critic_t, s, a, args.expectile)
        opt_v.zero_grad()
        lv.backward()
        opt_v.step()
        la = awr_loss(actor, s, a, adv, args.beta, args.max_weight)
        opt_a.zero_grad()
        la.backward()
        opt_a.step()
        lc, q1 = q_loss(critic, vf, s, a, r, s2, d, args.gamma)
        opt_c.zero_grad()
        lc.backward()
        opt_c.step()
        with torch.no_grad():
            for p, pt in zip(critic.parameters(), critic_t.parameters()):
                pt.lerp_(p, args.tau)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        if step % args.eval_every == 0 or step == args.total_steps:
            ret, score = eval_now()
            steps.append(step), scores.append(score), rets.append(ret)
            tracker.log({"eval/return": ret, "eval/score": score, "loss/critic": lc.item(),
                         "loss/actor": la.item(), "loss/value": lv.item(), "loss/q_mean": q1.mean().item()}, step)
            bar.set_postfix(score=f"{score:.1f}")
    save_curve(Path(out_dir) / "curve.png", steps, scores, f"IQL tau={args.expectile} beta={args.beta} {args.dataset}")
    summary = {"score_first": score0, "score_last": scores[-1], "score_best": max(scores),
               "return_last": rets[-1], "return_d4rl_last": D.d4rl_score(env_name, rets[-1]),
               "behaviour_score": meta["behaviour_score"], "wall_s": time.perf_counter() - t0}
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
