"""DriftQL: a drift-based behavioural regulariser plus critic-driven improvement, one forward pass per action.

Paper: "Drift Q-Learning" (DriftQL), arXiv:2606.00350. Project page: driftql.github.io.

Parent: none (its own design). Borrows: algos/td3_bc.py (critic_loss), exact copies.

Built on TD3+BC (`--reg mse` here is TD3+BC with a noise input): `diff algos/td3_bc.py algos/driftql.py`
shows the idea, the generator actor, the drift field and its loss, and the toy's mode diagnostics.

The idea. The actor is a generator a = pi(s, z), z ~ N(0, I): one forward pass per action, no denoising
loop. Its behavioural regulariser is a *drift field* on generated actions: each generated action is
attracted toward dataset actions and repelled from the other generated actions of the same state.
Attraction alone (or an MSE BC term) pulls everything to the mean of the data, averaging two good modes
into a bad action; with repulsion the field vanishes exactly when the generated distribution equals the
data's, so several modes survive. The critic term then moves generated actions toward high-value regions
of that support.

Equations (function that implements each):
- kernel: k(x, y) = sum_h exp(-||x - y||^2 / (2 h^2)) / h^2 over bandwidths h            -> kernel
- drift:  V(x_i) = E_{y ~ D(.|s)}[k(x_i, y)(y - x_i)] - 1/(M-1) sum_{j != i} k(x_i, x_j)(x_j - x_i)
          (attraction to the dataset action(s) of s, repulsion between the M generated actions of s;
          V = grad of the kernel-density difference, zero when generated = data)                -> drift_field
- regulariser: L_drift = mean ||x - stopgrad(x + V(x))||^2  (its gradient moves x along V)      -> drift_loss
  `--reg mse`: L_bc = mean ||pi(s, z) - a||^2                                                    -> mse_bc_loss
- actor: L_pi = -lambda mean Q_1(s, pi(s, z)) + L_reg, lambda = alpha / mean|Q| (detached)       -> actor_loss
- critic: TD3's clipped double-Q with a' = pi'(s', z') + clipped noise                          -> critic_loss

Deviations:
- The paper's abstract gives no formula. The drift field here follows drifting generative models (attraction
  to data, repulsion between samples, stop-gradient target) with a multi-bandwidth Gaussian kernel, whose
  field is the gradient of the MMD witness; the paper's kernel, normalisation and weights may differ.
- One dataset action per state is the only positive (an unbiased one-sample estimate of the
  attraction); no nearest-neighbour positives.
- Tested on the project's 2-D multimodal toy and pendulum, not D4RL / OGBench.

Commands:
    python algos/driftql.py                                    # toy-multimodal, ~30 s on 1 CPU thread
    python algos/driftql.py --reg mse                          # the BC-regularised baseline
    python algos/driftql.py --rho 0.5                          # degraded: half the episodes bad
    python benchmarks/offline_rl_table.py --only driftql

Expected (benchmarks/results/offline_driftql.md): drift keeps both goals (left and right) among its
sampled actions and successes while MSE-BC averages; the score drops less from rho 0 to 0.5.
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

from algos import _offline_data as D


# ---- args ----
@dataclass
class Args(D.TD3Args):  # run, data, optimisation, evaluation and TD3 fields: TD3Args in algos/_offline_data.py
    exp_name: str = "driftql"
    out_dir: str = ""
    """output folder (default runs/<exp_name>-<reg>-<dataset>-rho<rho>-s<seed>)"""
    dataset: str = "toy-multimodal"
    total_steps: int = 4000
    eval_every: int = 500
    eval_episodes: int = 100
    rho: float = 0.0
    """fraction of episodes replaced by bad behaviour (degraded data)"""
    reg: str = "drift"
    """behavioural regulariser: 'drift' (attraction + repulsion) or 'mse' (TD3+BC-style)"""
    n_gen: int = 8
    """M: generated actions per state for the drift field"""
    bandwidths: tuple[float, ...] = (0.05, 0.2, 0.5)
    """Gaussian kernel bandwidths h of the drift field"""
    alpha: float = 2.5
    """weight of the Q term (lambda = alpha / mean|Q|); 0 = pure behaviour regularisation"""


def check_args(args: Args) -> None:
    D.check_offline_args(args, positive=("policy_freq",))  # --dataset, --total-steps, --gamma, ...
    if args.reg not in ("drift", "mse"):
        raise SystemExit(f"--reg must be 'drift' or 'mse', got {args.reg!r}")
    if args.n_gen < 2:
        raise SystemExit(f"--n-gen must be >= 2 (repulsion needs two generated actions), got {args.n_gen}")
    if not args.bandwidths or min(args.bandwidths) <= 0:
        raise SystemExit(f"--bandwidths must be positive numbers, got {args.bandwidths}")
    if args.alpha < 0:
        raise SystemExit(f"--alpha must be >= 0, got {args.alpha}")
    if not 0 <= args.rho <= 1:
        raise SystemExit(f"--rho must be in [0, 1], got {args.rho}")


# ---- networks (the critic, D.Critic, is algos/_offline_data.py's twin Q) ----
class Generator(nn.Module):
    """a = tanh(f(s, z)), z ~ N(0, I): a one-pass stochastic policy."""

    def __init__(self, obs_dim, act_dim, h):
        super().__init__()
        self.act_dim = act_dim
        self.net = D.mlp(obs_dim + act_dim, act_dim, h)

    def forward(self, s, z=None):
        if z is None:
            z = torch.randn(*s.shape[:-1], self.act_dim)
        return torch.tanh(self.net(torch.cat([s, z], -1)))


# ---- the idea: drift field and losses ----
def kernel(d2, bandwidths):
    """Multi-bandwidth Gaussian kernel on squared distances d2 (any shape): sum_h exp(-d2 / 2h^2) / h^2."""
    return sum(torch.exp(-d2 / (2 * h * h)) / (h * h) for h in bandwidths)


def drift_field(x, y, bandwidths):
    """V(x_i) = mean_p k(x_i, y_p)(y_p - x_i) - 1/(M-1) sum_{j != i} k(x_i, x_j)(x_j - x_i).

    x: generated actions (B, M, a); y: dataset actions of the same states (B, P, a). Returns (B, M, a).
    """
    m = x.shape[1]
    dy = y.unsqueeze(1) - x.unsqueeze(2)  # (B, M, P, a): y_p - x_i
    attract = (kernel((dy ** 2).sum(-1), bandwidths).unsqueeze(-1) * dy).mean(2)
    dx = x.unsqueeze(1) - x.unsqueeze(2)  # (B, M, M, a): x_j - x_i (the j = i term is exactly zero)
    repel = (kernel((dx ** 2).sum(-1), bandwidths).unsqueeze(-1) * dx).sum(2) / (m - 1)
    return attract - repel


def drift_loss(x, y, bandwidths):
    """mean ||x - stopgrad(x + V(x))||^2: its gradient w.r.t. x is -2 V(x) / numel, moving x along the drift."""
    with torch.no_grad():
        target = x + drift_field(x, y, bandwidths)
    return ((x - target) ** 2).sum(-1).mean()


def mse_bc_loss(x, y):
    """TD3+BC's regulariser on generated actions: mean ||pi(s, z) - a||^2; x (B, M, a), y (B, 1, a)."""
    return ((x - y) ** 2).sum(-1).mean()


def actor_loss(gen, critic, s, a, args):
    """-lambda Q1(s, pi(s, z)) + regulariser; lambda = alpha / mean|Q| (detached). Returns (loss, reg)."""
    b = s.shape[0]
    x = gen(s.unsqueeze(1).expand(b, args.n_gen, -1))  # (B, M, a): M actions per state, one pass
    y = a.unsqueeze(1)  # (B, 1, a)
    reg = drift_loss(x, y, args.bandwidths) if args.reg == "drift" else mse_bc_loss(x, y)
    q = critic(s, x[:, 0])[0]
    lmbda = args.alpha / q.abs().mean().detach().clamp_min(1e-6)
    return -lmbda * q.mean() + reg, reg


def critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, gamma, policy_noise, noise_clip):
    """Clipped double-Q TD loss with target policy smoothing (TD3+BC's eq. (1))."""
    with torch.no_grad():
        noise = (torch.randn_like(a) * policy_noise).clamp(-noise_clip, noise_clip)
        a2 = (actor_t(s2) + noise).clamp(-1, 1)
        y = r + gamma * (1 - d) * torch.min(*critic_t(s2, a2))
    q1, q2 = critic(s, a)
    return F.mse_loss(q1, y) + F.mse_loss(q2, y), q1


# ---- eval ----
@torch.no_grad()
def action_modes(gen, mean, std, n=512):
    """Toy only: at the start state, the fractions of sampled actions near the left, right and bad modes."""
    s = ((torch.zeros(n, 2) - mean) / std)
    x = gen(s).numpy()
    modes = np.array([[-0.566, 0.566], [0.566, 0.566], [0.0, -0.8]], np.float32)
    d = np.linalg.norm(x[:, None] - modes[None], axis=-1)
    near = d < 0.3
    return {"modes/left": near[:, 0].mean(), "modes/right": near[:, 1].mean(), "modes/bad": near[:, 2].mean(),
            "modes/none": (~near.any(1)).mean()}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.reg}-{args.dataset}-rho{args.rho}-s{args.seed}"
    tracker = D.start_run(args, out_dir)
    meta, t, mean, std = D.load_tensors(args.dataset, args.data_seed, args.rho)
    env_name, obs_dim, act_dim = meta["env"], t["observations"].shape[1], t["actions"].shape[1]
    actor, critic = Generator(obs_dim, act_dim, args.hidden), D.Critic(obs_dim, act_dim, args.hidden)
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=args.lr)
    policy = D.policy_fn(actor, mean, std)

    def eval_now():  # on the toy also the goals reached and the modes of the sampled actions
        out = D.eval_policy(env_name, policy, args, goals=env_name == "toy")
        return {**out, **action_modes(actor, mean, std)} if env_name == "toy" else out

    t0 = time.perf_counter()
    hist = [{"step": 0, **eval_now()}]
    la = reg = torch.tensor(0.0)
    bar = tqdm(range(1, args.total_steps + 1), desc=f"driftql {args.reg} {args.dataset}", mininterval=1.0)
    for step in bar:
        s, a, r, s2, d = D.sample(t, args.batch_size)
        lc, q1 = critic_loss(critic, critic_t, actor_t, s, a, r, s2, d, args.gamma, args.policy_noise,
                             args.noise_clip)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        D.update(opt_c, lc)
        if step % args.policy_freq == 0:
            la, reg = actor_loss(actor, critic, s, a, args)
            D.update(opt_a, la)
            D.soft_update(((actor, actor_t), (critic, critic_t)), args.tau)
        if step % args.eval_every == 0 or step == args.total_steps:
            ev = eval_now()
            hist.append({"step": step, **ev})
            tracker.log({**ev, "loss/critic": lc.item(), "loss/actor": la.item(), "loss/reg": reg.item(),
                         "loss/q_mean": q1.mean().item()}, step)
            bar.set_postfix(score=f"{ev['eval/score']:.1f}")
    D.save_curve(Path(out_dir) / "curve.png", hist, f"DriftQL reg={args.reg} rho={args.rho} {args.dataset}")
    last = {k.split("/")[1]: v for k, v in hist[-1].items() if k.startswith(("modes/", "eval/goal"))}
    return tracker.finish(D.summarise(hist, meta, t0, **last))


if __name__ == "__main__":
    main(tyro.cli(Args))
