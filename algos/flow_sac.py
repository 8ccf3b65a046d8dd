"""SAC Flow: flow-based policies trained end to end with SAC, with a gated (Flow-G) or decoded (Flow-T) velocity.

Paper: Zhang, Yu et al., "SAC Flow: Sample-Efficient Reinforcement Learning of Flow-Based Policies via
Velocity-Reparameterized Sequential Modeling", arXiv:2509.25756.
Parent: none (its own design; the critic, its update and the target-network update come from
algos/_offline_data.py, like the offline RL scripts').

The idea. A flow policy turns noise a_0 ~ N(0, I) into an action by K Euler steps of a velocity network,
a_{k+1} = a_k + (1/K) v(s, a_k, t_k). Read with a_k as the hidden state and (s, t_k) as the input, this is a
residual RNN, so the gradient of the action with respect to a_0 and to the velocity's parameters is a product
of K Jacobians I + (1/K) dv/da and explodes or vanishes as an RNN's does once v is steep. The paper keeps the
rollout and changes the velocity's parameterisation the way sequence models did: Flow-G gates the velocity
(a GRU's update gate: the step moves a_k toward a candidate by a learned fraction), Flow-T decodes it
(a Transformer-decoder block with layer norms reads the action token and attends to the state). A Gaussian
noise term added to every step (the noise-augmented rollout) makes the path's density tractable, so SAC's
entropy term and temperature work unchanged and the actor is trained end to end by backpropagating the
critic through all K steps, from scratch.

Equations (function that implements each):
- plain flow step:  a_{k+1} = a_k + dt v(s, a_k, t_k),  dt = 1/K, t_k = k/K                    -> flow_step
- Flow-G velocity:  v = z * (h - a_k),  z = sigmoid(G(s, a_k, t_k)),  h = c tanh(H(s, a_k, t_k))
                    (so a_{k+1} = (1 - dt z) a_k + dt z h: a GRU update, convex for dt z <= 1)   -> gated_velocity
- Flow-T velocity:  x = LN(E a_k + S(s) + T(t_k)),  x = LN(x + FF(x)),  v = W x                -> decoded_velocity
- noise-augmented rollout: a_0 ~ N(0, I),  a_{k+1} = a_k + dt v_k + sigma(s) eps_k,  y = tanh(a_K);
  log pi = log N(a_0; 0, I) + sum_k log N(a_{k+1}; a_k + dt v_k, sigma^2) - sum log(1 - y^2)
                                                                                   -> noise_augmented_rollout
- soft Bellman target: y = r + gamma (1 - d) (min_i Q'_i(s', a') - alpha log pi(a'|s')),
  a' ~ pi(.|s')                                                                                  -> soft_bellman_target
- critic: L_Q = sum_i mean (Q_i(s, a) - y)^2                                                     -> critic_loss
- actor:  L_pi = mean(alpha log pi(a|s) - min_i Q_i(s, a)),  a ~ pi(.|s) reparameterised         -> actor_loss
- temperature: L_alpha = -mean(alpha (log pi(a|s) + H_target)),  H_target = -dim(A)              -> temperature_loss
- the diagnostic: ||d a_K / d a_0|| (mean over states of the Jacobian's Frobenius norm) and
  ||d a_K / d theta|| (theta: the velocity's parameters) through the K steps, noise off          -> rollout_grad_norms

Deviations:
- Task: a 2-D point mass that must reach a goal drawn per episode (built here, batched torch; 30 steps,
  reward minus the distance), not MuJoCo / OGBench. Scores are normalised to a uniform-random policy (0) and a
  hand-tuned PD controller (100) on the same evaluation episodes.
- Small MLPs (2 x 64, SiLU), 24k environment steps from 8 parallel environments, one update per vector step;
  plain twin-Q critics without the authors' batch renormalisation (CrossQ) and without their delayed actor.
- Flow-G's candidate is bounded, h = c tanh(H(.)) with c = --candidate-scale, as a GRU's candidate is; the
  authors' code leaves it linear. Measured with random networks at weight gain 8, K = 32: the linear candidate's
  gradient grows to about 1e3 (1e6 for the plain velocity), the tanh candidate's stays near 1.
- Flow-T is one decoder block whose cross-attention over the single state token reduces to a linear map of the
  state embedding (softmax over one key is 1), written as such; the authors use 2 blocks of 4 heads.
- sigma(s) is one state-conditioned network shared by all steps (as in the authors' Flow-G code), log sigma
  squashed into [--log-std-min, --log-std-max]. Evaluation runs the flow from a_0 = 0 without step noise (the
  Gaussian actor's mean action), the usual deterministic SAC evaluation.

Commands:
    python algos/flow_sac.py                                  # Flow-G, K = 8: about 1-2 min on 1 CPU thread
    python algos/flow_sac.py --policy plain                   # the plain velocity (naive SAC flow)
    python algos/flow_sac.py --policy decoded                 # Flow-T
    python algos/flow_sac.py --policy gaussian                # tanh-Gaussian SAC, the reference
    python algos/flow_sac.py --policy plain --velocity-gain 4 --flow-steps 16   # a steep velocity at init
    python benchmarks/flow_sac_table.py                       # gradient norm vs K, and return over seeds

Expected: the default run (Flow-G, K = 8, 24k steps, about 1.5 min on one shared CPU thread) goes from a score
near 0 to about 96 of the PD controller's 100 (seed 0: 3.9 -> 95.8). benchmarks/results/flow_sac.md: at weight gain
6 the plain velocity's ||d a_K / d a_0|| grows from about 10 (K = 1) to about 600 (K = 32, the mean of log10 over 16
init seeds) while the gated and decoded ones stay between 0.7 and 1.8; in SAC at 12k steps Flow-G and the plain flow
end alike at the default init (79 vs 75), Flow-T higher (89), Gaussian SAC highest (98); from gain 6 the plain flow
fails on one seed of three (its trained Jacobian ~3,000) and Flow-G on none.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tqdm.auto import tqdm

import common
from algos import _offline_data as D

POLICIES = ("gated", "plain", "decoded", "gaussian")
FLOWS = ("gated", "plain", "decoded")


# ---- args ----
@dataclass
class Args:
    exp_name: str = "flow_sac"
    """name of the run (used in out_dir)"""
    seed: int = 0
    """seed for torch, the environments and the evaluation episodes"""
    track: bool = False
    """mirror metrics to wandb"""
    out_dir: str = ""
    """output folder (default runs/<exp_name>-<policy>-K<flow_steps>-s<seed>)"""
    threads: int = 1
    """torch threads (1 is fastest on a shared 2-core machine)"""
    policy: str = "gated"
    """actor: gated (Flow-G), plain (naive flow), decoded (Flow-T) or gaussian (tanh-Gaussian SAC)"""
    flow_steps: int = 8
    """K, Euler steps of the flow rollout"""
    hidden: int = 64
    """hidden width of every MLP (two hidden layers)"""
    velocity_gain: float = 1.0
    """multiplier on the velocity network's initial weights (a steeper velocity at init when > 1)"""
    candidate_scale: float = 2.0
    """c of Flow-G's bounded candidate h = c tanh(H)"""
    log_std_min: float = -5.0
    """lower end of log sigma (step noise of the flows, action std of the Gaussian)"""
    log_std_max: float = 1.0
    """upper end of log sigma"""
    total_steps: int = 24_000
    """environment steps (summed over the parallel environments)"""
    num_envs: int = 8
    """parallel environments; one gradient update per vector step"""
    learning_starts: int = 2_000
    """environment steps of uniform random actions before the first update"""
    batch_size: int = 256
    """minibatch size"""
    gamma: float = 0.95
    """discount"""
    tau: float = 0.005
    """target critic soft-update rate"""
    policy_lr: float = 3e-4
    """Adam learning rate of the actor"""
    q_lr: float = 1e-3
    """Adam learning rate of the critics and the temperature"""
    alpha: float = 0.1
    """initial entropy temperature (fixed when --no-autotune)"""
    autotune: bool = True
    """learn the temperature toward the target entropy -dim(A)"""
    eval_every: int = 4_000
    """evaluate every this many environment steps"""
    eval_episodes: int = 32
    """evaluation episodes (run in parallel, seeded 10_000 + seed)"""


def check_args(args: Args) -> None:
    if args.policy not in POLICIES:
        raise SystemExit(f"--policy {args.policy!r} unknown; choose one of {', '.join(POLICIES)}")
    for k in ("flow_steps", "hidden", "total_steps", "num_envs", "batch_size", "eval_every", "eval_episodes",
              "threads", "velocity_gain", "candidate_scale", "policy_lr", "q_lr", "alpha"):
        if getattr(args, k) <= 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if not 0 < args.gamma <= 1:
        raise SystemExit(f"--gamma must be in (0, 1], got {args.gamma}")
    if not 0 < args.tau <= 1:
        raise SystemExit(f"--tau must be in (0, 1], got {args.tau}")
    if args.log_std_min >= args.log_std_max:
        raise SystemExit(f"--log-std-min ({args.log_std_min}) must be below --log-std-max ({args.log_std_max})")
    if not 0 <= args.learning_starts < args.total_steps:
        raise SystemExit(f"--learning-starts must be in [0, --total-steps), got {args.learning_starts}")


# ---- the task: a 2-D point mass reaching a goal ----
HORIZON, DAMP, PUSH, DT_ENV = 30, 0.8, 0.2, 0.25
OBS_DIM, ACT_DIM = 6, 2


class PointMass:
    """n copies: state p, v in R^2 and a goal g, p and g uniform in [-1, 1]^2, v = 0 at reset.
    v' = DAMP v + PUSH clip(a, -1, 1), p' = clip(p + DT_ENV v', -1.2, 1.2); reward -||p' - g||;
    observation (p, v, g - p); episodes last HORIZON steps (a time limit, never terminal)."""

    def __init__(self, n: int, seed: int):
        self.n, self.gen = n, torch.Generator().manual_seed(seed)

    def reset(self):
        u = lambda: torch.rand(self.n, 2, generator=self.gen) * 2 - 1  # noqa: E731
        self.p, self.v, self.g, self.t = u(), torch.zeros(self.n, 2), u(), 0
        return self.obs()

    def obs(self):
        return torch.cat([self.p, self.v, self.g - self.p], -1)

    def step(self, a):
        self.v = DAMP * self.v + PUSH * a.clamp(-1, 1)
        self.p = (self.p + DT_ENV * self.v).clamp(-1.2, 1.2)
        self.t += 1
        return self.obs(), -(self.p - self.g).norm(dim=-1), self.t >= HORIZON


def pd_controller(obs):
    """The reference controller of the score's 100: push toward the goal, damp the velocity."""
    return (3.0 * obs[:, 4:6] - 1.5 * obs[:, 2:4]).clamp(-1, 1)


def episode_returns(policy, n: int, seed: int):
    """Returns of n parallel episodes of `policy` (obs -> action in [-1, 1]) from seeded resets."""
    env = PointMass(n, seed)
    obs, ret, done = env.reset(), torch.zeros(n), False
    while not done:
        obs, r, done = env.step(policy(obs))
        ret += r
    return ret


def reference_returns(n: int, seed: int):
    """(uniform random, PD controller) mean returns on the evaluation episodes: the score's 0 and 100."""
    gen = torch.Generator().manual_seed(seed + 1)
    rand = episode_returns(lambda o: torch.rand(len(o), ACT_DIM, generator=gen) * 2 - 1, n, seed).mean().item()
    return rand, episode_returns(pd_controller, n, seed).mean().item()


# ---- networks ----
def mlp(i: int, o: int, h: int, gain: float = 1.0) -> nn.Sequential:
    """i -> h -> h -> o with SiLUs, the default init's weights times `gain`."""
    net = nn.Sequential(nn.Linear(i, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(), nn.Linear(h, o))
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(gain)
    return net


def time_column(t: float, a: torch.Tensor) -> torch.Tensor:
    return torch.full((len(a), 1), float(t))


class PlainVelocity(nn.Module):
    """v = MLP(s, a_k, t_k): the naive flow policy's velocity."""

    def __init__(self, obs_dim, act_dim, h, gain=1.0):
        super().__init__()
        self.net = mlp(obs_dim + act_dim + 1, act_dim, h, gain)

    def forward(self, s, a, t):
        return self.net(torch.cat([s, a, time_column(t, a)], -1))


def gated_velocity(z_logit, cand, a, scale):
    """Flow-G: v = sigmoid(z_logit) * (scale tanh(cand) - a)."""
    return torch.sigmoid(z_logit) * (scale * torch.tanh(cand) - a)


class GatedVelocity(nn.Module):
    """Flow-G: gate G and candidate H, each an MLP of (s, a_k, t_k); the gate starts open (zero last weights,
    bias 5, sigmoid 0.993) as in the authors' code."""

    def __init__(self, obs_dim, act_dim, h, gain=1.0, scale=2.0):
        super().__init__()
        self.gate, self.cand, self.scale = mlp(obs_dim + act_dim + 1, act_dim, h, gain), \
            mlp(obs_dim + act_dim + 1, act_dim, h, gain), scale
        with torch.no_grad():
            self.gate[-1].weight.zero_()
            self.gate[-1].bias.fill_(5.0)

    def forward(self, s, a, t):
        x = torch.cat([s, a, time_column(t, a)], -1)
        return gated_velocity(self.gate(x), self.cand(x), a, self.scale)


def decoded_velocity(tok, ff, ln1, ln2, out):
    """Flow-T: x = LN1(tok), x = LN2(x + FF(x)), v = out(x); tok = E a_k + S(s) + T(t_k)."""
    x = ln1(tok)
    return out(ln2(x + ff(x)))


class DecodedVelocity(nn.Module):
    """Flow-T: the action token E a_k + T(t_k) plus the state's cross-attention output (one state token: a
    linear map of its embedding), then a post-LN residual feed-forward block and a linear velocity head."""

    def __init__(self, obs_dim, act_dim, h, gain=1.0, d=32):
        super().__init__()
        self.embed_a, self.embed_t = nn.Linear(act_dim, d), nn.Linear(1, d)
        self.embed_s = mlp(obs_dim, d, h)
        self.ff, self.ln1, self.ln2, self.out = mlp(d, d, h, gain), nn.LayerNorm(d), nn.LayerNorm(d), \
            nn.Linear(d, act_dim)
        with torch.no_grad():
            self.embed_a.weight.mul_(gain)

    def forward(self, s, a, t):
        tok = self.embed_a(a) + self.embed_s(s) + self.embed_t(time_column(t, a))
        return decoded_velocity(tok, self.ff, self.ln1, self.ln2, self.out)


def make_velocity(kind: str, obs_dim: int, act_dim: int, h: int, gain: float = 1.0, scale: float = 2.0):
    if kind == "plain":
        return PlainVelocity(obs_dim, act_dim, h, gain)
    if kind == "gated":
        return GatedVelocity(obs_dim, act_dim, h, gain, scale)
    if kind == "decoded":
        return DecodedVelocity(obs_dim, act_dim, h, gain)
    raise ValueError(f"unknown velocity {kind!r}; choose one of {', '.join(FLOWS)}")


def squash_log_std(x, lo, hi):
    """tanh-squash a raw log-std into [lo, hi] (the authors' and cleanrl's SAC do the same)."""
    return lo + 0.5 * (hi - lo) * (torch.tanh(x) + 1)


def flow_step(a, v, dt):
    """The Euler step a_{k+1} = a_k + dt v (the residual recurrence)."""
    return a + dt * v


def noise_augmented_rollout(velocity, log_std, s, K: int, noise: bool = True, a0=None):
    """K Euler steps from a_0 ~ N(0, I) (or the given a0) with N(0, sigma(s)^2) noise added to every step.
    -> (action tanh(a_K) (B, A), log pi (B,): the path density with the tanh correction). noise=False runs the
    deterministic flow (its log pi is then only the start's and the tanh term)."""
    a = torch.randn(len(s), ACT_DIM) if a0 is None else a0
    logp = (-0.5 * a.pow(2) - 0.5 * math.log(2 * math.pi)).sum(-1)
    dt = 1.0 / K
    for k in range(K):
        mean = flow_step(a, velocity(s, a, k * dt), dt)
        if noise:
            eps = torch.randn_like(mean)
            a = mean + log_std.exp() * eps
            logp = logp + (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        else:
            a = mean
    y = torch.tanh(a)
    return y, logp - torch.log(1 - y.pow(2) + 1e-6).sum(-1)


class FlowActor(nn.Module):
    """A flow policy: a velocity (plain, gated or decoded) and a state-conditioned step noise sigma(s)."""

    def __init__(self, kind, obs_dim, act_dim, h, K, gain, scale, log_std_min, log_std_max):
        super().__init__()
        self.velocity = make_velocity(kind, obs_dim, act_dim, h, gain, scale)
        self.log_std_net, self.K, self.bounds = mlp(obs_dim, act_dim, h), K, (log_std_min, log_std_max)

    def forward(self, s, deterministic: bool = False):
        if deterministic:
            return noise_augmented_rollout(self.velocity, None, s, self.K, False, torch.zeros(len(s), ACT_DIM))
        log_std = squash_log_std(self.log_std_net(s), *self.bounds)
        return noise_augmented_rollout(self.velocity, log_std, s, self.K)


class GaussianActor(nn.Module):
    """tanh-Gaussian SAC actor: (mean, log std) = MLP(s), a = tanh(mean + std eps)."""

    def __init__(self, obs_dim, act_dim, h, log_std_min, log_std_max):
        super().__init__()
        self.net, self.bounds = mlp(obs_dim, 2 * act_dim, h), (log_std_min, log_std_max)

    def forward(self, s, deterministic: bool = False):
        mean, raw = self.net(s).chunk(2, -1)
        log_std = squash_log_std(raw, *self.bounds)
        eps = torch.zeros_like(mean) if deterministic else torch.randn_like(mean)
        u = mean + log_std.exp() * eps
        y = torch.tanh(u)
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return y, logp - torch.log(1 - y.pow(2) + 1e-6).sum(-1)


def make_actor(args: Args) -> nn.Module:
    if args.policy == "gaussian":
        return GaussianActor(OBS_DIM, ACT_DIM, args.hidden, args.log_std_min, args.log_std_max)
    return FlowActor(args.policy, OBS_DIM, ACT_DIM, args.hidden, args.flow_steps, args.velocity_gain,
                     args.candidate_scale, args.log_std_min, args.log_std_max)


# ---- the gradient diagnostic ----
def rollout_grad_norms(velocity, s, K: int, a0=None) -> tuple[float, float]:
    """(||d a_K / d a_0||, ||d a_K / d theta||) of the deterministic K-step flow (no noise, no tanh) from a0
    (default N(0, I)): the first is the mean over states of the Frobenius norm of the Jacobian d a_K / d a_0,
    the second the norm of the gradient of mean_b sum_j a_K[b, j] / sqrt(A) with respect to the velocity's
    parameters (one backward pass each per action dimension; exact, no sampling beyond a0)."""
    a0 = (torch.randn(len(s), ACT_DIM) if a0 is None else a0).clone().requires_grad_(True)
    a, dt = a0, 1.0 / K
    for k in range(K):
        a = flow_step(a, velocity(s, a, k * dt), dt)
    rows = [torch.autograd.grad(a[:, j].sum(), a0, retain_graph=True)[0] for j in range(a.shape[1])]
    jac = torch.stack(rows, 1)  # (B, A_out, A_in): rows of each state's Jacobian
    params = [p for p in velocity.parameters() if p.requires_grad]
    g = torch.autograd.grad(a.sum(-1).mean() / math.sqrt(a.shape[1]), params, allow_unused=True)
    g_norm = math.sqrt(sum(float(x.pow(2).sum()) for x in g if x is not None))
    return float(jac.flatten(1).norm(dim=-1).mean()), g_norm


def grad_norm_table(kinds, Ks, gain: float, seed: int = 0, n: int = 64, hidden: int = 64) -> dict:
    """{(kind, K): (||d a_K/d a_0||, ||d a_K/d theta||)} for freshly initialised velocities at weight `gain`
    (the same seed for every K, so a row varies K alone)."""
    out = {}
    for kind in kinds:
        for K in Ks:
            torch.manual_seed(seed)
            vel = make_velocity(kind, OBS_DIM, ACT_DIM, hidden, gain)
            s, a0 = PointMass(n, seed).reset(), torch.randn(n, ACT_DIM)
            out[(kind, K)] = rollout_grad_norms(vel, s, K, a0)
    return out


# ---- SAC ----
def soft_bellman_target(r, d, q1_next, q2_next, logp_next, gamma, alpha):
    """y = r + gamma (1 - d) (min(Q1', Q2') - alpha log pi(a'|s'))."""
    return r + gamma * (1 - d) * (torch.min(q1_next, q2_next) - alpha * logp_next)


def critic_loss(q1, q2, y):
    """sum over the twins of the mean squared TD error to the (detached) target y."""
    return F.mse_loss(q1, y) + F.mse_loss(q2, y)


def actor_loss(q1_pi, q2_pi, logp_pi, alpha):
    """mean(alpha log pi - min(Q1, Q2)) at reparameterised actions."""
    return (alpha * logp_pi - torch.min(q1_pi, q2_pi)).mean()


def temperature_loss(log_alpha, logp_pi, target_entropy):
    """-mean(alpha (log pi + H_target)), log pi detached: alpha falls when the entropy is above the target."""
    return -(log_alpha.exp() * (logp_pi.detach() + target_entropy)).mean()


def grad_norm(module: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in module.parameters() if p.grad is not None))


def sac_update(nets, opts, batch, args: Args) -> dict:
    """One SAC step: critics to the soft Bellman target, the actor through its rollout, the temperature."""
    actor, critic, critic_t, log_alpha = nets
    s, a, r, s2 = batch
    alpha = log_alpha.exp().detach()
    with torch.no_grad():
        a2, logp2 = actor(s2)
        y = soft_bellman_target(r, torch.zeros_like(r), *critic_t(s2, a2), logp2, args.gamma, alpha)
    q1, q2 = critic(s, a)
    lc = critic_loss(q1, q2, y)
    if not torch.isfinite(lc):
        raise FloatingPointError(f"critic loss is {lc.item()}")
    D.update(opts["critic"], lc)
    a_pi, logp = actor(s)
    la = actor_loss(*critic(s, a_pi), logp, alpha)
    opts["actor"].zero_grad()
    la.backward()
    g_actor = grad_norm(actor)
    opts["actor"].step()
    out = {"loss/critic": lc.item(), "loss/actor": la.item(), "loss/alpha": alpha.item(),
           "loss/entropy": -logp.mean().item(), "loss/actor_grad_norm": g_actor, "loss/q_mean": q1.mean().item()}
    if args.autotune:
        D.update(opts["alpha"], temperature_loss(log_alpha, logp, -float(ACT_DIM)))
    D.soft_update(((critic, critic_t),), args.tau)
    return out


# ---- evaluation ----
def evaluate(actor, args: Args, refs) -> dict:
    """Deterministic return on args.eval_episodes seeded episodes, and the score against (random, PD)."""
    with torch.no_grad():
        ret = episode_returns(lambda o: actor(o, deterministic=True)[0], args.eval_episodes,
                              10_000 + args.seed).mean().item()
    return {"eval/return": ret, "eval/score": 100 * (ret - refs[0]) / (refs[1] - refs[0])}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    out_dir = args.out_dir or f"runs/{args.exp_name}-{args.policy}-K{args.flow_steps}-s{args.seed}"
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    tracker = common.Tracker(out_dir, args, track=args.track, run_name=Path(out_dir).name)
    actor, critic = make_actor(args), D.Critic(OBS_DIM, ACT_DIM, 2 * args.hidden)
    critic_t = D.Critic(OBS_DIM, ACT_DIM, 2 * args.hidden)
    critic_t.load_state_dict(critic.state_dict())
    log_alpha = torch.tensor(math.log(args.alpha), requires_grad=True)
    opts = {"actor": torch.optim.Adam(actor.parameters(), lr=args.policy_lr),
            "critic": torch.optim.Adam(critic.parameters(), lr=args.q_lr),
            "alpha": torch.optim.Adam([log_alpha], lr=args.q_lr)}
    n_iters = args.total_steps // args.num_envs
    buf = {k: torch.zeros(n_iters * args.num_envs, d) for k, d in (("s", OBS_DIM), ("a", ACT_DIM), ("s2", OBS_DIM))}
    buf["r"], size = torch.zeros(n_iters * args.num_envs), 0
    refs = reference_returns(args.eval_episodes, 10_000 + args.seed)
    env = PointMass(args.num_envs, args.seed)
    obs, ep_ret, train_returns, logs, grad_max = env.reset(), torch.zeros(args.num_envs), [], {}, 0.0
    t0 = time.perf_counter()
    hist = [{"step": 0, **evaluate(actor, args, refs)}]
    bar = tqdm(range(1, n_iters + 1), desc=f"flow_sac {args.policy} K={args.flow_steps}", mininterval=1.0)
    for it in bar:
        steps = it * args.num_envs
        with torch.no_grad():
            act = torch.rand(args.num_envs, ACT_DIM) * 2 - 1 if steps <= args.learning_starts else actor(obs)[0]
        obs2, r, done = env.step(act)
        for k, v in (("s", obs), ("a", act), ("s2", obs2), ("r", r)):
            buf[k][size:size + args.num_envs] = v
        size, ep_ret, obs = size + args.num_envs, ep_ret + r, obs2
        if done:
            train_returns.append(ep_ret.mean().item())
            obs, ep_ret = env.reset(), torch.zeros(args.num_envs)
        if steps > args.learning_starts:
            idx = torch.randint(0, size, (args.batch_size,))
            logs = sac_update((actor, critic, critic_t, log_alpha), opts,
                              tuple(buf[k][idx] for k in ("s", "a", "r", "s2")), args)
            grad_max = max(grad_max, logs["loss/actor_grad_norm"])
        if steps % args.eval_every < args.num_envs or it == n_iters:
            ev = evaluate(actor, args, refs)
            hist.append({"step": steps, **ev})
            tracker.log({**ev, **logs, "rollout/return": train_returns[-1] if train_returns else float("nan")}, steps)
            bar.set_postfix(score=f"{ev['eval/score']:.1f}")
    return tracker.finish(summarise(actor, hist, refs, grad_max, t0, args, out_dir))


def summarise(actor, hist, refs, grad_max, t0, args: Args, out_dir) -> dict:
    """score_first/last/best (0 random, 100 PD), score_auc (the mean over the evaluations after step 0),
    return_last, the largest actor gradient norm seen, and for a flow actor the trained velocity's
    ||d a_K / d a_0|| and ||d a_K / d theta|| on 256 fresh states."""
    D.save_curve(Path(out_dir) / "curve.png", hist, f"SAC, {args.policy} actor, K={args.flow_steps}")
    scores = [h["eval/score"] for h in hist]
    out = {"score_first": scores[0], "score_last": scores[-1], "score_best": max(scores),
           "score_auc": sum(scores[1:]) / max(len(scores) - 1, 1),
           "return_last": hist[-1]["eval/return"], "return_random": refs[0], "return_pd": refs[1],
           "actor_grad_norm_max": grad_max}
    if args.policy in FLOWS:
        torch.manual_seed(args.seed + 1)
        out["jac_a0_end"], out["grad_theta_end"] = rollout_grad_norms(
            actor.velocity, PointMass(256, args.seed + 1).reset(), args.flow_steps)
    out["wall_s"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
