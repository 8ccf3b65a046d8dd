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

import torch
import torch.nn.functional as F
import tyro
from tqdm.auto import tqdm

from algos import _offline_data as D


# ---- args ----
@dataclass
class Args(D.OfflineArgs):  # run, data, optimisation and evaluation fields: OfflineArgs in algos/_offline_data.py
    exp_name: str = "iql"
    rho: float = 0.0
    """fraction of episodes replaced by bad behaviour (degraded data)"""
    expectile: float = 0.7
    """expectile tau of the value loss (0.5 = mean, -> 1 = max over dataset actions)"""
    beta: float = 3.0
    """inverse temperature of the advantage weights"""
    max_weight: float = 100.0
    """clip of the advantage weights exp(beta A)"""
    normalize_states: bool = True
    """normalise states with the dataset mean/std"""


def check_args(args: Args) -> None:
    D.check_offline_args(args)  # --dataset, --total-steps, --gamma, ...
    if not 0 < args.expectile < 1:
        raise SystemExit(f"--expectile must be in (0, 1), got {args.expectile}")
    if args.beta < 0:
        raise SystemExit(f"--beta must be >= 0, got {args.beta}")
    if not 0 <= args.rho <= 1:
        raise SystemExit(f"--rho must be in [0, 1], got {args.rho}")


# The networks (D.Actor: a = tanh(mlp(s)); D.Critic: twin Q; V = D.mlp) are algos/_offline_data.py's.


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


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.dataset}-s{args.seed}"
    tracker = D.start_run(args, out_dir)
    meta, t, mean, std = D.load_tensors(args.dataset, args.data_seed, args.rho, args.normalize_states)
    env_name, obs_dim, act_dim = meta["env"], t["observations"].shape[1], t["actions"].shape[1]
    actor, critic = D.Actor(obs_dim, act_dim, args.hidden), D.Critic(obs_dim, act_dim, args.hidden)
    vf = D.mlp(obs_dim, 1, args.hidden)
    critic_t = copy.deepcopy(critic)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    opt_v = torch.optim.Adam(vf.parameters(), lr=args.lr)
    policy = D.policy_fn(actor, mean, std)

    t0 = time.perf_counter()
    hist = [{"step": 0, **D.eval_policy(env_name, policy, args)}]
    bar = tqdm(range(1, args.total_steps + 1), desc=f"iql {args.dataset}", mininterval=1.0)
    for step in bar:
        s, a, r, s2, d = D.sample(t, args.batch_size)
        lv, adv = value_loss(vf, critic_t, s, a, args.expectile)
        D.update(opt_v, lv)
        la = awr_loss(actor, s, a, adv, args.beta, args.max_weight)
        D.update(opt_a, la)
        lc, q1 = q_loss(critic, vf, s, a, r, s2, d, args.gamma)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        D.update(opt_c, lc)
        D.soft_update(((critic, critic_t),), args.tau)
        if step % args.eval_every == 0 or step == args.total_steps:
            ev = D.eval_policy(env_name, policy, args)
            hist.append({"step": step, **ev})
            tracker.log({**ev, "loss/critic": lc.item(), "loss/actor": la.item(), "loss/value": lv.item(),
                         "loss/q_mean": q1.mean().item()}, step)
            bar.set_postfix(score=f"{ev['eval/score']:.1f}")
    D.save_curve(Path(out_dir) / "curve.png", hist, f"IQL tau={args.expectile} beta={args.beta} {args.dataset}")
    summary = D.summarise(hist, meta, t0, return_d4rl_last=D.d4rl_score(env_name, hist[-1]["eval/return"]))
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
