"""worldmodels/ffdc.py: the Mixture-of-Horizon loss against a per-window loop, the perturbed world, gated
execution against fixed chunks (with the true dynamics as the world action model), detection of a perturbation
inside a chunk in a hand-made episode, and a short run of the script (gated execution needs fewer model calls
than 2-step chunks)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worldmodels import ffdc
from worldmodels._envs import GOAL, OBJECT, EnvConfig, GridWorld, agent_cells

CFG = EnvConfig(wall_density=0.0)


class Oracle:
    """The true dynamics and the shortest-path expert as a world action model: its predicted frames are exact."""

    def chunk(self, x, h):
        f = x.numpy()
        env = GridWorld(EnvConfig(map_size=f.shape[-1], wall_density=0.0), len(f), seed=0)
        env.set_state((f[:, 0] > 0.5, f[:, 1].copy(), agent_cells(f, env.cfg), ffdc.goal_cells(f)))
        acts, frames = [], []
        for _ in range(h):
            a = ffdc.expert_actions(env)
            env.step(a)
            acts.append(a)
            frames.append(env.render())
        return np.stack(acts, 1), torch.from_numpy(np.stack(frames, 1))


def world(n=64, rate=0.0, kind="both", seed=5):
    return ffdc.PerturbedWorld(CFG, n, seed, rate, kind)


def run(chunk, verify=None, rate=0.0, kind="both", slack=2, n=64, wam=None, predict=None):
    env = world(n, rate, kind)
    return ffdc.execute(wam or Oracle(), env, chunk, ffdc.budgets(env, slack), verify, predict=predict)


NEVER = lambda p, o: np.zeros(len(p), bool)  # noqa: E731
ALWAYS = lambda p, o: np.ones(len(p), bool)  # noqa: E731


# ---- eq. (2) ----
def test_moh_loss_matches_a_loop_over_windows():
    torch.manual_seed(0)
    fr, eff, lab = ffdc.collect_expert(CFG, 6, 8, 0.3, seed=1)
    frames, effs, labels = (torch.from_numpy(a) for a in (fr, eff, lab))
    model = ffdc.WorldActionModel(8)
    gen = torch.Generator().manual_seed(0)
    rows, t0, h = ffdc.sample_windows((1, 2, 4), 24, 6, 8, gen)
    assert [int((h == k).sum()) for k in (1, 2, 4)] == [8, 4, 2]  # equal transitions per horizon
    loss, _ = ffdc.moh_loss(model, frames, effs, labels, rows, t0, h, "snap")
    per_h = {1: [], 2: [], 4: []}
    for r, s, hh in zip(rows.tolist(), t0.tolist(), h.tolist()):
        x, total = frames[r, s][None], 0.0
        for j in range(hh):
            total += F.cross_entropy(model.policy(x), labels[r, s + j][None])
            logits = model.dynamics(x, effs[r, s + j][None])
            total += F.binary_cross_entropy_with_logits(logits, frames[r, s + j + 1][None])
            x = ffdc.snap(torch.sigmoid(logits))
        per_h[hh].append(total / hh)
    naive = sum(torch.stack(v).mean() for v in per_h.values()) / 3
    torch.testing.assert_close(loss, naive, rtol=1e-5, atol=1e-6)


def test_single_horizon_is_teacher_forcing():
    torch.manual_seed(0)
    fr, eff, lab = ffdc.collect_expert(CFG, 4, 6, 0.3, seed=2)
    frames, effs, labels = (torch.from_numpy(a) for a in (fr, eff, lab))
    model = ffdc.WorldActionModel(8)
    rows, t0, h = ffdc.sample_windows((1,), 10, 4, 6, torch.Generator().manual_seed(1))
    loss, _ = ffdc.moh_loss(model, frames, effs, labels, rows, t0, h)
    x = frames[rows, t0]
    tf = (F.cross_entropy(model.policy(x), labels[rows, t0])
          + F.binary_cross_entropy_with_logits(model.dynamics(x, effs[rows, t0]), frames[rows, t0 + 1]))
    torch.testing.assert_close(loss, tf, rtol=1e-5, atol=1e-6)


# ---- the world ----
def test_rate_zero_is_the_plain_gridworld_and_slips_never_go_where_commanded():
    plain, pert = GridWorld(CFG, 32, seed=3), ffdc.PerturbedWorld(CFG, 32, 3, 0.0, "both")
    rng = np.random.default_rng(0)
    for _ in range(10):
        a = rng.integers(0, 4, 32)
        np.testing.assert_array_equal(plain.step(a), pert.step(a))
    np.testing.assert_array_equal(plain.render(), pert.render())
    slip = ffdc.PerturbedWorld(CFG, 64, 4, 1.0, "slip")
    for _ in range(5):
        a = rng.integers(0, 4, 64)
        before = slip.pos.copy()
        eff = slip.step(a)
        assert not (eff == a).any(), "a slip replaced a commanded move"
        moved = (slip.pos != before).any(1)
        assert (eff[moved] < 4).all()


def test_goal_moves_to_a_free_neighbour():
    env = ffdc.PerturbedWorld(CFG, 64, 6, 1.0, "goal")
    for _ in range(5):
        old = env.goal.copy()
        env.step(np.full(64, 4))
        step = np.abs(env.goal - old).sum(1)
        assert set(step.tolist()) <= {0, 1} and step.sum() > 32
        assert ((env.objects == GOAL).sum((1, 2)) == 1).all() and ((env.objects == OBJECT).sum((1, 2)) == 2).all()
        assert not env.walls[np.arange(64), env.goal[:, 0], env.goal[:, 1]].any()


def test_deviated_label():
    env = GridWorld(CFG, 2, seed=0)
    obs = env.render()
    assert not ffdc.deviated(obs, obs, CFG).any()
    moved = obs.copy()
    moved[0, 2] = np.roll(obs[0, 2], 1, axis=1)  # the agent one cell to the right
    blurred = obs.copy()
    blurred[1, 2] *= 0.4  # no cell >= 0.5: the prediction has lost the agent
    np.testing.assert_array_equal(ffdc.deviated(np.stack([moved[0], blurred[1]]), obs, CFG), [True, True])


# ---- execution, eq. (5) ----
def test_no_perturbation_gated_never_replans_early_and_matches_long_chunks():
    long = run(8)
    for verify in (ffdc.fixed_verifier(1 / 300), NEVER):
        gated = run(8, verify)
        assert (gated["early"] == 0).all()
        for k in ("calls", "steps", "success", "evals"):
            np.testing.assert_array_equal(gated[k], long[k])
    assert long["success"].mean() == 1.0  # the expert always arrives within distance + slack


def test_gating_degenerate_cases():
    """A verifier that never fires is the long-chunk arm; one that always fires is the 1-step arm."""
    for rate in (0.0, 0.3):
        a, b = run(8, NEVER, rate), run(8, None, rate)
        for k in ("calls", "steps", "success"):
            np.testing.assert_array_equal(a[k], b[k])
        a, b = run(8, ALWAYS, rate), run(1, None, rate)
        for k in ("calls", "steps", "success"):
            np.testing.assert_array_equal(a[k], b[k])


def test_long_open_loop_chunks_fail_under_perturbation_and_gating_does_not():
    short, long = run(2, rate=0.3, n=200), run(8, rate=0.3, n=200)
    gated = run(8, ffdc.fixed_verifier(1 / 300), rate=0.3, n=200)
    assert long["success"].mean() < short["success"].mean() - 0.1
    assert gated["success"].mean() >= short["success"].mean()
    assert gated["calls"].mean() < short["calls"].mean()


def hand_made(kind: str, at: int = 3):
    """One 10x10 episode, agent at (5, 1), goal at (5, 8), a perturbation of `kind` at step `at` only."""
    env = ffdc.PerturbedWorld(CFG, 1, 0, 1.0, kind)
    walls = np.zeros((1, 10, 10), bool)
    walls[:, 0, :] = walls[:, -1, :] = walls[:, :, 0] = walls[:, :, -1] = True
    objects = np.zeros((1, 10, 10), np.float32)
    objects[0, 5, 8], objects[0, 2, 2], objects[0, 8, 3] = GOAL, OBJECT, OBJECT
    env.set_state((walls, objects, np.array([[5, 1]]), np.array([[5, 8]])))
    env.u[:] = 1.0
    env.u[at] = 0.0  # the perturbation
    env.turn[at], env.nb[at] = 1, 0  # a slip turns "right" (3) into (3 + 1) % 4 = up; the goal tries up first
    return env


@pytest.mark.parametrize("kind", ["slip", "goal"])
def test_perturbation_inside_a_chunk_is_detected_at_once(kind):
    """Detected on the very step it happens (0 steps late) with exact predictions, then replanned: the second
    model call comes right after it, and the agent still arrives within distance + 2."""
    env = hand_made(kind)
    out = ffdc.execute(Oracle(), env, 8, np.array([9]), ffdc.fixed_verifier(1 / 300))
    assert out["first_flag"][0] == 3 and out["early"][0] == 1 and out["calls"][0] == 2 and out["success"][0] == 1
    blind = ffdc.execute(Oracle(), hand_made(kind), 8, np.array([9]))
    assert blind["calls"][0] == 2 and blind["steps"][0] == 9
    if kind == "slip":  # the rest of the open-loop chunk walks past the goal's row and then waits: too late
        assert blind["success"][0] == 0


# ---- what execution costs: calls, imagined steps, verifier evaluations, multiply-accumulates ----
def test_counts_of_model_calls_imagined_steps_and_verifier_evaluations():
    """Against a per-episode count: a verifier that never fires is asked at every executed step that leaves actions
    to throw away (not at a chunk's last position, not on the step that reaches the goal); one that always fires is
    asked exactly where it replans; each call imagines `predict` steps, whether or not they are executed.
    Planted on a copy: the verifier evaluations counted at every active step -> the first check fails."""
    for rate in (0.0, 0.3):
        out = run(8, NEVER, rate)
        naive = [sum(1 for t in range(s) if t % 8 != 7) - int(ok and (s - 1) % 8 != 7)
                 for s, ok in zip(out["steps"], out["success"])]
        np.testing.assert_array_equal(out["verifier_evals"], naive)
        np.testing.assert_array_equal(out["evals"], 8 * out["calls"])
        always = run(8, ALWAYS, rate)
        np.testing.assert_array_equal(always["verifier_evals"], always["early"])
        assert (run(8, None, rate)["verifier_evals"] == 0).all()


def test_short_of_long_is_short_chunks_at_the_cost_of_long_ones():
    """The same-cost baseline: each call predicts 8 steps (what a gated call costs) and executes 2. Its actions are
    the first 2 of an 8-step rollout, so calls, steps and success equal the 2-step arm's, at 4x the imagined steps."""
    for rate in (0.0, 0.3):
        short, same_cost = run(2, None, rate), run(2, None, rate, predict=8)
        for k in ("calls", "steps", "success"):
            np.testing.assert_array_equal(short[k], same_cost[k])
        np.testing.assert_array_equal(same_cost["evals"], 8 * same_cost["calls"])
        np.testing.assert_array_equal(short["evals"], 2 * short["calls"])


def test_forward_macs_against_a_hand_count():
    """Verifier(4) on 10x10 frames: four 3x3 convolutions 9 -> 4 -> 4 -> 4 -> 1 channels over 100 cells; the WAM's
    imagined step, its policy (conv stack, spatial softmax, two linear layers) and its dynamics; RolloutVerifier(4)
    on a chunk's 7 remaining transitions."""
    v = ffdc.Verifier(4)
    x = torch.zeros(1, 3, 10, 10)
    assert ffdc.forward_macs(v, lambda: v(x, x)) == 100 * 9 * (9 * 4 + 4 * 4 + 4 * 4 + 4 * 1)
    wam = ffdc.WorldActionModel(4)
    step = ffdc.forward_macs(wam, lambda: (wam.policy(x), wam.dynamics(x, torch.zeros(1, dtype=torch.long))))
    policy = 100 * 9 * (3 * 4 + 4 * 4 + 4 * 4 + 4 * 16) + 32 * 8 + 8 * 5
    dynamics = 100 * 9 * ((3 + 5 + 15) * 4 + 4 * 4 + 4 * 4 + 4 * 3)
    assert step == policy + dynamics
    rv = ffdc.RolloutVerifier(4)  # one transition net, 3 C + 5 C -> 4 -> 4 -> 4 -> 1, on each of the 7 transitions
    rest = (torch.zeros(1, 7, 3, 10, 10), torch.zeros(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.bool))
    assert ffdc.forward_macs(rv, lambda: rv(x, *rest)) == 7 * 100 * 9 * ((9 + 15) * 4 + 4 * 4 + 4 * 4 + 4 * 1)


# ---- the rollout verifier's label, eq. (3b) ----
class Drifting(Oracle):
    """The exact world action model, except that its imagined frame at chunk position `at` shows the agent one cell
    off: its own prediction drifts there, with no perturbation of the world."""

    def __init__(self, at: int):
        self.at = at

    def chunk(self, x, h):
        a, frames = super().chunk(x, h)
        if h > self.at:
            frames[:, self.at, 2] = torch.roll(frames[:, self.at, 2], 1, dims=-1)
        return a, frames


def labels(wam, env, chunk=8):
    rec = []
    ffdc.execute(wam, env, chunk, np.array([9]), record=rec)
    return [bool(r[2][0]) for r in rec], [bool(r[6][0]) for r in rec], rec


def test_rest_deviated_judges_the_rest_of_the_chunk():
    """A slip at step 3: the frame label fires at steps 3-7 (the chunk is not replanned), the rest-of-chunk label
    at steps 3-6 (step 7 ends the chunk: nothing rests), and neither after the next call. A prediction that drifts
    at chunk position 5 in an unperturbed world: the frame label fires at step 5 only, the rest label already at
    steps 0-4, while the frames still agree: what a frame check cannot see.
    Planted on a copy: the simulated remaining steps compared with the current predicted frame instead of theirs ->
    the slip case's rest label fires from step 0 (the simulated world has moved on from the current frame) and this
    test fails."""
    frame, rest, rec = labels(Oracle(), hand_made("slip"))
    assert frame[:8] == [False] * 3 + [True] * 5 and rest[:8] == [False] * 3 + [True] * 4 + [False]
    assert rec[0][3].shape == (1, 7, 3, 10, 10) and rec[0][5].tolist() == [[True] * 7]  # the rest of the chunk
    assert rec[6][5].tolist() == [[True] + [False] * 6]
    world = hand_made("slip")
    world.u[:] = 1.0  # no perturbation
    frame, rest, _ = labels(Drifting(5), world)  # 7 steps to the goal
    assert frame == [False] * 5 + [True, False] and rest == [True] * 5 + [False, False]


# ---- the learned verifiers, trained fast on exact predictions ----
class Log:
    def log(self, *a, **k):
        pass


@pytest.fixture(scope="module")
def oracle_verifiers():
    torch.manual_seed(0)
    args = ffdc.Args(channels=8, verifier_steps=150, verifier_episodes=96, batch_size=64, log_every=10_000)
    return ffdc.train_verifier(args, CFG, Oracle(), torch.Generator().manual_seed(0), Log())


def test_learned_verifiers_fire_on_deviations_and_gate_execution(oracle_verifiers):
    """Both learned verifiers, trained for a few seconds on perturbed 8-step chunks of the exact model: on held-out
    steps they find the deviations (recall > 0.8) with few false alarms (< 0.1), and gating 8-step chunks with them
    replans early under perturbation, beating open-loop 8-step chunks, and never replans without perturbation.
    Planted on a copy: learned_verifier (or rollout_verifier) accepting every step -> recall 0, no early replan:
    this test fails in seconds (the script's slow tests caught it only after a full training run)."""
    v, rv, tau, figs = oracle_verifiers
    for name in ("verifier_learned", "verifier_rollout_rest"):
        assert figs[f"{name}_recall"] > 0.8 and figs[f"{name}_false_alarm"] < 0.1, (name, figs)
    assert 0.05 < figs["verifier_deviated_frac"] < 0.95 and 0.05 < figs["rest_deviated_frac"] < 0.95
    long = run(8, None, 0.3, n=128)
    for verify in (ffdc.learned_verifier(v, 0.5), ffdc.rollout_verifier(rv, 0.5)):
        gated = run(8, verify, 0.3, n=128)
        assert gated["early"].mean() > 0.3 and gated["success"].mean() > long["success"].mean() + 0.1
        assert (gated["verifier_evals"] >= gated["early"]).all()
        assert (run(8, verify, 0.0)["early"] == 0).all()


# ---- the script ----
# the default WAM and verifier training; fewer test episodes and two perturbation rates
SMALL = dict(episodes=120, rates=(0.0, 0.3), verifier_episodes=128, save_png=False)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ffdc")
    summary = ffdc.main(ffdc.Args(out_dir=str(out), **SMALL))
    return summary, out


@pytest.mark.slow  # the default training and both verifiers, about 1 min of one core
@pytest.mark.extended  # the verifiers' learning and gating: test_learned_verifiers_fire_..., in the suite
def test_script_runs_and_gated_beats_short_chunks_on_model_calls(small_run):
    s, _ = small_run
    for r in (0.0, 0.3):
        assert s[f"gated_r{r}_calls"] < s[f"short_r{r}_calls"]
        assert s[f"gated_r{r}_calls"] >= s[f"long_r{r}_calls"]
    assert s["long_r0.3_success"] < s["short_r0.3_success"]  # long open-loop chunks fail under perturbation
    assert s["pred_dev_h1"] < 0.1  # the WAM's first imagined step is right


@pytest.mark.slow
@pytest.mark.extended
def test_learned_verifier_detects_the_hand_made_slip(small_run):
    """The trained WAM and learned verifier: never a replan on agreeing frames, and the slip of the hand-made
    episode detected within 1 step."""
    _, out = small_run
    wam, v, _ = ffdc.load_models(out, 16)
    learned = ffdc.learned_verifier(v, 0.5)
    env = world(64)
    exact = ffdc.execute(Oracle(), env, 8, ffdc.budgets(env, 2), learned)
    assert (exact["early"] == 0).all()
    flagged = ffdc.execute(wam, hand_made("slip"), 8, np.array([9]), learned)["first_flag"][0]
    assert 3 <= flagged <= 4


def test_bad_arguments():
    with pytest.raises(SystemExit, match="horizons"):
        ffdc.check_args(ffdc.Args(horizons=(0, 2)))
    with pytest.raises(SystemExit, match="short-chunk"):
        ffdc.check_args(ffdc.Args(short_chunk=8, long_chunk=4))
    with pytest.raises(SystemExit, match="modes"):
        ffdc.check_args(ffdc.Args(modes=("medium",)))
    with pytest.raises(SystemExit, match="rates"):
        ffdc.check_args(ffdc.Args(rates=(1.5,)))
