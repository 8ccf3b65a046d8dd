"""kernels/dualkv_attention.py: outputs and gradients equal ordinary causal attention on the replicated layout;
packing helpers and the token reduction rho."""
import pytest
import torch
import torch.nn.functional as F

import kernels.dualkv_attention as K
from _kernel_check import DEV, assert_close_to_gold, gold_dtype, interpret, poison  # noqa: F401

# (B, N, H, P, R, D): odd P, R and D (24 pads to a 32-wide tile), prompts and responses longer than a 32-tile
SHAPES = [(1, 2, 1, 5, 3, 16), (2, 3, 2, 19, 11, 24), (1, 3, 1, 40, 37, 16)]


def _inputs(B, N, H, P, R, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = [torch.randn(B, H, P, D, generator=g).to(dtype).to(device) for _ in range(3)]
    resp = [torch.randn(B, N, H, R, D, generator=g).to(dtype).to(device) for _ in range(3)]
    d_out = (torch.randn(B, H, P, D, generator=g).to(device), torch.randn(B, N, H, R, D, generator=g).to(device))
    return prompt + resp, d_out


def _run(fn, xs, d_out, dtype=None):
    xs = [x.detach().clone().to(dtype or x.dtype).requires_grad_() for x in xs]
    op, orr = fn(*xs)
    ((op * d_out[0].to(op.dtype)).sum() + (orr * d_out[1].to(orr.dtype)).sum()).backward()
    return [op.detach(), orr.detach()] + [x.grad for x in xs]


NAMES = ["out_prompt", "out_responses", "d_q_prompt", "d_k_prompt", "d_v_prompt", "d_q_resp", "d_k_resp", "d_v_resp"]


def _check(shape, dtype, device):
    xs, d_out = _inputs(*shape, dtype, device)
    assert K._use_triton(*xs), "the kernel path must run in this test"
    out = _run(K.dualkv_attention, xs, d_out)
    eager = _run(K.dualkv_attention_ref, xs, d_out)
    gold = _run(K.dualkv_attention_ref, xs, d_out, gold_dtype(dtype))
    for name, o, e, gl in zip(NAMES, out, eager, gold):
        assert_close_to_gold(f"{name} {shape} {dtype}", o, e, gl)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_replicated_attention(shape, interpret, monkeypatch):
    poison(monkeypatch)
    _check(shape, torch.float32, DEV)


def test_equals_sdpa_on_replicated_layout(interpret):
    """The packed computation is ordinary causal attention (torch SDPA) on the N(P+R) layout, prompt included."""
    B, N, H, P, R, D = SHAPES[1]
    (qp, kp, vp, qr, kr, vr), _ = _inputs(B, N, H, P, R, D, torch.float32, DEV)
    op, orr = K.dualkv_attention(qp, kp, vp, qr, kr, vr)
    # replicated layout [B, N, P+R, H, D] built with the packing helpers, then [B*N, H, P+R, D] for SDPA
    q, k, v = (K.unpack_shared_prompt(p.transpose(1, 2), r.transpose(2, 3)) for p, r in ((qp, qr), (kp, kr), (vp, vr)))
    o = F.scaled_dot_product_attention(*(x.flatten(0, 1).transpose(1, 2) for x in (q, k, v)), is_causal=True)
    o = o.transpose(1, 2).reshape(B, N, P + R, H, D)
    for i in range(N):  # every replica's prompt rows equal the single packed prompt output
        torch.testing.assert_close(o[:, i, :P].transpose(1, 2), op, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(o[:, :, P:].transpose(2, 3), orr, atol=2e-5, rtol=1e-5)


def test_pack_unpack_and_token_reduction():
    B, N, P, R, Hd = 2, 4, 7, 3, 5
    prompt, resp = torch.randn(B, P, Hd), torch.randn(B, N, R, Hd)
    full = K.unpack_shared_prompt(prompt, resp)
    assert full.shape == (B, N, P + R, Hd)
    p2, r2 = K.pack_shared_prompt(full, P)
    assert torch.equal(p2, prompt) and torch.equal(r2, resp)
    assert full[..., 0].numel() / (p2[..., 0].numel() + r2[..., 0].numel()) == K.token_reduction(N, P, R)
    assert K.token_reduction(32, 8192, 1024) == pytest.approx(32 * 9216 / (8192 + 32 * 1024))
    full[1, 2, 0, 0] += 1.0
    with pytest.raises(ValueError, match="do not share"):
        K.pack_shared_prompt(full, P)


def test_bad_shapes_raise_clear_errors():
    (qp, kp, vp, qr, kr, vr), _ = _inputs(1, 2, 1, 4, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="share B, H, D"):
        K.dualkv_attention(qp, kp, vp, qr[..., :4], kr[..., :4], vr[..., :4])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(1, 8, 4, 1000, 300, 64), (2, 4, 2, 128, 64, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(shape, dtype, monkeypatch):
    poison(monkeypatch)
    _check(shape, dtype, "cuda")
