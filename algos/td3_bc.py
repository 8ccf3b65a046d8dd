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

import torch
import torch.nn.functional as F
import tyro
from tqdm.auto import tqdm

from algos import _offline_data as D


# ---- args ----
@dataclass
class Args(D.TD3Args):  # run, data, optimisation, evaluation and TD3 fields: TD3Args in algos/_offline_data.py
    exp_name: str = "td3_bc"
    rho: float = 0.0
    """fraction of episodes replaced by bad behaviour (degraded data)"""
    alpha: float = 2.5
    """weight of the Q term; 0 gives pure behaviour cloning"""
    normalize_states: bool = True
    """normalise states with the dataset mean/std"""


def check_args(args: Args) -> None:
    D.check_offline_args(args, positive=("policy_freq",))  # --dataset, --total-steps, --gamma, ...
    if args.alpha < 0:
        raise SystemExit(f"--alpha must be >= 0, got {args.alpha}")
    if not 0 <= args.rho <= 1:
        raise SystemExit(f"--rho must be in [0, 1], got {args.rho}")


# The networks (D.Actor: a = tanh(mlp(s)); D.Critic: twin Q) are algos/_offline_data.py's.


# ---- losses ----
def critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, gamma, policy_noise, noise_clip):
    """Clipped double-Q TD loss with target policy smoothing (TD3+BC's eq. (1))."""
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


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.dataset}-s{args.seed}"
    tracker = D.start_run(args, out_dir)
    meta, t, mean, std = D.load_tensors(args.dataset, args.data_seed, args.rho, args.normalize_states)
    env_name, obs_dim, act_dim = meta["env"], t["observations"].shape[1], t["actions"].shape[1]
    actor, critic = D.Actor(obs_dim, act_dim, args.hidden), D.Critic(obs_dim, act_dim, args.hidden)
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    policy = D.policy_fn(actor, mean, std)

    t0 = time.perf_counter()
    hist = [{"step": 0, **D.eval_policy(env_name, policy, args)}]
    la = torch.tensor(0.0)
    bar = tqdm(range(1, args.total_steps + 1), desc=f"td3_bc {args.dataset}", mininterval=1.0)
    for step in bar:
        s, a, r, s2, d = D.sample(t, args.batch_size)
        lc, q1 = critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, args.gamma, args.policy_noise,
                             args.noise_clip)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        D.update(opt_c, lc)
        if step % args.policy_freq == 0:
            la = actor_loss(actor, critic, s, a, args.alpha)
            D.update(opt_a, la)
            D.soft_update(((actor, actor_t), (critic, critic_t)), args.tau)
        if step % args.eval_every == 0 or step == args.total_steps:
            ev = D.eval_policy(env_name, policy, args)
            hist.append({"step": step, **ev})
            tracker.log({**ev, "loss/critic": lc.item(), "loss/actor": la.item(), "loss/q_mean": q1.mean().item()},
                        step)
            bar.set_postfix(score=f"{ev['eval/score']:.1f}")
    D.save_curve(Path(out_dir) / "curve.png", hist, f"TD3+BC alpha={args.alpha} {args.dataset}")
    summary = D.summarise(hist, meta, t0, return_d4rl_last=D.d4rl_score(env_name, hist[-1]["eval/return"]))
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
