"""Locally generated offline RL datasets in the D4RL layout, their environments, and score normalisation.

Shared module (leading underscore: not a script). The offline RL scripts import it; it imports nothing from them.

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
The halfcheetah behaviour policies are linear (108 parameters) and trained by `train_cem` (about 2 minutes on one
core, cached); their "expert" is far weaker than D4RL's. `MujocoBatch` also steps Hopper-v5 (checked against gymnasium
like HalfCheetah), but no hopper datasets are built: within a few minutes the linear CEM search either learns to stand
still (the survival bonus alone gives return 1,000) or, with the bonus left out of its fitness as ARS does, to dive
forward and fall (return about 400), neither a locomotion behaviour. `rho > 0` replaces that fraction of episodes with
bad behaviour (random actions on pendulum, the bad mode on the toy): the degraded variants.

Caching: `.cache/offline_data/<name>-<hash>.npz` + `.json`, keyed by a hash of the full config (and the generator
version). The JSON stores the npz's sha256; a missing, truncated or altered file is detected and regenerated. Scores:
raw return, normalised 100 * (R - R_random) / (R_expert - R_random) with this dataset's own reference policies, and
D4RL's constants where a D4RL counterpart exists (indicative only: our data and environments are not D4RL's).

The end of the file holds the plumbing the offline RL scripts (td3_bc, iql, driftql, ravl) share, none of their ideas:
the Args fields they all have (`OfflineArgs`, and `TD3Args` for the scripts with TD3's critic; each script's `Args`
extends one, checked by `check_offline_args`), the start of a run (`start_run`), the dataset as normalised tensors
(`load_tensors`, `sample`), the networks (`mlp`, `Actor`, the twin-Q `Critic`), an optimiser step and the
target-network update (`update`, `soft_update`), evaluation (`policy_fn`, `eval_policy`), and the end of a run
(`summarise`, `save_curve`).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

import common

GENERATOR_VERSION = 2  # 2: locomotion caches keep per-row episode ids
ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / ".cache" / "offline_data"
KEYS = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts")
PENDULUM_SETS = ("random", "medium", "expert", "medium-replay", "mixed")
LOCOMOTION_SETS = ("random", "medium", "medium-replay", "expert")
DATASETS = tuple(f"pendulum-{s}" for s in PENDULUM_SETS) + ("toy-multimodal",) + \
    tuple(f"halfcheetah-{s}" for s in LOCOMOTION_SETS)
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


# ---- MuJoCo locomotion: gymnasium's HalfCheetah-v5 and Hopper-v5 on raw MuJoCo, n episodes in one loop ----
# Same model files, frame skips, reset noise, observations, rewards and (Hopper) termination as the v5
# environments with their default arguments, without gymnasium's wrapper (which imports its renderer's
# dependencies) and its per-step overhead. tests/test_offline_data.py checks both step for step against gym.make.
LOCO_HORIZON = 1000
LOCOMOTION = {
    "halfcheetah": {"xml": "half_cheetah.xml", "frame_skip": 5, "obs_dim": 17, "act_dim": 6, "ctrl_cost": 0.1,
                    "healthy_reward": 0.0, "reset_noise": 0.1},
    "hopper": {"xml": "hopper.xml", "frame_skip": 4, "obs_dim": 11, "act_dim": 3, "ctrl_cost": 1e-3,
               "healthy_reward": 1.0, "reset_noise": 5e-3},
}
_MODELS: dict = {}


def mujoco_model(env_name: str):
    if env_name not in _MODELS:
        import gymnasium
        import mujoco

        xml = Path(gymnasium.__file__).parent / "envs" / "mujoco" / "assets" / LOCOMOTION[env_name]["xml"]
        # gymnasium's model files use an attribute MuJoCo 3.x deprecates; its warning would go to stderr and to
        # a MUJOCO_LOG.TXT in the working directory on every load
        mujoco.set_mju_user_warning(lambda msg: None)
        try:
            _MODELS[env_name] = mujoco.MjModel.from_xml_path(str(xml))
        finally:
            mujoco.set_mju_user_warning(None)
    return _MODELS[env_name]


class MujocoBatch:
    """n copies of one locomotion environment. step(act) -> (obs, reward, terminal); act clipped to [-1, 1].
    halfcheetah: obs = qpos[1:] ++ qvel, reward = x velocity - 0.1 |a|^2, never terminal.
    hopper: obs = qpos[1:] ++ clip(qvel, -10, 10), reward = x velocity + 1 (while healthy) - 1e-3 |a|^2,
            terminal when unhealthy (height <= 0.7, |torso angle| >= 0.2, or any |state| >= 100)."""

    def __init__(self, env_name: str, n: int):
        import mujoco

        self.name, self.spec = env_name, LOCOMOTION[env_name]
        self.mj, self.model = mujoco, mujoco_model(env_name)
        self.data = [mujoco.MjData(self.model) for _ in range(n)]
        self.dt = self.model.opt.timestep * self.spec["frame_skip"]
        self.obs_dim, self.act_dim = self.spec["obs_dim"], self.spec["act_dim"]

    def reset(self, rng):
        m, noise = self.model, self.spec["reset_noise"]
        for d in self.data:
            self.mj.mj_resetData(m, d)
            d.qpos[:] = m.qpos0 + rng.uniform(-noise, noise, m.nq)
            d.qvel[:] = noise * rng.standard_normal(m.nv) if self.name == "halfcheetah" else \
                rng.uniform(-noise, noise, m.nv)
            self.mj.mj_forward(m, d)
        return self.obs()

    def obs(self):
        clip = 10.0 if self.name == "hopper" else np.inf
        return np.stack([np.concatenate([d.qpos[1:], np.clip(d.qvel, -clip, clip)]) for d in self.data]) \
            .astype(np.float32)

    def healthy(self, d) -> bool:
        if self.name != "hopper":
            return True
        state = np.concatenate([d.qpos, d.qvel])[2:]
        return bool(np.all(np.abs(state) < 100.0) and d.qpos[1] > 0.7 and -0.2 < d.qpos[2] < 0.2)

    def step(self, act):
        act = np.clip(np.asarray(act, np.float64), -1, 1)
        reward, terminal = np.empty(len(self.data), np.float32), np.zeros(len(self.data), bool)
        for i, d in enumerate(self.data):
            x0 = d.qpos[0]
            d.ctrl[:] = act[i]
            self.mj.mj_step(self.model, d, self.spec["frame_skip"])
            ok = self.healthy(d)
            reward[i] = (d.qpos[0] - x0) / self.dt + self.spec["healthy_reward"] * ok \
                - self.spec["ctrl_cost"] * float(act[i] @ act[i])
            terminal[i] = not ok
        return self.obs(), reward, terminal


# ---- locomotion behaviour policies: a linear policy trained by the cross-entropy method ----
# a = tanh(W (obs * obs_scale) + b): act_dim x obs_dim + act_dim parameters (108 for halfcheetah, 36 for
# hopper). Each generation samples `pop` parameter vectors from a diagonal Gaussian, runs one episode each
# (up to 1000 steps), and refits the Gaussian to the `elites` best (plus a decaying extra variance so the
# search does not collapse early). The search mean of every generation is evaluated; the best one is the
# expert, the first to reach MEDIUM_FRACTION of the random-to-expert gap is the medium policy, and the first
# `keep` episodes of every generation up to the medium one (plain samples of the search distribution) form
# medium-replay.
HC_CEM = {"generations": 40, "pop": 40, "elites": 8, "keep": 5, "eval_episodes": 5, "init_std": 0.5}
MEDIUM_FRACTION = 0.4  # D4RL's halfcheetah-medium scores about 40 on its own scale
ACTION_NOISE = 0.1  # Gaussian noise on the medium and expert policies' actions while collecting data


def cem_config(env_name: str) -> dict:
    if env_name != "halfcheetah":
        raise ValueError(f"no behaviour policies for {env_name!r}: only halfcheetah has CEM-trained ones")
    return HC_CEM  # looked up at call time (tests patch it)


def _split_params(params, obs_dim):
    """params [..., act_dim * (obs_dim + 1)] -> (W [..., act_dim, obs_dim], b [..., act_dim])."""
    act_dim = params.shape[-1] // (obs_dim + 1)
    return params[..., :act_dim * obs_dim].reshape(*params.shape[:-1], act_dim, obs_dim), \
        params[..., act_dim * obs_dim:]


def linear_policy(params, obs_scale):
    """params (act_dim * (obs_dim + 1),) -> policy(obs (n, obs_dim)) -> act (n, act_dim)."""
    W, b = _split_params(params, len(obs_scale))
    return lambda obs: np.tanh((obs * obs_scale) @ W.T + b).astype(np.float32)


def _run_population(env_name, params, obs_scale, rng, record: int = 0):
    """One episode per parameter vector. Returns (returns (P,), D4RL arrays of the first `record` episodes with
    an "episode" column numbering them 0..record-1, episode-major)."""
    P = len(params)
    W, b = _split_params(params, len(obs_scale))
    env = MujocoBatch(env_name, P)
    obs, ret, alive = env.reset(rng), np.zeros(P), np.ones(P, bool)
    cols, valid = {k: [] for k in KEYS}, []
    for t in range(LOCO_HORIZON):
        act = np.tanh(np.einsum("pij,pj->pi", W, obs * obs_scale) + b).astype(np.float32)
        nxt, r, term = env.step(act)
        ret += r * alive
        if record:
            timeout = np.full(P, t == LOCO_HORIZON - 1) & ~term
            for k, v in zip(KEYS, (obs, act, r, nxt, term, timeout)):
                cols[k].append(v[:record])
            valid.append(alive[:record].copy())
        alive &= ~term
        obs = nxt
        if not alive.any():
            break
    if not record:
        return ret, None
    m = np.stack(valid, 1)  # (record, T): each episode's steps in order, none after its end
    data = {k: np.stack(v, 1)[m].astype(np.float32) for k, v in cols.items()}
    data["episode"] = np.broadcast_to(np.arange(record)[:, None], m.shape)[m]
    return ret, data


def train_cem(env_name: str, seed: int = 0, cfg: dict | None = None):
    """Run the CEM search. Returns arrays: means (G, n_params), eval_returns (G,), obs_scale, replay_* (D4RL
    keys, episodes in generation order), replay_episode (per row) and replay_generation (per episode)."""
    cfg = {**cem_config(env_name), **(cfg or {})}
    spec = LOCOMOTION[env_name]
    rng = np.random.default_rng(seed)
    env = MujocoBatch(env_name, 8)  # observation scale from random-action rollouts
    obs, seen = env.reset(rng), []
    for _ in range(200):
        obs, _, _ = env.step(rng.uniform(-1, 1, (8, spec["act_dim"])))
        seen.append(obs)
    obs_scale = (1.0 / np.maximum(np.concatenate(seen).std(0), 1e-2)).astype(np.float32)
    n_params = spec["act_dim"] * (spec["obs_dim"] + 1)
    mu, sd = np.zeros(n_params), np.full(n_params, cfg["init_std"])
    means, evals, replay, replay_gen = [], [], [], []
    bar = tqdm(range(cfg["generations"]), desc=f"CEM behaviour policy ({env_name})", leave=False)
    for g in bar:
        pop = mu + sd * rng.standard_normal((cfg["pop"], n_params))
        ret, data = _run_population(env_name, pop, obs_scale, rng, record=cfg["keep"])
        data["episode"] = data["episode"] + g * cfg["keep"]
        replay.append(data)
        replay_gen += [g] * cfg["keep"]
        elite = pop[np.argsort(ret)[-cfg["elites"]:]]
        mu, sd = elite.mean(0), np.sqrt(elite.var(0) + 0.01 * 0.95 ** g)
        ev = _run_population(env_name, np.tile(mu, (cfg["eval_episodes"], 1)), obs_scale, rng)[0].mean()
        means.append(mu.copy())
        evals.append(ev)
        bar.set_postfix(population=f"{ret.mean():.0f}", mean_policy=f"{ev:.0f}")
    out = {"means": np.array(means), "eval_returns": np.array(evals), "obs_scale": obs_scale,
           "replay_generation": np.array(replay_gen)}
    out.update({f"replay_{k}": np.concatenate([d[k] for d in replay]) for k in KEYS + ("episode",)})
    return out


def locomotion_policies(env_name: str, cfg: dict | None = None, cache_dir=None):
    """The reference behaviour policies of a locomotion environment (CEM seed 0, cached like a dataset).
    Returns dict: expert, medium (parameter vectors), obs_scale, medium_generation, expert_generation,
    ref_random_return, ref_expert_return, cem (the raw arrays of train_cem)."""
    cfg = {**cem_config(env_name), **(cfg or {})}
    cem = _cached(f"{env_name}-cem", {"cem": cfg, "seed": 0}, lambda: _cem_with_refs(env_name, cfg), cache_dir)
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


def _cem_with_refs(env_name, cfg):
    cem = train_cem(env_name, 0, cfg)
    best = cem["means"][int(np.argmax(cem["eval_returns"]))]
    # reference returns over 20 fixed episodes: uniform random actions (0) and the expert, noise-free (100)
    act_dim = LOCOMOTION[env_name]["act_dim"]
    r_rand = evaluate(env_name, random_policy(act_dim, 1), 20, seed=777)[0].mean()
    r_exp = evaluate(env_name, linear_policy(best, cem["obs_scale"]), 20, seed=777)[0].mean()
    cem["ref_random_return"], cem["ref_expert_return"] = np.array(r_rand), np.array(r_exp)
    return cem


# ---- batched environments and evaluation ----
ENVS = ("pendulum", "toy", "halfcheetah", "hopper")


class BatchEnv:
    """n parallel episodes. reset(seed) -> obs; step(act) -> obs, reward, terminal, timeout, info."""

    def __init__(self, name: str, n: int):
        if name not in ENVS:
            raise ValueError(f"unknown environment {name!r}: expected one of {', '.join(ENVS)}")
        self.name, self.n = name, n
        self.mujoco = MujocoBatch(name, n) if name in LOCOMOTION else None
        if self.mujoco:
            self.obs_dim, self.act_dim, self.horizon = self.mujoco.obs_dim, self.mujoco.act_dim, LOCO_HORIZON
        else:
            self.obs_dim, self.act_dim = {"pendulum": (3, 1), "toy": (2, 2)}[name]
            self.horizon = P_HORIZON if name == "pendulum" else T_HORIZON

    def reset(self, seed: int):
        rng = np.random.default_rng(seed)
        self.t = 0
        if self.name == "pendulum":
            state = rng.uniform([-np.pi, -1.0], [np.pi, 1.0], size=(self.n, 2))
            self.obs = pendulum_obs(state)
        elif self.mujoco:
            self.obs = self.mujoco.reset(rng)
        else:
            self.obs = (0.05 * rng.standard_normal((self.n, 2))).astype(np.float32)
        return self.obs

    def step(self, act):
        self.t += 1
        if self.name == "pendulum":
            nxt, r = pendulum_model(self.obs, act)
            term, info = np.zeros(self.n, bool), {}
        elif self.mujoco:  # halfcheetah never terminates (timeouts only, as in D4RL); hopper falls
            nxt, r, term = self.mujoco.step(act)
            info = {}
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
    """(random, expert) mean returns of this project's reference policies over fixed episodes (100 on pendulum
    and the toy, 20 on halfcheetah, where they come with the cached CEM search)."""
    if env_name in LOCOMOTION:  # computed once with the CEM search and cached with it
        pol = locomotion_policies(env_name)
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


def generate(name: str, seed: int = 0, n_episodes: int | None = None, rho: float = 0.0, bad_frac: float = 0.1):
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
    elif env_name in LOCOMOTION:
        kind, act_dim = name.split("-", 1)[1], LOCOMOTION[env_name]["act_dim"]
        pol = locomotion_policies(env_name)
        if kind == "medium-replay":  # the CEM population's episodes up to the medium generation
            return _medium_replay(name, env_name, pol, seed, n_episodes, rho)
        n = n_episodes or 50
        base = {"random": lambda o, r: r.uniform(-1, 1, (len(o), act_dim)).astype(np.float32)}.get(kind)
        if base is None:
            lin = linear_policy(pol[kind], pol["obs_scale"])
            base = lambda o, r: np.clip(lin(o) + ACTION_NOISE * r.standard_normal((len(o), act_dim)), -1, 1)
        eps = np.where(rng.random(n) < rho, 1.0, 0.0)  # degraded: whole episodes of random actions
        act_fn = _episode_policy(eps.astype(np.float32), lambda o, r: base(o, r).astype(np.float32), act_dim)
    else:
        n = n_episodes or 200
        mode = rng.integers(0, 2, n)
        mode = np.where(rng.random(n) < bad_frac, 2, mode)
        mode = np.where(rng.random(n) < rho, 2, mode)  # degraded: whole episodes of the bad mode
        act_fn = lambda obs, t, r: toy_behaviour(obs, mode, r)
    data, ep_ret = _rollout_dataset(env_name, n, act_fn, int(rng.integers(2 ** 31)), f"generating {name}")
    data["meta"] = _meta(name, env_name, seed, n, rho, bad_frac if env_name == "toy" else None, data, ep_ret)
    return data


def _medium_replay(name, env_name, pol, seed, n_episodes, rho):
    """<env>-medium-replay: the recorded CEM episodes of generations 0..medium (n_episodes of them, drawn
    without replacement by `seed` when given); rho replaces that fraction with fresh random-action episodes."""
    cem, rng = pol["cem"], np.random.default_rng(seed)
    eps_ids = np.flatnonzero(cem["replay_generation"] <= pol["medium_generation"])
    if n_episodes:
        eps_ids = np.sort(rng.choice(eps_ids, min(n_episodes, len(eps_ids)), replace=False))
    bad = rng.random(len(eps_ids)) < rho
    rows = np.isin(cem["replay_episode"], eps_ids[~bad])
    data = {k: cem[f"replay_{k}"][rows].astype(np.float32) for k in KEYS}
    ep_ret = np.bincount(cem["replay_episode"][rows], weights=data["rewards"])[eps_ids[~bad]]
    if bad.any():
        act_dim = LOCOMOTION[env_name]["act_dim"]
        rand, rand_ret = _rollout_dataset(env_name, int(bad.sum()), lambda o, t, r: r.uniform(
            -1, 1, (len(o), act_dim)).astype(np.float32), int(rng.integers(2 ** 31)), f"generating {name}")
        data = {k: np.concatenate([data[k], rand[k]]) for k in KEYS}
        ep_ret = np.concatenate([ep_ret, rand_ret])
    data["meta"] = _meta(name, env_name, seed, len(ep_ret), rho, None, data, ep_ret)
    data["meta"]["medium_generation"] = pol["medium_generation"]
    return data


def _meta(name, env_name, seed, n, rho, bad_frac, data, ep_ret):
    r_rand, r_exp = reference_returns(env_name)
    return {
        "generator": f"algos/_offline_data.py v{GENERATOR_VERSION}", "name": name, "env": env_name,
        "seed": seed, "n_episodes": n, "rho": rho, "bad_frac": bad_frac, "n_transitions": int(len(data["rewards"])),
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
    tmp = npz.with_suffix(f".{os.getpid()}.tmp.npz")  # per process: parallel test workers may build one entry
    np.savez(tmp, **{k: v for k, v in out.items() if k != "meta"})
    meta = {**out.get("meta", {}), "config": cfg, "sha256": _sha256(tmp), "file": npz.name}
    os.replace(tmp, npz)
    meta_path.with_suffix(f".{os.getpid()}.tmp").write_text(json.dumps(meta, indent=2))
    os.replace(meta_path.with_suffix(f".{os.getpid()}.tmp"), meta_path)
    out["meta"] = meta
    if verbose:
        print(f"generated {npz}")
    return out


def get_dataset(name: str, seed: int = 0, n_episodes: int | None = None, rho: float = 0.0,
                bad_frac: float = 0.1, cache_dir: str | Path | None = None, verbose: bool = False):
    """Load the dataset from the cache, or generate and cache it. A corrupt cache entry is regenerated."""
    cfg = {"name": name, "seed": seed, "n_episodes": n_episodes, "rho": rho, "bad_frac": bad_frac}
    if env_of(name) in LOCOMOTION:  # the behaviour policies are part of what the data depends on
        cfg["cem"] = cem_config(env_of(name))

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


# ---- shared by the offline RL scripts: Args fields, run set-up, tensors, networks, updates, evaluation ----
@dataclass
class OfflineArgs:
    """The fields every offline RL script has; a script's `Args(OfflineArgs)` changes defaults and adds its own."""

    exp_name: str = "offline"
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
    gamma: float = 0.99
    """discount"""
    tau: float = 0.005
    """target network soft-update rate"""
    hidden: int = 128
    """hidden width of the MLPs (two hidden layers)"""
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
    threads: int = 1
    """torch threads (1 is fastest on a shared 2-core machine)"""


@dataclass
class TD3Args(OfflineArgs):
    """OfflineArgs plus TD3's critic settings (target policy smoothing, delayed actor updates)."""

    policy_noise: float = 0.2
    """target policy smoothing noise std"""
    noise_clip: float = 0.5
    """target policy smoothing noise clip"""
    policy_freq: int = 2
    """actor update every policy_freq critic updates"""


def check_offline_args(args: OfflineArgs, positive: tuple[str, ...] = ()) -> None:
    """The checks every offline script makes (dataset name, sizes, learning rate, discount, target step) plus
    `positive`, the script's own fields that must be > 0; each error names its flag."""
    if args.dataset not in DATASETS:
        raise SystemExit(f"--dataset {args.dataset!r} unknown; choose one of {', '.join(DATASETS)}")
    for k in ("total_steps", "eval_every", "eval_episodes", "batch_size", "hidden", "threads", "lr", *positive):
        if getattr(args, k) <= 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    for k in ("gamma", "tau"):  # tau: the target networks' Polyak step
        if not 0 < getattr(args, k) <= 1:
            raise SystemExit(f"--{k} must be in (0, 1], got {getattr(args, k)}")


def start_run(args: OfflineArgs, out_dir: str) -> common.Tracker:
    """Set the CPU threads, seed everything, open the tracker (config.json, metrics.jsonl in out_dir)."""
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    return common.Tracker(out_dir, args, track=args.track, run_name=Path(out_dir).name)


def load_tensors(name: str, seed: int = 0, rho: float = 0.0, normalize: bool = True):
    """The dataset as CPU tensors with states (observations and next_observations) normalised by the dataset's
    mean and std + 1e-3 (mean 0, std 1 when `normalize` is off) -> (meta, tensors by KEYS, mean, std)."""
    data = get_dataset(name, seed=seed, rho=rho)
    check_dataset(data)
    t = {k: torch.as_tensor(data[k]) for k in KEYS}
    mean, std = t["observations"].mean(0), t["observations"].std(0) + 1e-3
    if not normalize:
        mean, std = torch.zeros_like(mean), torch.ones_like(std)
    t["observations"] = (t["observations"] - mean) / std
    t["next_observations"] = (t["next_observations"] - mean) / std
    return data["meta"], t, mean, std


def sample(t: dict, batch_size: int):
    """A uniform minibatch (s, a, r, s', done) of rows of the tensors `t`, each (B, ...)."""
    idx = torch.randint(0, len(t["rewards"]), (batch_size,))
    return tuple(t[k][idx] for k in ("observations", "actions", "rewards", "next_observations", "terminals"))


def mlp(i: int, o: int, h: int) -> nn.Sequential:
    """i -> h -> h -> o with ReLUs between: every network of the offline scripts."""
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


class Actor(nn.Module):
    """Deterministic policy a = tanh(mlp(s)) in [-1, 1]."""

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


def update(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One gradient step of `opt` on `loss`."""
    opt.zero_grad()
    loss.backward()
    opt.step()


@torch.no_grad()
def soft_update(pairs, tau: float) -> None:
    """Polyak averaging theta' <- theta' + tau (theta - theta') for each (network, target network) pair."""
    for net, tgt in pairs:
        for p, pt in zip(net.parameters(), tgt.parameters()):
            pt.lerp_(p, tau)


def policy_fn(actor: nn.Module, mean=0.0, std=1.0):
    """numpy obs (n, d) -> numpy actions (n, a) of `actor` on the states (obs - mean) / std, without gradients."""
    @torch.no_grad()
    def act(obs):
        return actor((torch.as_tensor(obs, dtype=torch.float32) - mean) / std).numpy()
    return act


def eval_policy(env_name: str, policy, args: OfflineArgs, goals: bool = False) -> dict:
    """eval/return (mean over args.eval_episodes episodes, seeded 10_000 + args.seed) and eval/score (normalised);
    with `goals` (the toy) also the fractions of episodes that reached the left and the right goal."""
    ret, info = evaluate(env_name, policy, args.eval_episodes, seed=10_000 + args.seed)
    out = {"eval/return": float(ret.mean()), "eval/score": normalized_score(env_name, float(ret.mean()))}
    if goals:
        out.update({"eval/goal_left": float((info["goal"] == 0).mean()),
                    "eval/goal_right": float((info["goal"] == 1).mean())})
    return out


def summarise(hist: list[dict], meta: dict, t0: float, **extra) -> dict:
    """The summary every offline script returns, from its evaluation rows `hist` (eval/score, eval/return):
    score_first, score_last, score_best, return_last, the script's `extra` figures, the behaviour policy's
    score and the wall time since t0."""
    scores = [h["eval/score"] for h in hist]
    return {"score_first": scores[0], "score_last": scores[-1], "score_best": max(scores),
            "return_last": hist[-1]["eval/return"], **extra, "behaviour_score": meta["behaviour_score"],
            "wall_s": time.perf_counter() - t0}


def save_curve(path, hist: list[dict], title: str) -> None:
    """The normalised score of the evaluation rows `hist` (step, eval/score) against the gradient step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([h["step"] for h in hist], [h["eval/score"] for h in hist], marker="o")
    ax.set(xlabel="gradient step", ylabel="normalised score", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
