"""Locally generated offline RL datasets in the D4RL layout, their environments, and score normalisation.

Shared module (leading underscore: not a script). The offline RL scripts import it; it imports nothing
from them.

Environments (all batched numpy, actions in [-1, 1]):
- `pendulum`: gymnasium Pendulum-v1 dynamics (g=10, dt=0.05, torque = 2 * action, speed clipped at 8,
  200-step episodes, no terminal states). `pendulum_model(obs, act)` is the exact dynamics on
  observations: the "true model" for model-based offline RL (algos/ravl.py).
- `toy`: a 2-D point that must reach one of two goals, left (-0.7, 0.7) or right (0.7, 0.7). Reaching a
  goal gives +1 and ends the episode (terminal); every step costs 0.05; episodes are cut after 20 steps
  (timeout). The behaviour data has two equally good modes (left, right) and a bad one (heads down).

Datasets (`get_dataset(name, ...)`): dict of float32 arrays observations, actions, rewards,
next_observations, terminals, timeouts (D4RL layout) plus `meta` (generator, config, seed, behaviour
returns, reference returns). Names:
- pendulum-random        uniform random actions
- pendulum-medium        the expert controller with 45% of steps replaced by random actions
- pendulum-expert        the expert controller (energy-pumping swing-up + PD balance), action noise 0.1
- pendulum-medium-replay episodes whose random-action rate falls from 1.0 to the medium rate (a stand-in
                         for the replay buffer of an agent trained up to "medium")
- pendulum-mixed         half random, half expert episodes
- toy-multimodal         left / right / bad modes; `bad_frac` of episodes are bad
- halfcheetah-random     uniform random actions (HalfCheetah-v5 dynamics and reward on raw MuJoCo)
- halfcheetah-medium     the CEM search mean that first reached 40% of the random-to-expert gap, action
                         noise 0.1 (D4RL's medium policy is a SAC agent stopped at about a third of expert)
- halfcheetah-medium-replay  the CEM population's episodes up to that generation (the search's replay)
- halfcheetah-expert     the best CEM search mean, action noise 0.1
The halfcheetah behaviour policies are linear (108 parameters) and trained by `train_cem` (about 90 s on one
core, cached); their "expert" is far weaker than D4RL's (a few thousand return vs 12,135).
`rho > 0` replaces that fraction of episodes with bad behaviour (random actions on pendulum, the bad mode
on the toy): the degraded variants.

Caching: `.cache/offline_data/<name>-<hash>.npz` + `.json`, keyed by a hash of the full config (and the
generator version). The JSON stores the npz's sha256; a missing, truncated or altered file is detected and
regenerated. Scores: raw return, normalised 100 * (R - R_random) / (R_expert - R_random) with this
dataset's own reference policies, and D4RL's constants where a D4RL counterpart exists (indicative only:
our data and environments are not D4RL's).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

GENERATOR_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / ".cache" / "offline_data"
KEYS = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts")
PENDULUM_SETS = ("random", "medium", "expert", "medium-replay", "mixed")
HALFCHEETAH_SETS = ("random", "medium", "medium-replay", "expert")
DATASETS = tuple(f"pendulum-{s}" for s in PENDULUM_SETS) + ("toy-multimodal",) + \
    tuple(f"halfcheetah-{s}" for s in HALFCHEETAH_SETS)
# D4RL reference returns (random, expert) for environments with a D4RL counterpart; indicative only.
D4RL_REF = {"halfcheetah": (-280.178953, 12135.0)}
MEDIUM_EPS = 0.45

# ---- pendulum: exact gymnasium Pendulum-v1 dynamics, batched ----
P_G, P_M, P_L, P_DT, P_MAX_SPEED, P_MAX_TORQUE, P_HORIZON = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0, 200


def angle_normalize(x):
    return ((x + np.pi) % (2 * np.pi)) - np.pi


def pendulum_obs(state):
    """state (n, 2) = (theta, theta_dot) -> obs (n, 3) = (cos, sin, theta_dot)."""
    return np.stack([np.cos(state[:, 0]), np.sin(state[:, 0]), state[:, 1]], 1).astype(np.float32)


def pendulum_model(obs, act):
    """The true dynamics on observations: obs (n, 3), act (n, 1) in [-1, 1] -> next_obs (n, 3), reward (n,)."""
    obs = np.asarray(obs, np.float64)
    th, thdot = np.arctan2(obs[:, 1], obs[:, 0]), obs[:, 2]
    u = np.clip(np.asarray(act, np.float64)[:, 0], -1, 1) * P_MAX_TORQUE
    reward = -(angle_normalize(th) ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2)
    newthdot = np.clip(thdot + (3 * P_G / (2 * P_L) * np.sin(th) + 3.0 / (P_M * P_L ** 2) * u) * P_DT,
                       -P_MAX_SPEED, P_MAX_SPEED)
    newth = th + newthdot * P_DT
    return pendulum_obs(np.stack([newth, newthdot], 1)), reward.astype(np.float32)


def pendulum_expert(obs):
    """Energy-pumping swing-up, PD balance near the top. obs (n, 3) -> action (n, 1) in [-1, 1]."""
    th, thdot = np.arctan2(obs[:, 1], obs[:, 0]), obs[:, 2]
    energy = 0.5 * thdot ** 2 + 1.5 * P_G / P_L * (np.cos(th) - 1.0)  # 0 at rest upright; dE/dt = 3 u thdot
    swing = np.clip(-0.5 * energy * np.sign(thdot + 1e-6), -2, 2)
    swing = np.where(energy > 0, -np.clip(thdot, -2, 2), swing)  # too much energy: brake
    pd = -(10.0 * th + 2.0 * thdot)
    near = (np.abs(th) < 0.6) & (np.abs(thdot) < 3.0)
    return (np.clip(np.where(near, pd, swing), -2, 2) / P_MAX_TORQUE)[:, None].astype(np.float32)


# ---- toy: two good modes and a bad one ----
T_GOALS = np.array([[-0.7, 0.7], [0.7, 0.7]], np.float32)
T_RADIUS, T_STEP, T_COST, T_HORIZON, T_BAD_DIR = 0.15, 0.15, 0.05, 20, np.array([0.0, -1.0], np.float32)


def toy_step(obs, act):
    """obs (n, 2), act (n, 2) -> next_obs, reward, terminal, goal index (-1: none)."""
    nxt = np.clip(obs + T_STEP * np.clip(act, -1, 1), -1.5, 1.5).astype(np.float32)
    d = np.linalg.norm(nxt[:, None, :] - T_GOALS[None], axis=-1)  # (n, 2)
    hit = d.min(1) < T_RADIUS
    goal = np.where(hit, d.argmin(1), -1)
    reward = np.where(hit, 1.0, -T_COST).astype(np.float32)
    return nxt, reward, hit, goal


def toy_behaviour(obs, mode, rng, noise=0.2):
    """mode 0/1: head for the left/right goal; mode 2: the bad mode (heads down). Gaussian action noise."""
    target = T_GOALS[np.clip(mode, 0, 1)]
    d = target - obs
    good = 0.8 * d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-6)
    a = np.where((mode == 2)[:, None], 0.8 * T_BAD_DIR[None], good)
    return np.clip(a + noise * rng.standard_normal(a.shape), -1, 1).astype(np.float32)


# ---- halfcheetah: gymnasium's HalfCheetah-v5 on raw MuJoCo, n episodes stepped in one loop ----
# Same model file, frame skip, reset noise, observation and reward as HalfCheetah-v5 (defaults), without
# gymnasium's wrapper (which imports its renderer's dependencies) and its per-step overhead.
HC_HORIZON, HC_FRAME_SKIP, HC_CTRL_COST, HC_RESET_NOISE = 1000, 5, 0.1, 0.1
_HC_MODEL = []


def halfcheetah_model():
    if not _HC_MODEL:
        import gymnasium
        import mujoco

        xml = Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets" / "half_cheetah.xml"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _HC_MODEL.append(mujoco.MjModel.from_xml_path(str(xml)))
    return _HC_MODEL[0]


class HalfCheetahBatch:
    """obs (17,) = qpos[1:] ++ qvel; reward = forward velocity - 0.1 |a|^2; actions clipped to [-1, 1]."""

    obs_dim, act_dim = 17, 6

    def __init__(self, n: int):
        import mujoco

        self.mj, self.model = mujoco, halfcheetah_model()
        self.data = [mujoco.MjData(self.model) for _ in range(n)]
        self.dt = self.model.opt.timestep * HC_FRAME_SKIP

    def reset(self, rng):
        m = self.model
        for d in self.data:
            self.mj.mj_resetData(m, d)
            d.qpos[:] = m.qpos0 + rng.uniform(-HC_RESET_NOISE, HC_RESET_NOISE, m.nq)
            d.qvel[:] = HC_RESET_NOISE * rng.standard_normal(m.nv)
            self.mj.mj_forward(m, d)
        return self.obs()

    def obs(self):
        return np.stack([np.concatenate([d.qpos[1:], d.qvel]) for d in self.data]).astype(np.float32)

    def step(self, act):
        act = np.clip(np.asarray(act, np.float64), -1, 1)
        reward = np.empty(len(self.data), np.float32)
        for i, d in enumerate(self.data):
            x0 = d.qpos[0]
            d.ctrl[:] = act[i]
            self.mj.mj_step(self.model, d, HC_FRAME_SKIP)
            reward[i] = (d.qpos[0] - x0) / self.dt - HC_CTRL_COST * float(act[i] @ act[i])
        return self.obs(), reward


# ---- halfcheetah behaviour policies: a linear policy trained by the cross-entropy method ----
# a = tanh(W (obs * obs_scale) + b): 6 x 17 + 6 = 108 parameters. Each generation samples `pop` parameter
# vectors from a diagonal Gaussian, runs one 1000-step episode each, and refits the Gaussian to the `elites`
# best (plus a decaying extra variance so the search does not collapse early). The search mean of every
# generation is evaluated; the best one is the expert, the first to reach MEDIUM_FRACTION of the
# random-to-expert gap is the medium policy, and the first `keep` episodes of every generation up to the
# medium one (plain samples of the search distribution) form medium-replay.
HC_CEM = {"generations": 40, "pop": 40, "elites": 8, "keep": 5, "eval_episodes": 5, "init_std": 0.5}
MEDIUM_FRACTION = 0.4  # D4RL's halfcheetah-medium scores about 40 on its own scale
HC_ACTION_NOISE = 0.1  # Gaussian noise on the medium and expert policies' actions while collecting data


def linear_policy(params, obs_scale):
    """params (108,) -> policy(obs (n, 17)) -> act (n, 6)."""
    W, b = params[:102].reshape(6, 17), params[102:]
    return lambda obs: np.tanh((obs * obs_scale) @ W.T + b).astype(np.float32)


def _run_population(params, obs_scale, rng, record: int = 0):
    """One 1000-step episode per parameter vector. Returns (returns (P,), D4RL arrays of the first `record`)."""
    P = len(params)
    W, b = params[:, :102].reshape(P, 6, 17), params[:, 102:]
    env = HalfCheetahBatch(P)
    obs, ret, cols = env.reset(rng), np.zeros(P), {k: [] for k in KEYS}
    for t in range(HC_HORIZON):
        act = np.tanh(np.einsum("pij,pj->pi", W, obs * obs_scale) + b).astype(np.float32)
        nxt, r = env.step(act)
        ret += r
        if record:
            last = np.full(record, t == HC_HORIZON - 1)
            for k, v in zip(KEYS, (obs, act, r, nxt, np.zeros(record, bool), last)):
                cols[k].append(v[:record])
        obs = nxt
    if not record:
        return ret, None
    # (T, record, ...) -> episode-major rows (record * T, ...), as in D4RL
    data = {k: np.stack(v, 1).reshape(record * HC_HORIZON, *np.shape(v[0])[1:]).astype(np.float32)
            for k, v in cols.items()}
    return ret, data


def train_cem(seed: int = 0, cfg: dict | None = None):
    """Run the CEM search. Returns arrays: means (G, 108), eval_returns (G,), obs_scale, replay_* (D4RL keys,
    episodes in generation order) and replay_generation (one entry per episode)."""
    cfg = {**HC_CEM, **(cfg or {})}
    rng = np.random.default_rng(seed)
    env = HalfCheetahBatch(8)  # observation scale from random-action rollouts
    obs, seen = env.reset(rng), []
    for _ in range(200):
        obs, _ = env.step(rng.uniform(-1, 1, (8, 6)))
        seen.append(obs)
    obs_scale = (1.0 / np.maximum(np.concatenate(seen).std(0), 1e-2)).astype(np.float32)
    mu, sd = np.zeros(108), np.full(108, cfg["init_std"])
    means, evals, replay, replay_gen = [], [], [], []
    bar = tqdm(range(cfg["generations"]), desc="CEM behaviour policy (halfcheetah)", leave=False)
    for g in bar:
        pop = mu + sd * rng.standard_normal((cfg["pop"], 108))
        ret, data = _run_population(pop, obs_scale, rng, record=cfg["keep"])
        replay.append(data)
        replay_gen += [g] * cfg["keep"]
        elite = pop[np.argsort(ret)[-cfg["elites"]:]]
        mu, sd = elite.mean(0), np.sqrt(elite.var(0) + 0.01 * 0.95 ** g)
        ev = _run_population(np.tile(mu, (cfg["eval_episodes"], 1)), obs_scale, rng)[0].mean()
        means.append(mu.copy())
        evals.append(ev)
        bar.set_postfix(population=f"{ret.mean():.0f}", mean_policy=f"{ev:.0f}")
    out = {"means": np.array(means), "eval_returns": np.array(evals), "obs_scale": obs_scale,
           "replay_generation": np.array(replay_gen)}
    out.update({f"replay_{k}": np.concatenate([d[k] for d in replay]) for k in KEYS})
    return out


def halfcheetah_policies(cfg: dict | None = None, cache_dir=None):
    """The reference behaviour policies of the halfcheetah sets (CEM seed 0, cached like a dataset).
    Returns dict: expert, medium (parameter vectors), obs_scale, medium_generation, ref_random_return,
    ref_expert_return, cem (the raw arrays of train_cem)."""
    cfg = {**HC_CEM, **(cfg or {})}
    cem = _cached("halfcheetah-cem", {"cem": cfg, "seed": 0}, lambda: _cem_with_refs(cfg), cache_dir)
    means, evals = cem["means"], cem["eval_returns"]
    lo, hi = float(cem["ref_random_return"]), float(cem["ref_expert_return"])
    if hi <= lo:
        raise RuntimeError(f"the CEM search {cfg} did not beat random actions (expert {hi:.0f} <= random {lo:.0f}): "
                           "give it more generations")
    best = int(np.argmax(evals))
    medium = int(np.argmax(evals >= lo + MEDIUM_FRACTION * (evals[best] - lo)))
    return {"expert": means[best], "medium": means[medium], "obs_scale": cem["obs_scale"],
            "medium_generation": medium, "expert_generation": best, "ref_random_return": lo,
            "ref_expert_return": hi, "cem": cem}


def _cem_with_refs(cfg):
    cem = train_cem(0, cfg)
    best = cem["means"][int(np.argmax(cem["eval_returns"]))]
    # reference returns over 20 fixed episodes: uniform random actions (0) and the expert, noise-free (100)
    r_rand = evaluate("halfcheetah", random_policy(6, 1), 20, seed=777)[0].mean()
    r_exp = evaluate("halfcheetah", linear_policy(best, cem["obs_scale"]), 20, seed=777)[0].mean()
    cem["ref_random_return"], cem["ref_expert_return"] = np.array(r_rand), np.array(r_exp)
    return cem


# ---- batched environments and evaluation ----
ENVS = ("pendulum", "toy", "halfcheetah")


class BatchEnv:
    """n parallel episodes. reset(seed) -> obs; step(act) -> obs, reward, terminal, timeout, info."""

    def __init__(self, name: str, n: int):
        if name not in ENVS:
            raise ValueError(f"unknown environment {name!r}: expected one of {', '.join(ENVS)}")
        self.name, self.n = name, n
        self.obs_dim, self.act_dim = {"pendulum": (3, 1), "toy": (2, 2), "halfcheetah": (17, 6)}[name]
        self.horizon = {"pendulum": P_HORIZON, "toy": T_HORIZON, "halfcheetah": HC_HORIZON}[name]
        self.cheetah = HalfCheetahBatch(n) if name == "halfcheetah" else None

    def reset(self, seed: int):
        rng = np.random.default_rng(seed)
        self.t = 0
        if self.name == "pendulum":
            state = rng.uniform([-np.pi, -1.0], [np.pi, 1.0], size=(self.n, 2))
            self.obs = pendulum_obs(state)
        elif self.name == "halfcheetah":
            self.obs = self.cheetah.reset(rng)
        else:
            self.obs = (0.05 * rng.standard_normal((self.n, 2))).astype(np.float32)
        return self.obs

    def step(self, act):
        self.t += 1
        if self.name == "pendulum":
            nxt, r = pendulum_model(self.obs, act)
            term, info = np.zeros(self.n, bool), {}
        elif self.name == "halfcheetah":  # never terminates: episodes end by timeout only (as in D4RL)
            nxt, r = self.cheetah.step(act)
            term, info = np.zeros(self.n, bool), {}
        else:
            nxt, r, term, goal = toy_step(self.obs, act)
            info = {"goal": goal}
        timeout = np.full(self.n, self.t >= self.horizon) & ~term
        self.obs = nxt
        return nxt, r, term, timeout, info


def env_of(dataset_name: str) -> str:
    return dataset_name.split("-")[0]


def evaluate(env_name: str, policy, n_episodes: int = 10, seed: int = 10_000):
    """Run `policy(obs (n, d) np.float32) -> act (n, a)` for n_episodes in parallel; episodes end at a
    terminal state or the horizon. Returns (returns (n,), info) with info['goal'] the goal reached (toy)."""
    env = BatchEnv(env_name, n_episodes)
    obs = env.reset(seed)
    ret, alive = np.zeros(n_episodes), np.ones(n_episodes, bool)
    goal = np.full(n_episodes, -1)
    for _ in range(env.horizon):
        obs, r, term, _, info = env.step(policy(obs))
        ret += r * alive
        if "goal" in info:
            goal = np.where(alive & (info["goal"] >= 0), info["goal"], goal)
        alive &= ~term
        if not alive.any():
            break
    return ret, {"goal": goal}


def random_policy(act_dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return lambda obs: rng.uniform(-1, 1, (len(obs), act_dim)).astype(np.float32)


def reference_returns(env_name: str) -> tuple[float, float]:
    """(random, expert) mean returns of this project's reference policies over 100 fixed episodes."""
    if env_name == "halfcheetah":  # computed once with the CEM search and cached with it
        pol = halfcheetah_policies()
        return pol["ref_random_return"], pol["ref_expert_return"]
    if env_name == "pendulum":
        expert = pendulum_expert
    else:
        expert = lambda obs: toy_behaviour(obs, (obs[:, 0] > 0).astype(int), np.random.default_rng(0), 0.0)
    act_dim = 1 if env_name == "pendulum" else 2
    r_rand = float(evaluate(env_name, random_policy(act_dim, 1), 100, seed=777)[0].mean())
    r_exp = float(evaluate(env_name, expert, 100, seed=777)[0].mean())
    return r_rand, r_exp


_REF_CACHE: dict[str, tuple[float, float]] = {}


def normalized_score(env_name: str, ret: float) -> float:
    """100 * (R - R_random) / (R_expert - R_random) with this project's reference policies."""
    if env_name not in _REF_CACHE:
        _REF_CACHE[env_name] = reference_returns(env_name)
    lo, hi = _REF_CACHE[env_name]
    return 100.0 * (ret - lo) / (hi - lo)


def d4rl_score(env_name: str, ret: float):
    """D4RL-normalised score (indicative only) or None when D4RL has no counterpart (pendulum, toy)."""
    if env_name not in D4RL_REF:
        return None
    lo, hi = D4RL_REF[env_name]
    return 100.0 * (ret - lo) / (hi - lo)


# ---- generation ----
def _rollout_dataset(env_name, n_episodes, act_fn, seed, desc):
    """Collect n_episodes in parallel with act_fn(obs, t, rng) -> act. Returns D4RL arrays + episode returns."""
    rng = np.random.default_rng(seed)
    env = BatchEnv(env_name, n_episodes)
    obs = env.reset(int(rng.integers(2 ** 31)))
    alive = np.ones(n_episodes, bool)
    cols = {k: [] for k in KEYS}
    valid, ep_ret = [], np.zeros(n_episodes)
    for t in tqdm(range(env.horizon), desc=desc, leave=False, mininterval=0.5):
        act = act_fn(obs, t, rng)
        nxt, r, term, timeout, _ = env.step(act)
        for k, v in zip(KEYS, (obs, act, r, nxt, term, timeout)):
            cols[k].append(v)
        valid.append(alive.copy())
        ep_ret += r * alive
        alive &= ~term
        obs = nxt
        if not alive.any():
            break
    m = np.stack(valid, 1)  # (episodes, T): keep each episode's steps in order, drop steps after its end
    out = {k: np.stack(v, 1)[m] for k, v in cols.items()}
    for k in ("observations", "actions", "next_observations", "rewards"):
        out[k] = out[k].astype(np.float32)
    for k in ("terminals", "timeouts"):
        out[k] = out[k].astype(np.float32)
    return out, ep_ret


def _episode_policy(per_episode_eps, base, act_dim):
    """Per-step: with the episode's probability eps take a uniform random action, else base(obs)."""
    def act_fn(obs, t, rng):
        a = base(obs, rng)
        rand = rng.uniform(-1, 1, a.shape).astype(np.float32)
        return np.where((rng.random(len(obs)) < per_episode_eps)[:, None], rand, a)
    return act_fn


def generate(name: str, seed: int = 0, n_episodes: int | None = None, rho: float = 0.0,
             bad_frac: float = 0.1):
    """Build a dataset from scratch (no cache). See the module docstring for the names."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    env_name = env_of(name)
    rng = np.random.default_rng(seed)
    if env_name == "pendulum":
        n = n_episodes or 100
        kind = name.split("-", 1)[1]
        expert = lambda obs, r: np.clip(pendulum_expert(obs) + 0.1 * r.standard_normal((len(obs), 1)), -1, 1)
        eps = {"random": np.ones(n), "medium": np.full(n, MEDIUM_EPS), "expert": np.zeros(n),
               "medium-replay": np.linspace(1.0, MEDIUM_EPS, n),
               "mixed": np.where(np.arange(n) < n // 2, 1.0, 0.0)}[kind]
        eps = np.where(rng.random(n) < rho, 1.0, eps)  # degraded: whole episodes of random actions
        act_fn = _episode_policy(eps.astype(np.float32), lambda o, r: expert(o, r).astype(np.float32), 1)
    elif env_name == "halfcheetah":
        kind = name.split("-", 1)[1]
        pol = halfcheetah_policies()
        if kind == "medium-replay":  # the CEM population's episodes up to the medium generation
            return _medium_replay(name, pol, seed, n_episodes, rho)
        n = n_episodes or 50
        base = {"random": lambda o, r: r.uniform(-1, 1, (len(o), 6)).astype(np.float32)}.get(kind)
        if base is None:
            lin = linear_policy(pol[kind], pol["obs_scale"])
            base = lambda o, r: np.clip(lin(o) + HC_ACTION_NOISE * r.standard_normal((len(o), 6)), -1, 1)
        eps = np.where(rng.random(n) < rho, 1.0, 0.0)  # degraded: whole episodes of random actions
        act_fn = _episode_policy(eps.astype(np.float32), lambda o, r: base(o, r).astype(np.float32), 6)
    else:
        n = n_episodes or 200
        mode = rng.integers(0, 2, n)
        mode = np.where(rng.random(n) < bad_frac, 2, mode)
        mode = np.where(rng.random(n) < rho, 2, mode)  # degraded: whole episodes of the bad mode
        act_fn = lambda obs, t, r: toy_behaviour(obs, mode, r)
    data, ep_ret = _rollout_dataset(env_name, n, act_fn, int(rng.integers(2 ** 31)), f"generating {name}")
    data["meta"] = _meta(name, env_name, seed, n, rho, bad_frac if env_name == "toy" else None, data, ep_ret)
    return data


def _medium_replay(name, pol, seed, n_episodes, rho):
    """halfcheetah-medium-replay: the recorded CEM episodes of generations 0..medium (n_episodes of them, drawn
    without replacement by `seed` when given); rho replaces that fraction with fresh random-action episodes."""
    cem, rng = pol["cem"], np.random.default_rng(seed)
    eps_ids = np.flatnonzero(cem["replay_generation"] <= pol["medium_generation"])
    if n_episodes:
        eps_ids = np.sort(rng.choice(eps_ids, min(n_episodes, len(eps_ids)), replace=False))
    bad = rng.random(len(eps_ids)) < rho
    rows = (eps_ids[~bad, None] * HC_HORIZON + np.arange(HC_HORIZON)[None]).ravel()
    data = {k: cem[f"replay_{k}"][rows].astype(np.float32) for k in KEYS}
    if bad.any():
        rand, _ = _rollout_dataset("halfcheetah", int(bad.sum()), lambda o, t, r: r.uniform(-1, 1, (len(o), 6))
                                   .astype(np.float32), int(rng.integers(2 ** 31)), f"generating {name}")
        data = {k: np.concatenate([data[k], rand[k]]) for k in KEYS}
    ep_ret = data["rewards"].reshape(-1, HC_HORIZON).sum(1)
    data["meta"] = _meta(name, "halfcheetah", seed, len(ep_ret), rho, None, data, ep_ret)
    data["meta"]["medium_generation"] = pol["medium_generation"]
    return data


def _meta(name, env_name, seed, n, rho, bad_frac, data, ep_ret):
    r_rand, r_exp = reference_returns(env_name)
    return {
        "generator": f"algos/_offline_data.py v{GENERATOR_VERSION}", "name": name, "env": env_name,
        "seed": seed, "n_episodes": n, "rho": rho, "bad_frac": bad_frac,
        "n_transitions": int(len(data["rewards"])),
        "behaviour_return_mean": float(ep_ret.mean()), "behaviour_return_std": float(ep_ret.std()),
        "behaviour_score": normalized_score(env_name, float(ep_ret.mean())),
        "behaviour_d4rl_score": d4rl_score(env_name, float(ep_ret.mean())),
        "ref_random_return": r_rand, "ref_expert_return": r_exp,
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached(prefix: str, cfg: dict, build, cache_dir=None, verbose: bool = False) -> dict:
    """Arrays (+ a JSON-able "meta") from `<cache>/<prefix>-<hash of cfg>.npz/.json`, or build() and store them.
    The JSON keeps the npz's sha256: a missing, truncated or altered file is detected and rebuilt."""
    cfg = {**cfg, "version": GENERATOR_VERSION}
    key = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(cache_dir or os.environ.get("OFFLINE_DATA_DIR", CACHE_DIR))
    npz, meta_path = cache / f"{prefix}-{key}.npz", cache / f"{prefix}-{key}.json"
    if npz.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("sha256") != _sha256(npz):
                raise ValueError("sha256 mismatch")
            with np.load(npz) as f:
                out = {k: f[k] for k in f.files}
            out["meta"] = meta
            if verbose:
                print(f"loaded {npz}")
            return out
        except Exception as e:  # noqa: BLE001 - any failure to read means: rebuild
            warnings.warn(f"corrupt offline data cache {npz.name} ({e}); regenerating")
    out = build()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_suffix(".tmp.npz")
    np.savez(tmp, **{k: v for k, v in out.items() if k != "meta"})
    os.replace(tmp, npz)
    meta = {**out.get("meta", {}), "config": cfg, "sha256": _sha256(npz), "file": npz.name}
    meta_path.write_text(json.dumps(meta, indent=2))
    out["meta"] = meta
    if verbose:
        print(f"generated {npz}")
    return out


def get_dataset(name: str, seed: int = 0, n_episodes: int | None = None, rho: float = 0.0,
                bad_frac: float = 0.1, cache_dir: str | Path | None = None, verbose: bool = False):
    """Load the dataset from the cache, or generate and cache it. A corrupt cache entry is regenerated."""
    cfg = {"name": name, "seed": seed, "n_episodes": n_episodes, "rho": rho, "bad_frac": bad_frac}
    if env_of(name) == "halfcheetah":  # the behaviour policies are part of what the data depends on
        cfg["cem"] = HC_CEM

    def build():
        data = generate(name, seed, n_episodes, rho, bad_frac)
        if not set(KEYS) <= set(data):
            raise RuntimeError("generator returned an incomplete dataset")
        return data

    data = _cached(name, cfg, build, cache_dir, verbose)
    return {**{k: data[k] for k in KEYS}, "meta": data["meta"]}


def check_dataset(data: dict) -> None:
    """Raise ValueError naming the problem when a dataset dict is malformed."""
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise ValueError(f"dataset is missing keys: {missing}")
    n = len(data["rewards"])
    for k in KEYS:
        if len(data[k]) != n:
            raise ValueError(f"dataset key {k!r} has {len(data[k])} rows, expected {n}")
        if not np.isfinite(data[k]).all():
            raise ValueError(f"dataset key {k!r} contains NaN or inf")
