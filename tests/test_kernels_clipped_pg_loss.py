"""kernels/clipped_pg_loss.py: loss, statistics and d logp against the eager reference."""
import pytest
import torch

import kernels.clipped_pg_loss as K
from _kernel_check import DEV, assert_close_to_gold, gold_dtype, interpret, poison  # noqa: F401

SHAPES = [(3, 7), (5, 33), (17, 100)]  # the last spans two programs of the interpreter's tile


def _inputs(B, T, dtype, device, per_token_adv, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g)      # ratios well outside [0.8, 1.28] on both sides
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    # garbage in the padding must not leak into the loss or the gradient
    logp = logp.masked_fill(~mask, float("inf"))
    old = old.masked_fill(~mask, float("nan"))
    return [x.to(device) for x in (logp.to(dtype), old.to(dtype), adv.to(dtype), mask, ref.to(dtype))]


def _run(fn, logp, old, adv, mask, ref, beta, reduction):
    lp = logp.detach().clone().requires_grad_()
    loss, stats = fn(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, ref_logp=ref if beta else None, beta=beta,
                     reduction=reduction)
    loss.backward()
    return loss.detach(), stats["pg"], stats["kl"], stats["clip_frac"], lp.grad


def _check(shape, dtype, per_token_adv, beta, reduction, device):
    logp, old, adv, mask, ref = _inputs(*shape, dtype, device, per_token_adv)
    assert K._use_triton(logp), "the kernel path must run in this test"
    out = _run(K.clipped_pg_loss, logp, old, adv, mask, ref, beta, reduction)
    eager = _run(K.clipped_pg_loss_ref, logp, old, adv, mask, ref, beta, reduction)
    gd = gold_dtype(dtype)
    gold = _run(K.clipped_pg_loss_ref, logp.to(gd), old.to(gd), adv.to(gd), mask, ref.to(gd), beta, reduction)
    assert 0.05 < gold[3].item() < 0.95, "inputs should exercise both the clipped and unclipped branches"
    for name, o, e, gl in zip(["loss", "pg", "kl", "clip_frac", "d_logp"], out, eager, gold):
        assert_close_to_gold(f"{name} {shape} {reduction} beta={beta}", o, e.to(o.dtype) if name != "d_logp" else e, gl)
    assert (out[4][~mask] == 0).all(), "padding must get zero gradient"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_token_adv,beta,reduction", [(False, 0.0, "token_mean"), (True, 0.05, "seq_mean"),
                                                          (False, 0.1, "seq_mean")])
def test_fp32_matches_reference(shape, per_token_adv, beta, reduction, interpret, monkeypatch):
    poison(monkeypatch)
    _check(shape, torch.float32, per_token_adv, beta, reduction, DEV)


def test_ratio_one_gives_reinforce_gradient(interpret, monkeypatch):
    """Degeneracy: on-policy (ratio 1) the clipped loss's gradient is REINFORCE's: -A w."""
    poison(monkeypatch)
    logp, _, adv, mask, _ = _inputs(4, 9, torch.float32, DEV, per_token_adv=False)
    logp = logp.masked_fill(~mask, 0.0).requires_grad_()
    loss, _ = K.clipped_pg_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    expected = -adv[:, None] * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected.float())


def test_backward_twice_through_retain_graph(interpret, monkeypatch):
    """The forward saves d loss / d logp; every backward scales that one tensor by grad_out, leaving it intact."""
    poison(monkeypatch)
    logp, old, adv, mask, ref = _inputs(5, 33, torch.float32, DEV, per_token_adv=True)
    lp = logp.detach().clone().requires_grad_()
    loss, _ = K.clipped_pg_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, ref_logp=ref, beta=0.05)
    loss.backward(retain_graph=True)
    g1 = lp.grad.clone()
    lp.grad = None
    loss.backward(retain_graph=True)
    torch.testing.assert_close(lp.grad, g1, rtol=0, atol=0)
    lp.grad = None
    (3.0 * loss).backward()                                # grad_out != 1 scales the saved gradient
    torch.testing.assert_close(lp.grad, 3.0 * g1)
    gold = _run(K.clipped_pg_loss_ref, logp.double(), old.double(), adv.double(), mask, ref.double(), 0.05,
                "token_mean")[4]
    torch.testing.assert_close(g1.double(), gold, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean"])
def test_float_mask_and_row_strided_inputs(reduction, interpret, monkeypatch):
    """A float mask and inputs that are column slices of wider tensors (row stride != T) are read in place."""
    poison(monkeypatch)
    logp, old, adv, mask, ref = _inputs(6, 40, torch.float32, DEV, per_token_adv=True, seed=3)
    wide = [torch.cat([x, torch.zeros_like(x[:, :8])], 1)[:, :40] for x in (logp, old, adv, mask.float(), ref)]
    assert wide[0].stride(0) == 48
    out = _run(K.clipped_pg_loss, *wide, 0.05, reduction)
    gold = _run(K.clipped_pg_loss_ref, *[x.double() for x in wide], 0.05, reduction)
    for o, gl in zip(out, gold):
        torch.testing.assert_close(o.double(), gl.double(), rtol=1e-5, atol=1e-7)


def test_statistics_are_deterministic(interpret, monkeypatch):
    """A fixed summation order (per-program partials, then one torch sum): bitwise equal results run to run."""
    poison(monkeypatch)
    logp, old, adv, mask, ref = _inputs(17, 100, torch.float32, DEV, per_token_adv=False)
    a = _run(K.clipped_pg_loss, logp, old, adv, mask, ref, 0.1, "seq_mean")
    b = _run(K.clipped_pg_loss, logp, old, adv, mask, ref, 0.1, "seq_mean")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bad_inputs_raise_clear_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        K.clipped_pg_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="reduction"):
        K.clipped_pg_loss(x, x, torch.zeros(2), x, reduction="mean")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(64, 4096)])
def test_bf16_on_gpu(shape, monkeypatch):
    poison(monkeypatch)
    _check(shape, torch.bfloat16, True, 0.05, "token_mean", "cuda")
