"""RAVL: model-based offline RL and the edge-of-reach problem (MBPO / MOPO / RAVL in one file).

Paper: Sims, Lu, Foerster & Teh, "The Edge-of-Reach Problem in Offline Model-Based Reinforcement
Learning", arXiv:2402.12527 (RAVL, Reach-Aware Value Learning; NeurIPS 2024). Code of the paper:
github.com/anyasims/edge-of-reach.
Parent: none

The idea. Offline model-based RL trains an agent on short k-step rollouts of a dynamics model started
from dataset states. The last state of each truncated rollout, s_k, appears only as a *target* (in
r + gamma Q(s_k, pi(s_k))) and never as a state whose Q is trained: an "edge-of-reach" state. Q there is
whatever the network extrapolates to, the actor climbs that error, and values blow up; with the *true*
dynamics an uncertainty penalty is exactly zero, so MOPO-style methods fail too. RAVL removes the
failure with value pessimism that detects edge-of-reach states directly: the minimum over a large
ensemble of Q functions (SAC-N / EDAC style), which is low wherever the ensemble was never trained.

Equations (function that implements each):
- model rollouts: s_0 ~ D, a_t = pi(s_t) + eps, (s_{t+1}, r_t) ~ T(s_t, a_t), t < k          -> model_rollout
- edge-of-reach states: next-states that never appear as a start state (and are not terminal) -> edge_of_reach_mask
- uncertainty penalty (MOPO): r~ = r - lambda u(s, a), u = ||std_e mu_e(s, a)|| over the
  dynamics ensemble (0 for the true model)                                                  -> uncertainty
- critic: y = r~ + gamma (1 - d) min_{j<N} Q'_j(s', pi'(s') + eps'); L = sum_j (Q_j(s, a) - y)^2 -> critic_loss
- actor: L_pi = -mean_B min_{j<N} Q_j(s, pi(s))                                              -> actor_loss
  pessimism none: N = 2 (MBPO's clipped double Q), penalty: N = 2 plus u, ravl: N = 10 (default).
- diagnostic: Q(s_edge, pi(s_edge)) - G^pi(s_edge), with G the Monte-Carlo discounted return of pi in
  the true dynamics                                                                          -> mc_returns

Deviations:
- TD3-style deterministic actor with Gaussian exploration noise in the rollouts, not SAC: one policy
  class across the project's offline scripts, and no entropy term to blur the Q diagnostic.
- RAVL's ensemble-diversity term (EDAC's eta) is off: the minimum over N = 10 critics is the pessimism.
- Learned model: an ensemble of deterministic MLPs predicting (delta obs, reward); uncertainty is the
  disagreement of their means (MOPO uses the max norm of learned Gaussian stds). Next states are drawn
  from a random member, as in MBPO.
- Pendulum (true dynamics in numpy, algos/_offline_data.py) instead of D4RL MuJoCo; small networks,
  a few thousand updates. To let Q converge in that budget: rewards scaled by 0.01 for learning,
  lr 1e-3 and a fast target update (tau 0.05); with tau 0.005 Q was still far from its Monte-Carlo
  value after 4k updates and the Q - MC diagnostic measured under-training, not edge-of-reach.

Commands:
    python algos/ravl.py                                        # true dynamics, RAVL pessimism
    python algos/ravl.py --pessimism none                       # true dynamics, MBPO-like
    python algos/ravl.py --model learned --pessimism penalty    # MOPO-like with a learned ensemble
    python benchmarks/offline_rl_table.py --only ravl           # the RAVL table of benchmarks/README.md

Expected (the paper): with the true dynamics, pessimism none/penalty shows Q(edge) far above the Monte-Carlo
return and collapses; RAVL keeps Q(edge) - MC small and scores well. Measured here (the RAVL table of
benchmarks/README.md, 3 seeds): with the true dynamics the collapse does not appear at this scale (Q - MC is
about the same on edge-of-reach and dataset states, and none/penalty score about 67); with the learned
ensemble, none/penalty collapse (score near 0, Q(edge) - MC about 64) and RAVL does not (about 53). A fresh run
of 10 seeds per arm did not repeat the gap: RAVL 16.6 ± 39.5 vs no pessimism 8.0 ± 29.1 (the claims table's RAVL
row; the scores scatter widely from seed to seed).
"""
from __future__ import annotations

import copy
import math
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
    exp_name: str = "ravl"
    out_dir: str = ""
    """output folder (default runs/<exp_name>-<model>-<pessimism>-s<seed>)"""
    dataset: str = "pendulum-expert"
    """dataset name (pendulum only: the true model is the pendulum's)"""
    tau: float = 0.05
    """target network soft-update rate (fast, so that Q converges within a few thousand updates)"""
    lr: float = 1e-3
    total_steps: int = 6000
    """agent gradient steps"""
    eval_every: int = 500
    data_episodes: int = 0
    """episodes in the dataset (0 = the generator's default, 100); fewer = narrower state coverage"""
    model: str = "true"
    """dynamics model: 'true' (exact pendulum dynamics) or 'learned' (MLP ensemble)"""
    pessimism: str = "ravl"
    """'none' (MBPO-like), 'penalty' (MOPO-like uncertainty penalty), 'ravl' (min over a Q ensemble)"""
    n_critics: int = 0
    """Q ensemble size; 0 = 2 for none/penalty, 10 for ravl"""
    penalty_coef: float = 1.0
    """lambda of the uncertainty penalty (pessimism 'penalty')"""
    rollout_len: int = 5
    """k: steps of each model rollout"""
    rollout_batch: int = 500
    """rollouts started from dataset states at each collection"""
    rollout_every: int = 250
    """collect new model rollouts every this many updates"""
    rollout_noise: float = 0.2
    """std of the exploration noise on actions in model rollouts"""
    buffer_rollouts: int = 8
    """model buffer keeps the transitions of the last this many collections"""
    real_ratio: float = 0.05
    """fraction of each minibatch drawn from the dataset (the rest from the model buffer)"""
    ensemble: int = 5
    """learned dynamics ensemble size"""
    model_steps: int = 3000
    """gradient steps to fit the learned dynamics ensemble"""
    reward_scale: float = 0.01
    """rewards are multiplied by this for learning (Q and Q - MC are reported in raw reward units)"""
    mc_states: int = 128
    """edge-of-reach states used for the Q - Monte-Carlo diagnostic"""
    mc_horizon: int = 300
    """Monte-Carlo rollout length (gamma^H truncation)"""


def check_args(args: Args) -> Args:
    if args.dataset not in D.DATASETS or not args.dataset.startswith("pendulum"):
        raise SystemExit(f"--dataset {args.dataset!r}: RAVL needs a pendulum dataset "
                         f"({', '.join(d for d in D.DATASETS if d.startswith('pendulum'))})")
    D.check_offline_args(args, positive=("policy_freq", "rollout_len", "rollout_batch", "rollout_every",
                                         "buffer_rollouts", "ensemble", "mc_states", "mc_horizon"))
    if args.model not in ("true", "learned"):
        raise SystemExit(f"--model must be 'true' or 'learned', got {args.model!r}")
    if args.pessimism not in ("none", "penalty", "ravl"):
        raise SystemExit(f"--pessimism must be 'none', 'penalty' or 'ravl', got {args.pessimism!r}")
    if args.reward_scale <= 0:
        raise SystemExit(f"--reward-scale must be positive, got {args.reward_scale}")
    if args.penalty_coef < 0:
        raise SystemExit(f"--penalty-coef must be >= 0 (a negative one rewards model uncertainty), "
                         f"got {args.penalty_coef}")
    if args.data_episodes < 0:
        raise SystemExit(f"--data-episodes must be >= 0, got {args.data_episodes}")
    if not 0 <= args.real_ratio <= 1:
        raise SystemExit(f"--real-ratio must be in [0, 1], got {args.real_ratio}")
    if args.n_critics < 0 or args.n_critics == 1:
        raise SystemExit(f"--n-critics must be 0 (auto) or >= 2, got {args.n_critics}")
    if args.n_critics == 0:
        args.n_critics = 10 if args.pessimism == "ravl" else 2
    return args


# ---- networks (the actor, D.Actor: a = tanh(mlp(s)), is algos/_offline_data.py's) ----
class EnsembleLinear(nn.Module):
    """N independent linear layers applied in one batched matmul: x (N, B, i) -> (N, B, o)."""

    def __init__(self, n, i, o):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, i, o))
        self.b = nn.Parameter(torch.zeros(n, 1, o))
        for k in range(n):
            nn.init.kaiming_uniform_(self.w.data[k].T, a=math.sqrt(5))
        bound = 1 / math.sqrt(i)
        nn.init.uniform_(self.b, -bound, bound)

    def forward(self, x):
        return torch.baddbmm(self.b, x, self.w)


class EnsembleMLP(nn.Module):
    def __init__(self, n, i, o, h):
        super().__init__()
        self.n = n
        self.net = nn.Sequential(EnsembleLinear(n, i, h), nn.ReLU(), EnsembleLinear(n, h, h), nn.ReLU(),
                                 EnsembleLinear(n, h, o))

    def forward(self, x):  # x (B, i) shared by all members, or (N, B, i)
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(self.n, -1, -1)
        return self.net(x)


class QEnsemble(nn.Module):
    def __init__(self, n, obs_dim, act_dim, h):
        super().__init__()
        self.net = EnsembleMLP(n, obs_dim + act_dim, 1, h)

    def forward(self, s, a):  # -> (N, B)
        return self.net(torch.cat([s, a], -1)).squeeze(-1)


# ---- dynamics models ----
class TrueModel:
    """The exact pendulum dynamics; its uncertainty is zero by construction."""

    def step(self, obs, act, rng):
        nxt, r = D.pendulum_model(obs, act)
        return nxt, r, np.zeros(len(obs), np.float32), np.zeros(len(obs), np.float32)


class LearnedModel:
    """Ensemble of MLPs predicting (next_obs - obs, reward) from (obs, act), inputs normalised."""

    def __init__(self, n, obs_dim, act_dim, h, lr):
        self.net = EnsembleMLP(n, obs_dim + act_dim, obs_dim + 1, h)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=lr)
        self.obs_dim = obs_dim

    def fit(self, data, steps, batch, desc="model"):
        x = np.concatenate([data["observations"], data["actions"]], 1)
        y = np.concatenate([data["next_observations"] - data["observations"], data["rewards"][:, None]], 1)
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        self.mx, self.sx, self.my, self.sy = x.mean(0), x.std(0) + 1e-3, y.mean(0), y.std(0) + 1e-3
        xn, yn = (x - self.mx) / self.sx, (y - self.my) / self.sy
        n, loss = len(x), torch.tensor(0.0)
        for _ in tqdm(range(steps), desc=desc, leave=False, mininterval=1.0):
            idx = torch.randint(0, n, (self.net.n, batch))  # each member its own bootstrap minibatch
            loss = F.mse_loss(self.net(xn[idx]), yn[idx])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return loss.item()

    @torch.no_grad()
    def step(self, obs, act, rng):
        x = (torch.as_tensor(np.concatenate([obs, act], 1)) - self.mx) / self.sx
        pred = (self.net(x) * self.sy + self.my).numpy()  # (E, B, obs_dim + 1)
        u = uncertainty(pred[..., :self.obs_dim])
        member = rng.integers(0, self.net.n, len(obs))
        p = pred[member, np.arange(len(obs))]
        nxt = obs + p[:, :self.obs_dim]
        nxt[:, 2] = np.clip(nxt[:, 2], -D.P_MAX_SPEED, D.P_MAX_SPEED)
        return nxt.astype(np.float32), p[:, -1].astype(np.float32), np.zeros(len(obs), np.float32), u


def uncertainty(means):
    """MOPO-style penalty u(s, a) = || std over the ensemble of the predicted means ||; means (E, B, d) -> (B,)."""
    return np.linalg.norm(means.std(0), axis=-1).astype(np.float32)


# ---- the idea: rollouts, edge-of-reach, losses ----
def model_rollout(model, policy, start_obs, k, noise, rng):
    """k-step rollouts from start_obs (B, d). Returns transitions (k*B rows, time-major) and the step index."""
    obs, out = start_obs, {key: [] for key in ("obs", "act", "rew", "next_obs", "term", "pen", "t")}
    alive = np.ones(len(obs), bool)
    for t in range(k):
        act = np.clip(policy(obs) + noise * rng.standard_normal((len(obs), policy.act_dim)), -1, 1)
        nxt, r, term, pen = model.step(obs, act.astype(np.float32), rng)
        for key, v in zip(out, (obs, act, r, nxt, term, pen, np.full(len(obs), t))):
            out[key].append(v[alive])
        alive = alive.copy()
        alive[alive] = ~term[alive].astype(bool)
        obs = nxt
    return {key: np.concatenate(v).astype(np.float32 if key != "t" else np.int64) for key, v in out.items()}


def edge_of_reach_mask(obs, next_obs, terminals):
    """Transitions whose next state never appears as a start state and is not terminal.

    obs, next_obs (n, d), terminals (n,) -> bool (n,). These next states are only ever bootstrapped from
    ("bootstrapping from the void"): nothing trains Q there.
    """
    starts = {row.tobytes() for row in np.ascontiguousarray(obs, np.float32)}
    nxt = np.ascontiguousarray(next_obs, np.float32)
    return np.array([row.tobytes() not in starts for row in nxt]) & ~np.asarray(terminals, bool)


def critic_loss(qf, qf_t, actor_t, s, a, r, s2, d, gamma, policy_noise, noise_clip):
    """TD loss of every ensemble member onto y = r + gamma (1 - d) min_j Q'_j(s', pi'(s') + eps)."""
    with torch.no_grad():
        eps = (torch.randn_like(a) * policy_noise).clamp(-noise_clip, noise_clip)
        y = r + gamma * (1 - d) * qf_t(s2, (actor_t(s2) + eps).clamp(-1, 1)).min(0).values
    q = qf(s, a)  # (N, B)
    return ((q - y) ** 2).mean(1).sum(), q


def actor_loss(actor, qf, s):
    """-mean over the batch of min_j Q_j(s, pi(s)) (the pessimistic value)."""
    return -qf(s, actor(s)).min(0).values.mean()


def mixed_batch(real, buf, n_real, batch_size):
    """n_real dataset transitions and batch_size - n_real from the model buffer, uniformly -> (s, a, r, s', d)."""
    mb = {k: torch.cat([b[k] for b in buf]) for k in buf[0]}
    ridx = torch.randint(0, len(real["rewards"]), (n_real,))
    midx = torch.randint(0, len(mb["obs"]), (batch_size - n_real,))
    return tuple(torch.cat([real[k][ridx], mb[m][midx]]) for k, m in (
        ("observations", "obs"), ("actions", "act"), ("rewards", "rew"), ("next_observations", "next_obs"),
        ("terminals", "term")))


def mc_returns(policy, obs, gamma, horizon):
    """Discounted return of the deterministic policy from each obs in the true dynamics, truncated at horizon."""
    g, disc = np.zeros(len(obs)), 1.0
    for _ in range(horizon):
        obs, r = D.pendulum_model(obs, policy(obs))
        g += disc * r
        disc *= gamma
    return g


# ---- main ----
def main(args: Args) -> dict:
    args = check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.model}-{args.pessimism}-s{args.seed}"
    tracker = D.start_run(args, out_dir)
    rng = np.random.default_rng(args.seed)
    data = D.get_dataset(args.dataset, seed=args.data_seed, n_episodes=args.data_episodes or None)
    D.check_dataset(data)
    meta, n = data["meta"], len(data["rewards"])
    obs_dim, act_dim = data["observations"].shape[1], data["actions"].shape[1]
    real = {k: torch.as_tensor(data[k]) for k in D.KEYS}
    t0 = time.perf_counter()
    if args.model == "true":
        model = TrueModel()
    else:
        model = LearnedModel(args.ensemble, obs_dim, act_dim, 200, 1e-3)
        mloss = model.fit(data, args.model_steps, args.batch_size)
        tracker.log({"model/loss": mloss}, 0)

    actor, qf = D.Actor(obs_dim, act_dim, args.hidden), QEnsemble(args.n_critics, obs_dim, act_dim, args.hidden)
    actor_t, qf_t = copy.deepcopy(actor), copy.deepcopy(qf)
    opt_a = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_c = torch.optim.Adam(qf.parameters(), lr=args.lr)
    policy = D.policy_fn(actor)  # raw states: the dynamics models take them as they are
    policy.act_dim = act_dim

    buf, edge_states = [], None
    n_real = int(round(args.real_ratio * args.batch_size))

    def collect():
        nonlocal edge_states
        start = data["observations"][rng.integers(0, n, args.rollout_batch)]
        ro = model_rollout(model, policy, start, args.rollout_len, args.rollout_noise, rng)
        ro["rew"] = ro["rew"] - (args.penalty_coef * ro["pen"] if args.pessimism == "penalty" else 0.0)
        edge = edge_of_reach_mask(ro["obs"], ro["next_obs"], ro["term"])
        edge_states = ro["next_obs"][edge]
        buf.append({k: torch.as_tensor(ro[k]) for k in ("obs", "act", "rew", "next_obs", "term")})
        del buf[:-args.buffer_rollouts]
        return float(ro["pen"].mean()), float(edge.mean())

    @torch.no_grad()
    def diagnostics():
        out = D.eval_policy("pendulum", policy, args)
        se = edge_states[rng.choice(len(edge_states), min(args.mc_states, len(edge_states)), replace=False)]
        sd = data["observations"][rng.integers(0, n, args.mc_states)]
        for name, st in (("edge", se), ("data", sd)):
            q = qf(torch.as_tensor(st), actor(torch.as_tensor(st))).min(0).values.numpy() / args.reward_scale
            mc = mc_returns(policy, st, args.gamma, args.mc_horizon)
            out[f"q/{name}"], out[f"q/{name}_minus_mc"] = float(q.mean()), float((q - mc).mean())
        return out

    pen, edge_frac = collect()
    hist = [{"step": 0, **diagnostics()}]
    tracker.log(hist[-1], 0)
    lc = la = torch.tensor(0.0)
    bar = tqdm(range(1, args.total_steps + 1), desc=f"ravl {args.model}/{args.pessimism}", mininterval=1.0)
    for step in bar:
        if step % args.rollout_every == 0:
            pen, edge_frac = collect()
        s, a, r, s2, d = mixed_batch(real, buf, n_real, args.batch_size)
        lc, q = critic_loss(qf, qf_t, actor_t, s, a, r * args.reward_scale, s2, d, args.gamma, args.policy_noise,
                            args.noise_clip)
        if not torch.isfinite(lc):
            raise FloatingPointError(f"critic loss is {lc.item()} at step {step}")
        D.update(opt_c, lc)
        if step % args.policy_freq == 0:
            la = actor_loss(actor, qf, s)
            D.update(opt_a, la)
            D.soft_update(((actor, actor_t), (qf, qf_t)), args.tau)
        if step % args.eval_every == 0 or step == args.total_steps:
            hist.append({"step": step, **diagnostics()})
            tracker.log({**hist[-1], "loss/critic": lc.item(), "loss/actor": la.item(),
                         "rollout/penalty": pen, "rollout/edge_frac": edge_frac,
                         "q/batch_mean": q.mean().item()}, step)
            bar.set_postfix(score=f"{hist[-1]['eval/score']:.1f}", q_edge=f"{hist[-1]['q/edge']:.0f}")

    save_plot(Path(out_dir) / "curve.png", hist, f"{args.model} dynamics, pessimism {args.pessimism}")
    return tracker.finish(D.summarise(
        hist, meta, t0, q_edge_last=hist[-1]["q/edge"], q_edge_minus_mc_last=hist[-1]["q/edge_minus_mc"],
        q_edge_minus_mc_max=max(h["q/edge_minus_mc"] for h in hist[1:]),  # after training starts
        q_data_minus_mc_last=hist[-1]["q/data_minus_mc"], penalty_mean_last=pen, n_critics=args.n_critics))


def save_plot(path, hist, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = [h["step"] for h in hist]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3))
    ax[0].plot(st, [h["eval/score"] for h in hist], marker="o")
    ax[0].set_ylabel("normalised score")
    ax[1].plot(st, [h["q/edge_minus_mc"] for h in hist], marker="o", label="edge-of-reach states")
    ax[1].plot(st, [h["q/data_minus_mc"] for h in hist], marker="o", label="dataset states")
    ax[1].set_ylabel("Q - Monte-Carlo return")
    ax[1].set_yscale("symlog")
    ax[1].legend()
    for a in ax:
        a.set_xlabel("gradient step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(Args))
