"""algos/_offline_data.py: determinism, D4RL layout, terminals vs timeouts, exact pendulum dynamics, cache; and the
plumbing the offline RL scripts share (tensors, minibatches, updates, networks, evaluation, summary, checks)."""
import json

import gymnasium as gym
import numpy as np
import pytest
import torch

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


# ---- the plumbing the offline RL scripts share ----
def test_load_tensors_normalises_states_with_the_dataset_statistics(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLINE_DATA_DIR", str(tmp_path))
    raw = D.get_dataset("toy-multimodal", seed=2)
    meta, t, mean, std = D.load_tensors("toy-multimodal", seed=2)
    assert meta["name"] == "toy-multimodal" and set(t) == set(D.KEYS)
    obs, nxt = raw["observations"].astype(np.float64), raw["next_observations"].astype(np.float64)
    np.testing.assert_allclose(mean.numpy(), obs.mean(0), atol=1e-5)
    np.testing.assert_allclose(std.numpy(), obs.std(0, ddof=1) + 1e-3, rtol=1e-4)
    np.testing.assert_allclose(t["observations"].numpy(), (obs - obs.mean(0)) / (obs.std(0, ddof=1) + 1e-3),
                               atol=1e-4)
    np.testing.assert_allclose(t["next_observations"].numpy(), (nxt - obs.mean(0)) / (obs.std(0, ddof=1) + 1e-3),
                               atol=1e-4)  # next states use the same statistics as states
    np.testing.assert_array_equal(t["actions"].numpy(), raw["actions"])
    _, t_raw, mean0, std0 = D.load_tensors("toy-multimodal", seed=2, normalize=False)
    np.testing.assert_array_equal(t_raw["observations"].numpy(), raw["observations"])
    assert (mean0 == 0).all() and (std0 == 1).all()


def test_sample_draws_whole_rows():
    n = 50
    t = {k: torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3) * (i + 1) for i, k in enumerate(D.KEYS)}
    t["rewards"], t["terminals"] = torch.arange(n, dtype=torch.float32) * 3, torch.arange(n, dtype=torch.float32) * 5
    s, a, r, s2, d = D.sample(t, 64)
    assert s.shape == (64, 3) and r.shape == (64,)
    row = s[:, 0]
    for x, mult in ((a[:, 0], 2), (r, 3), (s2[:, 0], 4), (d, 5)):
        torch.testing.assert_close(x, row * mult)  # every key from the same row


def test_update_and_soft_update():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):  # gradients do not pile up across steps
        before = w.detach().clone()
        D.update(opt, (w ** 2).sum())
        torch.testing.assert_close(w.detach(), before - 0.1 * 2 * before)
    torch.manual_seed(0)
    net, tgt = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    old = [p.detach().clone() for p in tgt.parameters()]
    D.soft_update(((net, tgt),), 0.25)
    for p, pt, p0 in zip(net.parameters(), tgt.parameters(), old):
        torch.testing.assert_close(pt, p0 + 0.25 * (p - p0))
        assert not pt.requires_grad or pt.grad is None
    D.soft_update(((net, tgt),), 1.0)
    for p, pt in zip(net.parameters(), tgt.parameters()):
        torch.testing.assert_close(pt, p)


def test_networks_and_policy_fn():
    torch.manual_seed(0)
    actor, critic = D.Actor(3, 2, 16), D.Critic(3, 2, 16)
    s, a = torch.randn(7, 3) * 10, torch.rand(7, 2) * 2 - 1
    assert actor(s).shape == (7, 2) and actor(s).abs().max() <= 1
    q1, q2 = critic(s, a)
    assert q1.shape == q2.shape == (7,) and not torch.allclose(q1, q2)  # two independent heads
    torch.testing.assert_close(q1, critic.q1(torch.cat([s, a], -1)).squeeze(-1))
    mean, std = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([2.0, 0.5, 1.0])
    obs = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    out = D.policy_fn(actor, mean, std)(obs)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, actor((torch.as_tensor(obs) - mean) / std).detach().numpy(), rtol=1e-6)


def test_eval_policy_is_evaluate_and_its_score():
    args = D.OfflineArgs(eval_episodes=6, seed=3)
    pol = lambda o: D.toy_behaviour(o, (o[:, 0] > 0).astype(int), np.random.default_rng(0), 0.0)
    out = D.eval_policy("toy", pol, args, goals=True)
    ret, info = D.evaluate("toy", pol, 6, seed=10_003)
    assert out["eval/return"] == pytest.approx(ret.mean())
    assert out["eval/score"] == pytest.approx(D.normalized_score("toy", ret.mean()))
    assert out["eval/goal_left"] + out["eval/goal_right"] == pytest.approx(float((info["goal"] >= 0).mean()))
    assert set(D.eval_policy("toy", pol, args)) == {"eval/return", "eval/score"}


def test_summarise_and_save_curve(tmp_path):
    hist = [{"step": 0, "eval/score": 5.0, "eval/return": -3.0}, {"step": 10, "eval/score": 40.0, "eval/return": -1.0},
            {"step": 20, "eval/score": 30.0, "eval/return": -2.0}]
    s = D.summarise(hist, {"behaviour_score": 50.0}, t0=0.0, extra=7)
    assert list(s) == ["score_first", "score_last", "score_best", "return_last", "extra", "behaviour_score", "wall_s"]
    assert (s["score_first"], s["score_last"], s["score_best"], s["return_last"]) == (5.0, 30.0, 40.0, -2.0)
    assert s["extra"] == 7 and s["behaviour_score"] == 50.0 and s["wall_s"] > 0
    D.save_curve(tmp_path / "c.png", hist, "t")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kw,msg", [({"dataset": "hopper"}, "--dataset 'hopper'"), ({"eval_every": 0}, "--eval-every"),
                                    ({"gamma": 1.5}, "--gamma"), ({"policy_freq": 0}, "--policy-freq")])
def test_check_offline_args_names_the_flag(kw, msg):
    with pytest.raises(SystemExit, match=msg):
        D.check_offline_args(D.TD3Args(**kw), positive=("policy_freq",))
    D.check_offline_args(D.TD3Args(), positive=("policy_freq",))  # the defaults pass
