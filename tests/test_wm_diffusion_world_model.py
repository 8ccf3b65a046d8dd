"""worldmodels/diffusion_world_model.py: shapes, the sampler against a perfect denoiser, per-frame noise, learning,
bad input."""
import pytest
import torch

from worldmodels import diffusion_world_model as dm


def test_shapes():
    torch.manual_seed(0)
    model = dm.Denoiser(context=2, channels=8)
    ctx, a = torch.rand(4, 2, 3, 10, 10) * 2 - 1, torch.randint(0, 5, (4,))
    out = model(torch.randn(4, 3, 10, 10), torch.full((4,), 0.5), ctx, torch.zeros(4, 2), a)
    assert out.shape == (4, 3, 10, 10)
    assert dm.sample_next(model, ctx, a, n_steps=3).shape == (4, 3, 10, 10)
    roll = dm.rollout(model, torch.rand(4, 6, 3, 10, 10), torch.randint(0, 5, (4, 5)), 2, 5, 2)
    assert roll.shape == (4, 6, 3, 10, 10)


class Oracle(torch.nn.Module):
    """A perfect denoiser for known targets: predicts `target(ctx)` whatever the noisy input; logs its calls."""

    def __init__(self, target):
        super().__init__()
        self.target, self.sigmas, self.first_input = target, [], None

    def forward(self, x_noisy, sigma, ctx, ctx_sigma, action):
        if self.first_input is None:
            self.first_input = x_noisy.clone()
        self.sigmas.append(float(sigma[0]))
        return self.target(ctx).expand_as(x_noisy)


def _sample_with_oracle(n_steps: int):
    g = torch.Generator().manual_seed(0)
    x0 = 0.9 * (2 * torch.rand(4, 3, 10, 10, generator=g) - 1)  # inside (-1, 1): the final clamp never acts
    oracle = Oracle(lambda ctx: x0)
    x = dm.sample_next(oracle, torch.zeros(4, 2, 3, 10, 10), torch.zeros(4, dtype=torch.long), n_steps, gen=g)
    return x, x0, oracle


@pytest.mark.parametrize("n_steps", [1, 2, 3, 6])
def test_sampler_lands_on_a_perfect_denoisers_prediction(n_steps):
    """Eq. (4) with D(x; s) = x0: each Euler step shrinks x - x0 by s_{i+1} / s_i and the last one goes to s = 0,
    so the sample is x0 itself. The sampler clamps its output to [-1, 1]; x0 lies inside, so the clamp cannot
    hide a wrong update, a wrong noise schedule, a wrong starting noise or a missing last step."""
    x, x0, oracle = _sample_with_oracle(n_steps)
    assert oracle.sigmas == pytest.approx(dm.karras_sigmas(n_steps)[:-1])  # one call per step, noisiest first
    assert oracle.first_input.std().item() == pytest.approx(dm.SIGMA_MAX, rel=0.1)  # starts from noise at SIGMA_MAX
    torch.testing.assert_close(x, x0, atol=1e-5, rtol=0)


def test_a_sampler_that_stops_short_fails_the_same_check(monkeypatch):
    """Guards the test above: without the last step to s = 0 the sample keeps noise of about
    SIGMA_MIN / SIGMA_MAX of the starting noise (std ~2e-3), far inside [-1, 1], which a range check would pass."""
    full = dm.karras_sigmas
    monkeypatch.setattr(dm, "karras_sigmas", lambda n: full(n)[:-1])
    x, x0, _ = _sample_with_oracle(3)
    assert x.min() >= -1 and x.max() <= 1
    assert (x - x0).abs().max() > 1e-4


def test_rollout_feeds_samples_back_and_returns_frames_in_0_1():
    """A denoiser that copies the last context frame must reproduce x_0 at every step of the rollout: this pins
    the [0, 1] <-> [-1, 1] conversions and the context bookkeeping of `rollout`."""
    frames01 = (torch.rand(4, 6, 3, 10, 10) > 0.7).float()
    roll = dm.rollout(Oracle(lambda ctx: ctx[:, -1]), frames01, torch.randint(0, 5, (4, 5)), 2, 5, 3)
    torch.testing.assert_close(roll, frames01[:, :1].expand(-1, 6, -1, -1, -1), atol=1e-5, rtol=0)


class ContextRecorder(torch.nn.Module):
    """Logs the context and context noise levels the sampler hands the denoiser at every Euler step."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x_noisy, sigma, ctx, ctx_sigma, action):
        self.calls.append((ctx.clone(), ctx_sigma.clone()))
        return torch.zeros_like(x_noisy)


def test_sampling_conditions_on_clean_context_at_noise_level_zero():
    """Diffusion forcing's sampling: the past frames enter as they are, labelled noise level 0, the label its
    training gives the context frames it leaves clean (`noise_context`); only --ctx-sigma-eval noises them."""
    g = torch.Generator().manual_seed(0)
    ctx, a = torch.rand(4, 2, 3, 10, 10, generator=g) * 2 - 1, torch.zeros(4, dtype=torch.long)
    rec = ContextRecorder()
    dm.sample_next(rec, ctx, a, n_steps=3, gen=g)
    assert len(rec.calls) == 3
    for c, cs in rec.calls:
        torch.testing.assert_close(c, ctx, atol=0, rtol=0)
        assert (cs == 0).all()
    noisy, sig = dm.noise_context(ctx, torch.Generator().manual_seed(1))
    clean = sig == 0
    assert clean.any() and torch.equal(noisy[clean], ctx[clean])  # training's clean frames: untouched, label 0
    rec = ContextRecorder()
    dm.sample_next(rec, ctx, a, n_steps=2, ctx_sigma_eval=0.1, gen=g)
    (c1, cs1), (c2, _) = rec.calls
    assert (cs1 == 0.1).all() and torch.equal(c1, c2)  # one noise draw per sampled frame, labelled 0.1
    assert (c1 - ctx).std().item() == pytest.approx(0.1, rel=0.1)


def test_karras_sigmas():
    s = dm.karras_sigmas(3)
    assert len(s) == 4 and s[0] == pytest.approx(dm.SIGMA_MAX) and s[-2] == pytest.approx(dm.SIGMA_MIN)
    assert s[-1] == 0 and all(x > y for x, y in zip(s, s[1:]))


def test_noise_context_is_per_frame():
    g = torch.Generator().manual_seed(0)
    ctx = torch.zeros(2000, 2, 3, 4, 4)
    noisy, sig = dm.noise_context(ctx, g)
    assert sig.shape == (2000, 2)
    clean = sig == 0
    assert 0.4 < clean.float().mean() < 0.6  # half the frames stay clean
    assert (clean[:, 0] != clean[:, 1]).any()  # levels are drawn per frame, not per sample
    assert torch.equal(noisy[clean], ctx[clean]) and (noisy[~clean].abs().sum((-1, -2, -3)) > 0).all()


def test_loss_is_zero_for_a_perfect_denoiser():
    class Oracle(torch.nn.Module):
        def forward(self, x_noisy, sigma, ctx, ctx_sigma, action):
            return self.x0
    o = Oracle()
    o.x0 = torch.rand(3, 3, 10, 10)
    assert dm.diffusion_loss(o, o.x0, torch.zeros(3, 2, 3, 10, 10), torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)) == 0


def test_one_step_moves_the_agent(tmp_path):
    """A small trained instance samples the agent in the right cell one step ahead in at least 95% of test
    rollouts and beats copying the last frame in pixel MSE. With the action as one-hot planes only
    (--no-action-gate, the earlier default) the denoiser redrew the frame and lost the agent."""
    s = dm.main(dm.Args(steps=800, batch_size=128, train_traj=300, eval_traj=64, eval_horizons=(1, 4),
                        train_horizon=4, out_dir=str(tmp_path), save_png=False))
    assert s["agent_err_h1"] <= 0.05, s
    assert s["err_h1"] < s["copy_err_h1"], s


@pytest.mark.parametrize("kw,msg", [({"context": 0}, "context"), ({"denoise_steps": 0}, "denoise-steps"),
                                    ({"ctx_sigma_eval": -1.0}, "ctx-sigma-eval"), ({"eval_horizons": ()}, "eval-horizons")])
def test_bad_args(kw, msg):
    with pytest.raises(SystemExit, match=msg):
        dm.check_args(dm.Args(**kw))
