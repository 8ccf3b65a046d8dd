"""TD3+BC: a minimalist approach to offline RL (baseline).

Paper: Fujimoto & Gu, "A Minimalist Approach to Offline Reinforcement Learning", arXiv:2106.06860.
Parent: none
The model-free baseline that algos/ravl.py and algos/driftql.py are compared with.

Equations (function that implements each):
- (1) critic: y = r + gamma (1 - d) min_i Q'_i(s', clip(pi'(s') + clip(eps, -c, c), -1, 1)),
      eps ~ N(0, sigma^2); L_Q = sum_i (Q_i(s, a) - y)^2                                  -> critic_loss
- (2) actor: L_pi = -lambda Q_1(s, pi(s)) + (pi(s) - a)^2,  lambda = alpha / mean|Q_1(s, pi(s))|
      (lambda detached; alpha = 0 is pure behaviour cloning)                             -> actor_loss
- states normalised with the dataset's mean and std (as in the paper).

Deviations:
- Small networks (2 x 128) and 10k updates by default instead of 2 x 256 and 1M: the datasets here are
  small (20k transitions) and the default run must finish in about a minute on one CPU thread.
- Datasets are generated locally (algos/_offline_data.py), not D4RL; scores are normalised to this
  project's random and expert reference policies.

Commands:
    python algos/td3_bc.py                                   # pendulum-medium, ~1 min on 1 CPU thread
    python algos/td3_bc.py --dataset pendulum-expert --alpha 0   # pure BC
    python algos/td3_bc.py --dataset halfcheetah-medium --total-steps 10000 --hidden 256   # ~2 min (+2 min CEM once)
    python benchmarks/offline_rl_table.py                    # the table in benchmarks/README.md

Expected: on pendulum-medium (behaviour 62) and halfcheetah-medium (behaviour 43) the normalised score ends
at or above the behaviour policy's in the mean over seeds (the last evaluation swings by about 20 points between
seeds); see the offline RL table of benchmarks/README.md.
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
    exp_name: str = "td3_bc"
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
    alpha: float = 2.5
    """weight of the Q term; 0 gives pure behaviour cloning"""
    gamma: float = 0.99
    """discount"""
    tau: float = 0.005
    """target network soft-update rate"""
    policy_noise: float = 0.2
    """target policy smoothing noise std"""
    noise_clip: float = 0.5
    """target policy smoothing noise clip"""
    policy_freq: int = 2
    """actor update every policy_freq critic updates"""
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
    if args.alpha < 0:
        raise ValueError(f"--alpha must be >= 0, got {args.alpha}")
    if not 0 <= args.rho <= 1:
        raise ValueError(f"--rho must be in [0, 1], got {args.rho}")
    for k in ("total_steps", "eval_every", "eval_episodes", "batch_size", "hidden", "policy_freq", "threads"):
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
def critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, gamma, policy_noise, noise_clip):
    """Eq. (1): clipped double-Q TD loss with target policy smoothing."""
    with torch.no_grad():
        noise = (torch.randn_like(a) * policy_noise).clamp(-noise_clip, noise_clip)
        a2 = (actor_t(s2) + noise).clamp(-1, 1)
        y = r + gamma * (1 - d) * torch.min(*critic_t(s2, a2))
    q1, q2 = critic(s, a)
    return F.mse_loss(q1, y) + F.mse_loss(q2, y), q1


def actor_loss(actor, critic, s, a, alpha):
    """Eq. (2): -lambda Q1(s, pi(s)) + (pi(s) - a)^2 with lambda = alpha / mean|Q| (detached)."""
    pi = actor(s)
    q = critic(s, pi)[0]
    lmbda = alpha / q.abs().mean().detach().clamp_min(1e-6)
    return -lmbda * q.mean() + F.mse_loss(pi, a)


def bc_loss(actor, s, a):
    """Plain behaviour cloning, (pi(s) - a)^2: what eq. (2) reduces to at alpha = 0."""
    return F.mse_loss(actor(s), a)


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
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    policy = make_policy_fn(actor, mean, std, device)

    def eval_now():
        ret = D.evaluate(env_name, policy, args.eval_episodes, seed=10_000 + args.seed)[0].mean()
        return float(ret), D.normalized_score(env_name, float(ret))

    t0 = time.perf_counter()
    ret0, score0 = eval_now()
    steps, scores, rets = [0], [score0], [ret0]
    la = torch.tensor(0.0)
    bar = tqdm(range(1, args.total_steps + 1), desc=f"td3_bc {args.dataset}", mininterval=1.0)
    for step in bar:
        idx = torch.randint(0, n, (args.batch_size,))
        s, a, r, s2, d = (t[k][idx] for k in ("observations", "actions", "rewards", "next_observations",
                                             "terminals"))
        lc, q1 = critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, args.gamma, args.policy_noise,
                             args.noise_clip)
        opt_c.zero_grad()
        lc.backward()
        opt_c.step()
        if step % args.policy_freq == 0:
            la = actor_loss(actor, critic, s, a, args.alpha)
            opt_a.zero_grad()
            la.backward()
            opt_a.step()
            with torch.no_grad():
                for net, tgt in ((actor, actor_t), (critic, critic_t)):
                    for p, pt in zip(net.parameters(), tgt.parameters()):
                        pt.lerp_(p, args.tau)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        if step % args.eval_every == 0 or step == args.total_steps:
            ret, score = eval_now()
            steps.append(step), scores.append(score), rets.append(ret)
            tracker.log({"eval/return": ret, "eval/score": score, "loss/critic": lc.item(),
                         "loss/actor": la.item(), "loss/q_mean": q1.mean().item()}, step)
            bar.set_postfix(score=f"{score:.1f}")
    save_curve(Path(out_dir) / "curve.png", steps, scores, f"TD3+BC alpha={args.alpha} {args.dataset}")
    summary = {"score_first": score0, "score_last": scores[-1], "score_best": max(scores),
               "return_last": rets[-1], "return_d4rl_last": D.d4rl_score(env_name, rets[-1]),
               "behaviour_score": meta["behaviour_score"], "wall_s": time.perf_counter() - t0}
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
