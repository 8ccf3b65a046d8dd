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
DATASETS = tuple(f"pendulum-{s}" for s in PENDULUM_SETS) + ("toy-multimodal",)
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


# ---- batched environments and evaluation ----
class BatchEnv:
    """n parallel episodes. reset(seed) -> obs; step(act) -> obs, reward, terminal, timeout, info."""

    def __init__(self, name: str, n: int):
        if name not in ("pendulum", "toy"):
            raise ValueError(f"unknown environment {name!r}: expected 'pendulum' or 'toy'")
        self.name, self.n = name, n
        self.obs_dim, self.act_dim = (3, 1) if name == "pendulum" else (2, 2)
        self.horizon = P_HORIZON if name == "pendulum" else T_HORIZON

    def reset(self, seed: int):
        rng = np.random.default_rng(seed)
        self.t = 0
        if self.name == "pendulum":
            state = rng.uniform([-np.pi, -1.0], [np.pi, 1.0], size=(self.n, 2))
            self.obs = pendulum_obs(state)
        else:
            self.obs = (0.05 * rng.standard_normal((self.n, 2))).astype(np.float32)
        return self.obs

    def step(self, act):
        self.t += 1
        if self.name == "pendulum":
            nxt, r = pendulum_model(self.obs, act)
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
    else:
        n = n_episodes or 200
        mode = rng.integers(0, 2, n)
        mode = np.where(rng.random(n) < bad_frac, 2, mode)
        mode = np.where(rng.random(n) < rho, 2, mode)  # degraded: whole episodes of the bad mode
        act_fn = lambda obs, t, r: toy_behaviour(obs, mode, r)
    data, ep_ret = _rollout_dataset(env_name, n, act_fn, int(rng.integers(2 ** 31)), f"generating {name}")
    r_rand, r_exp = reference_returns(env_name)
    data["meta"] = {
        "generator": f"algos/_offline_data.py v{GENERATOR_VERSION}", "name": name, "env": env_name,
        "seed": seed, "n_episodes": n, "rho": rho, "bad_frac": bad_frac if env_name == "toy" else None,
        "n_transitions": int(len(data["rewards"])),
        "behaviour_return_mean": float(ep_ret.mean()), "behaviour_return_std": float(ep_ret.std()),
        "behaviour_score": normalized_score(env_name, float(ep_ret.mean())),
        "ref_random_return": r_rand, "ref_expert_return": r_exp,
    }
    return data


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def get_dataset(name: str, seed: int = 0, n_episodes: int | None = None, rho: float = 0.0,
                bad_frac: float = 0.1, cache_dir: str | Path | None = None, verbose: bool = False):
    """Load the dataset from the cache, or generate and cache it. A corrupt cache entry is regenerated."""
    cfg = {"name": name, "seed": seed, "n_episodes": n_episodes, "rho": rho, "bad_frac": bad_frac,
           "version": GENERATOR_VERSION}
    key = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(cache_dir or os.environ.get("OFFLINE_DATA_DIR", CACHE_DIR))
    npz, meta_path = cache / f"{name}-{key}.npz", cache / f"{name}-{key}.json"
    if npz.exists() and meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("sha256") != _sha256(npz):
                raise ValueError("sha256 mismatch")
            with np.load(npz) as f:
                data = {k: f[k] for k in KEYS}
            data["meta"] = meta
            if verbose:
                print(f"loaded {npz}")
            return data
        except Exception as e:  # noqa: BLE001 - any failure to read means: regenerate
            warnings.warn(f"corrupt offline dataset cache {npz.name} ({e}); regenerating")
    data = generate(name, seed, n_episodes, rho, bad_frac)
    if not set(KEYS) <= set(data):
        raise RuntimeError("generator returned an incomplete dataset")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_suffix(".tmp.npz")
    np.savez(tmp, **{k: data[k] for k in KEYS})
    os.replace(tmp, npz)
    meta = {**data["meta"], "config": cfg, "sha256": _sha256(npz), "file": npz.name}
    meta_path.write_text(json.dumps(meta, indent=2))
    data["meta"] = meta
    if verbose:
        print(f"generated {npz} ({meta['n_transitions']} transitions)")
    return data


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
