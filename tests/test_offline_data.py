"""algos/_offline_data.py: determinism, D4RL layout, terminals vs timeouts, exact pendulum dynamics, cache."""
import json

import gymnasium as gym
import numpy as np
import pytest

from algos import _offline_data as D


@pytest.mark.parametrize("name", ["pendulum-medium", "toy-multimodal"])
def test_generator_is_deterministic_per_seed(name):
    a, b, c = D.generate(name, seed=3, n_episodes=6), D.generate(name, seed=3, n_episodes=6), \
        D.generate(name, seed=4, n_episodes=6)
    for k in D.KEYS:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["actions"][:10], c["actions"][:10])


# A CEM search small enough for a test (the real one: D.HC_CEM, about 100 s).
# init_std is small so that its search mean stays near the zero-action policy, which beats random actions.
TINY_CEM = {"generations": 3, "pop": 6, "elites": 2, "keep": 2, "eval_episodes": 2, "init_std": 0.05}
DIMS = {"pendulum": (3, 1), "toy": (2, 2), "halfcheetah": (17, 6), "hopper": (11, 3)}
LOCOMOTION_SETS = [n for n in D.DATASETS if D.env_of(n) in D.LOCOMOTION]


@pytest.fixture
def tiny_cem(tmp_path, monkeypatch):
    """Point the locomotion behaviour policies at a tiny CEM search cached in a temporary folder."""
    monkeypatch.setattr(D, "HC_CEM", TINY_CEM)
    monkeypatch.setattr(D, "_REF_CACHE", {})
    monkeypatch.setenv("OFFLINE_DATA_DIR", str(tmp_path))
    return tmp_path


def _layout(name, n_episodes):
    d = D.generate(name, seed=0, n_episodes=n_episodes)
    n = len(d["rewards"])
    obs_dim, act_dim = DIMS[D.env_of(name)]
    assert d["observations"].shape == d["next_observations"].shape == (n, obs_dim)
    assert d["actions"].shape == (n, act_dim) and np.abs(d["actions"]).max() <= 1
    for k in D.KEYS:
        assert d[k].dtype == np.float32, k
    D.check_dataset(d)
    ends = (d["terminals"] + d["timeouts"]) > 0
    cont = ~ends[:-1]  # inside an episode, the next row starts where this one ended
    np.testing.assert_array_equal(d["next_observations"][:-1][cont], d["observations"][1:][cont])
    assert ends[-1] and ends.sum() == n_episodes  # exactly one end per episode
    meta = d["meta"]
    assert meta["ref_expert_return"] > meta["ref_random_return"] and meta["n_transitions"] == n
    return d


@pytest.mark.parametrize("name", [n for n in D.DATASETS if n not in LOCOMOTION_SETS])
def test_layout_shapes_dtypes_and_continuity(name):
    _layout(name, 8)


@pytest.mark.parametrize("name", LOCOMOTION_SETS)
def test_locomotion_layout(name, tiny_cem):
    d = _layout(name, 2)
    # halfcheetah never falls: two full-length episodes ending in timeouts
    assert d["terminals"].sum() == 0 and np.flatnonzero(d["timeouts"]).tolist() == [999, 1999]
    if name.endswith("medium-replay"):  # recorded CEM episodes, all from generations up to the medium one
        assert d["meta"]["medium_generation"] < TINY_CEM["generations"]


def test_halfcheetah_degraded_episodes_are_random(tiny_cem):
    """rho = 1 replaces every episode of a locomotion set with random actions: its return drops to random's."""
    clean = D.generate("halfcheetah-expert", seed=0, n_episodes=4)["meta"]
    bad = D.generate("halfcheetah-expert", seed=0, n_episodes=4, rho=1.0)["meta"]
    assert bad["behaviour_return_mean"] < clean["behaviour_return_mean"] - 100
    assert abs(bad["behaviour_return_mean"] - bad["ref_random_return"]) < 150  # random episodes vary by ~100


@pytest.mark.parametrize("env_name,gym_id", [("halfcheetah", "HalfCheetah-v5"), ("hopper", "Hopper-v5")])
def test_locomotion_matches_gymnasium(env_name, gym_id):
    """Same dynamics, observation, reward and termination as gymnasium's v5 environment (from its reset state),
    over several episodes of random actions (a random hopper falls within a few dozen steps)."""
    import mujoco

    env = gym.make(gym_id).unwrapped
    ours = D.MujocoBatch(env_name, 1)
    rng, falls = np.random.default_rng(0), 0
    for episode in range(5):
        obs, _ = env.reset(seed=episode)
        d = ours.data[0]
        d.qpos[:], d.qvel[:] = env.data.qpos, env.data.qvel
        mujoco.mj_forward(ours.model, d)
        np.testing.assert_allclose(ours.obs()[0], obs, atol=1e-6)
        for _ in range(100):
            a = rng.uniform(-1, 1, ours.act_dim).astype(np.float32)
            nxt, r, term, _, _ = env.step(a)
            mnxt, mr, mterm = ours.step(a[None])
            np.testing.assert_allclose(mnxt[0], nxt, atol=1e-5)
            np.testing.assert_allclose(mr[0], r, atol=1e-4)
            assert mterm[0] == term
            if term:
                falls += 1
                break
    assert falls == (5 if env_name == "hopper" else 0)


def test_cem_policies_are_cached_and_ordered(tiny_cem):
    pol = D.locomotion_policies("halfcheetah")
    cem = pol["cem"]
    assert cem["means"].shape == (3, 108) and len(cem["eval_returns"]) == 3
    assert pol["medium_generation"] <= pol["expert_generation"]
    assert np.array_equal(pol["expert"], cem["means"][np.argmax(cem["eval_returns"])])
    assert len(cem["replay_rewards"]) == 3 * TINY_CEM["keep"] * D.LOCO_HORIZON
    assert len(list(tiny_cem.glob("halfcheetah-cem-*.npz"))) == 1
    again = D.locomotion_policies("halfcheetah")  # from the cache: same arrays, no second search
    np.testing.assert_array_equal(again["expert"], pol["expert"])
    assert len(list(tiny_cem.glob("halfcheetah-cem-*.npz"))) == 1


def test_terminals_vs_timeouts():
    p = D.generate("pendulum-expert", seed=0, n_episodes=3)
    assert p["terminals"].sum() == 0  # pendulum never terminates: only time limits
    assert np.flatnonzero(p["timeouts"]).tolist() == [199, 399, 599]
    t = D.generate("toy-multimodal", seed=0, n_episodes=40)
    term, tout = t["terminals"] > 0, t["timeouts"] > 0
    assert term.any() and tout.any() and not (term & tout).any()
    assert np.all(t["rewards"][term] == 1.0) and np.all(t["rewards"][~term] == -D.T_COST)
    dist = np.linalg.norm(t["next_observations"][term][:, None] - D.T_GOALS[None], axis=-1).min(1)
    assert np.all(dist < D.T_RADIUS)


def test_pendulum_model_matches_gymnasium():
    env = gym.make("Pendulum-v1").unwrapped
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.uniform(-1, 1, (1,)).astype(np.float32)
        nxt, r, *_ = env.step(2.0 * a)
        mnxt, mr = D.pendulum_model(obs[None], a[None])
        np.testing.assert_allclose(mnxt[0], nxt, atol=1e-5)
        np.testing.assert_allclose(mr[0], r, atol=1e-4)
        obs = nxt


def test_normalised_scores_of_reference_policies():
    lo, hi = D.reference_returns("pendulum")
    assert D.normalized_score("pendulum", lo) == pytest.approx(0.0)
    assert D.normalized_score("pendulum", hi) == pytest.approx(100.0)
    assert D.d4rl_score("pendulum", hi) is None and D.d4rl_score("halfcheetah", 12135.0) == pytest.approx(100.0)


def test_degraded_variant_is_worse():
    clean = D.generate("toy-multimodal", seed=0, n_episodes=100, rho=0.0)["meta"]["behaviour_score"]
    bad = D.generate("toy-multimodal", seed=0, n_episodes=100, rho=0.5)["meta"]["behaviour_score"]
    assert bad < clean - 20


def test_cache_reused_and_corruption_regenerated(tmp_path, monkeypatch):
    d1 = D.get_dataset("pendulum-random", seed=1, n_episodes=4, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    assert len(json.loads(next(tmp_path.glob("*.json")).read_text())["sha256"]) == 64
    real_generate = D.generate
    monkeypatch.setattr(D, "generate", lambda *a, **k: pytest.fail("cache not reused"))
    d2 = D.get_dataset("pendulum-random", seed=1, n_episodes=4, cache_dir=tmp_path)
    np.testing.assert_array_equal(d1["actions"], d2["actions"])
    npz = next(tmp_path.glob("*.npz"))
    npz.write_bytes(npz.read_bytes()[:200])  # truncated file
    monkeypatch.setattr(D, "generate", real_generate)
    with pytest.warns(UserWarning, match="corrupt"):
        d3 = D.get_dataset("pendulum-random", seed=1, n_episodes=4, cache_dir=tmp_path)
    np.testing.assert_array_equal(d1["actions"], d3["actions"])
    d4 = D.get_dataset("pendulum-random", seed=1, n_episodes=4, cache_dir=tmp_path)  # clean again
    np.testing.assert_array_equal(d1["observations"], d4["observations"])


def test_bad_inputs_have_clear_messages():
    with pytest.raises(ValueError, match="unknown dataset 'pendulum-great'"):
        D.generate("pendulum-great")
    with pytest.raises(ValueError, match="rho must be in"):
        D.generate("toy-multimodal", rho=1.5)
    d = D.generate("toy-multimodal", n_episodes=4)
    del d["timeouts"]
    with pytest.raises(ValueError, match="missing keys"):
        D.check_dataset(d)
    d = D.generate("toy-multimodal", n_episodes=4)
    d["rewards"] = d["rewards"].copy()
    d["rewards"][0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        D.check_dataset(d)
