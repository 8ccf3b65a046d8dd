"""worldmodels/diffusion_world_model.py: shapes, sampler, per-frame noise, learning, bad input."""
import pytest
import torch

from worldmodels import diffusion_world_model as dm


def test_shapes_and_sampler_range():
    torch.manual_seed(0)
    model = dm.Denoiser(context=2, channels=8)
    ctx, a = torch.rand(4, 2, 3, 10, 10) * 2 - 1, torch.randint(0, 5, (4,))
    out = model(torch.randn(4, 3, 10, 10), torch.full((4,), 0.5), ctx, torch.zeros(4, 2), a)
    assert out.shape == (4, 3, 10, 10)
    x = dm.sample_next(model, ctx, a, n_steps=3)
    assert x.shape == (4, 3, 10, 10) and x.min() >= -1 and x.max() <= 1
    roll = dm.rollout(model, torch.rand(4, 6, 3, 10, 10), torch.randint(0, 5, (4, 5)), 2, 5, 2)
    assert roll.shape == (4, 6, 3, 10, 10) and roll.min() >= 0 and roll.max() <= 1


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


def test_one_step_beats_copy_last_frame(tmp_path):
    s = dm.main(dm.Args(steps=400, batch_size=128, train_traj=300, eval_traj=64, eval_horizons=(1, 4),
                        train_horizon=4, out_dir=str(tmp_path), save_png=False))
    assert s["err_h1"] < s["copy_err_h1"], s


@pytest.mark.parametrize("kw,msg", [({"context": 0}, "context"), ({"denoise_steps": 0}, "denoise-steps"),
                                    ({"ctx_sigma_eval": -1.0}, "ctx-sigma-eval"), ({"eval_horizons": ()}, "eval-horizons")])
def test_bad_args(kw, msg):
    with pytest.raises(ValueError, match=msg):
        dm.check_args(dm.Args(**kw))
