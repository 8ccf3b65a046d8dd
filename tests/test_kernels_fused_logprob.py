"""kernels/fused_logprob.py: forward and backward against the eager reference (CPU interpreter; bf16 on GPU)."""
import pytest
import torch

import kernels.fused_logprob as K
from _kernel_check import DEV, HAS_CUDA, assert_close_to_gold, gold_dtype, interpret, poison  # noqa: F401

# (N rows, H hidden, V vocab): odd sizes that do not divide the 16/64/128 tiles, one multi-tile case
SHAPES = [(5, 16, 17), (37, 24, 50), (70, 72, 300)]


def _inputs(N, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return [t.to(device) for t in (hidden.to(dtype), weight.to(dtype), targets, g_lp, g_ent)]


def _run(fn, hidden, weight, targets, g_lp, g_ent, temperature):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w, targets, temperature)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _check(shape, dtype, temperature, device):
    hidden, weight, targets, g_lp, g_ent = _inputs(*shape, dtype, device)
    assert K._use_triton(hidden), "the kernel path must run in this test"
    out = _run(K.fused_linear_logprob, hidden, weight, targets, g_lp, g_ent, temperature)
    eager = _run(K.fused_linear_logprob_ref, hidden, weight, targets, g_lp, g_ent, temperature)
    gd = gold_dtype(dtype)
    gold = _run(K.fused_linear_logprob_ref, hidden.to(gd), weight.to(gd), targets, g_lp.to(gd), g_ent.to(gd),
                temperature)
    for name, o, e, gl in zip(["logprob", "entropy", "d_hidden", "d_weight"], out, eager, gold):
        assert_close_to_gold(f"{name} {shape} {dtype}", o, e, gl)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_reference(shape, temperature, interpret, monkeypatch):
    poison(monkeypatch)
    _check(shape, torch.float32, temperature, DEV)


@pytest.mark.parametrize("rows_per_chunk", [1, 16])
def test_chunked_rows_match_reference(rows_per_chunk, interpret, monkeypatch):
    """Several chunks (one row each, or 16 with a ragged last one) give the same values and gradients."""
    poison(monkeypatch)
    monkeypatch.setattr(K, "CHUNK_ELEMENTS", rows_per_chunk * SHAPES[1][2])
    assert len(K._chunks(SHAPES[1][0], SHAPES[1][2])) == -(-SHAPES[1][0] // rows_per_chunk)
    _check(SHAPES[1], torch.float32, 0.7, DEV)


def test_ref_path_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets, _, _ = _inputs(4, 8, 11, torch.float32, "cpu")
    assert not K._use_triton(hidden)
    lp, ent = K.fused_linear_logprob(hidden, weight, targets)
    probs = torch.softmax(hidden @ weight.T, -1)
    torch.testing.assert_close(lp, probs.log().gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(ent, -(probs * probs.log()).sum(-1))


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="share H"):
        K.fused_linear_logprob(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        K.fused_linear_logprob(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(1000, 512, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(shape, dtype, monkeypatch):
    poison(monkeypatch)
    monkeypatch.setattr(K, "CHUNK_ELEMENTS", 256 * shape[2])  # the (1000, 512, 5000) case runs 4 chunks
    _check(shape, dtype, 1.0, "cuda")
