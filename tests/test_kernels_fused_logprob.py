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


def _run(fn, hidden, weight, targets, g_lp, g_ent, temperature, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w, targets, temperature, **kw)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _check(shape, dtype, temperature, device, ulps=16.0, **kw):
    """Values and both gradients against eager torch and a higher-precision gold. `ulps`: the error floor in ulps
    of the output's scale (the shared default, 16, lets bf16 be off by ~100% after the factor 8: tighten it)."""
    hidden, weight, targets, g_lp, g_ent = _inputs(*shape, dtype, device)
    assert K._use_triton(hidden), "the kernel path must run in this test"
    out = _run(K.fused_linear_logprob, hidden, weight, targets, g_lp, g_ent, temperature, **kw)
    eager = _run(K.fused_linear_logprob_ref, hidden, weight, targets, g_lp, g_ent, temperature)
    gd = gold_dtype(dtype)
    gold = _run(K.fused_linear_logprob_ref, hidden.to(gd), weight.to(gd), targets, g_lp.to(gd), g_ent.to(gd),
                temperature)
    for name, o, e, gl in zip(["logprob", "entropy", "d_hidden", "d_weight"], out, eager, gold):
        assert_close_to_gold(f"{name} {shape} {dtype} {kw}", o, e, gl, ulps=ulps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_reference(shape, temperature, interpret, monkeypatch):
    poison(monkeypatch)
    _check(shape, torch.float32, temperature, DEV)


CHUNKED = (37, 32, 500)  # N, H, V: 8-row chunks -> 8, 8, 8, 8 and a ragged 5


def _small_chunks(monkeypatch, rows=8, elem_bytes=4):
    monkeypatch.setattr(K, "MIN_CHUNK_ROWS", 1)
    return rows * CHUNKED[2] * elem_bytes  # a budget of `rows` rows of logits


@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_both_modes_in_chunks_match_reference(mode, interpret, monkeypatch):
    """Several chunks with a ragged last one, temperature != 1: values and both gradients equal the reference."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch)
    got_mode, chunks = K._plan(CHUNKED[0], CHUNKED[2], 4, mode, budget)
    assert got_mode == mode and [b - a for a, b in chunks] == [8, 8, 8, 8, 5]
    _check(CHUNKED, torch.float32, 0.7, DEV, mode=mode, budget_bytes=budget)


@pytest.mark.parametrize("rows", [1, 16])
def test_chunk_sizes_recompute(rows, interpret, monkeypatch):
    """One row per chunk, or 16 (37 rows -> 13, 12, 12: equal chunks, the last ragged), in RECOMPUTE mode."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch, rows)
    _, chunks = K._plan(CHUNKED[0], CHUNKED[2], 4, "recompute", budget)
    assert len(chunks) == -(-CHUNKED[0] // rows) and chunks[-1][1] == CHUNKED[0]
    assert all(b - a <= rows for a, b in chunks)
    _check(CHUNKED, torch.float32, 1.3, DEV, mode="recompute", budget_bytes=budget)


def test_half_precision_recompute_fp32_accumulator(interpret, monkeypatch):
    """bf16 in several RECOMPUTE chunks: d_weight goes through the fp32 accumulator (bf16 STORE on the GPU)."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch, 8, elem_bytes=2)
    _check(CHUNKED, torch.bfloat16, 0.7, DEV, ulps=1.0, mode="recompute", budget_bytes=budget)


def test_auto_mode_switch(interpret, monkeypatch):
    """auto: STORE when all N x V logits fit the budget, RECOMPUTE otherwise; chunks >= MIN_CHUNK_ROWS."""
    N, H, V = CHUNKED
    assert K._plan(N, V, 4, "auto", N * V * 4) == ("store", [(0, N)])
    mode, chunks = K._plan(N, V, 4, "auto", N * V * 4 - 1)
    assert mode == "recompute" and len(chunks) == 1  # MIN_CHUNK_ROWS (1024) > N: one chunk of all rows
    assert K._plan(16384, 151936, 2, "auto") == ("recompute", [(0, 5462), (5462, 10924), (10924, 16384)])
    assert K._plan(4096, 151936, 2, "auto")[0] == "store"
    assert K._plan(N, V, 4, "auto", 1, keep=False)[0] == "none"
    budget = _small_chunks(monkeypatch)
    hidden, weight, targets, _, _ = _inputs(*CHUNKED, torch.float32, DEV)
    for b, want in [(N * V * 4, "store"), (budget, "recompute")]:
        lp, _ = K.fused_linear_logprob(hidden.requires_grad_(), weight, targets, budget_bytes=b)
        fn = lp.grad_fn if hasattr(lp.grad_fn, "mode") else lp.grad_fn.next_functions[0][0]  # past the reshape
        assert fn.mode == want
    with torch.no_grad():
        lp, _ = K.fused_linear_logprob(hidden, weight, targets)
    assert lp.grad_fn is None
    with pytest.raises(ValueError, match="mode"):
        K.fused_linear_logprob(hidden, weight, targets, mode="stored")


def test_one_output_and_frozen_weight(interpret, monkeypatch):
    """Gradient through logprob alone, with the weight frozen: d_hidden equals the reference, d_weight is None."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch)
    hidden, weight, targets, g_lp, _ = _inputs(*CHUNKED, torch.float32, DEV)
    for mode in ["store", "recompute"]:
        grads = []
        for fn, kw in [(K.fused_linear_logprob, dict(mode=mode, budget_bytes=budget)),
                       (K.fused_linear_logprob_ref, {})]:
            h = hidden.detach().clone().requires_grad_()
            lp, _ = fn(h, weight, targets, 0.7, **kw)
            (lp * g_lp).sum().backward()
            grads.append(h.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_store_backward_twice_raises(interpret, monkeypatch):
    """STORE turns the kept logits into dz: a second backward says so; RECOMPUTE can backward twice."""
    hidden, weight, targets, _, _ = _inputs(*CHUNKED, torch.float32, DEV)
    h = hidden.requires_grad_()
    lp, _ = K.fused_linear_logprob(h, weight, targets, mode="store")
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute"):
        lp.sum().backward()
    h.grad = None
    lp, ent = K.fused_linear_logprob(h, weight, targets, mode="recompute", budget_bytes=_small_chunks(monkeypatch))
    (lp + ent).sum().backward(retain_graph=True)  # uses the forward's last chunk, then recomputes the others
    first = h.grad.clone()
    (lp + ent).sum().backward()                   # recomputes every chunk
    torch.testing.assert_close(h.grad, 2 * first)
    h.grad = None
    ref_lp, ref_ent = K.fused_linear_logprob_ref(h, weight, targets)
    (ref_lp + ref_ent).sum().backward()
    torch.testing.assert_close(first, h.grad, rtol=1e-4, atol=1e-5)


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
@pytest.mark.parametrize("mode", ["store", "recompute"])
def test_half_precision_on_gpu(shape, dtype, mode, monkeypatch):
    poison(monkeypatch)
    monkeypatch.setattr(K, "MIN_CHUNK_ROWS", 1)
    budget = 256 * shape[2] * 2  # the (1000, 512, 5000) case runs 4 chunks
    _check(shape, dtype, 1.0, "cuda", ulps=4.0, mode=mode, budget_bytes=budget)


@pytest.mark.gpu
def test_auto_mode_on_gpu_at_a_real_vocab(monkeypatch):
    """auto at V = 151936 picks STORE for 512 rows and RECOMPUTE (3 chunks) under a smaller budget."""
    poison(monkeypatch)
    shape = (512, 256, 151936)
    _check(shape, torch.bfloat16, 0.9, "cuda", ulps=4.0)
    monkeypatch.setattr(K, "MIN_CHUNK_ROWS", 128)
    _check(shape, torch.bfloat16, 0.9, "cuda", ulps=4.0, budget_bytes=200 * shape[2] * 2)


# ---- fused_linear_logprob_loss: gradients computed in the forward, for a loss known per row ----
def _grpo_like_token_loss(N, seed=1):
    """A per-row loss with per-row weights and a clipped ratio and entropy bonus (as grpo_loss writes it)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, generator=g) * 3
    adv, w = torch.randn(N, generator=g), torch.rand(N, generator=g) / N

    def token_loss(lp, ent, rows):
        ratio = torch.exp(lp - old[rows].to(lp.device))
        a = adv[rows].to(lp.device)
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        return (w[rows].to(lp.device) * (pg - 0.01 * ent)).sum()
    return token_loss


def _run_loss(fn, hidden, weight, targets, token_loss, temperature, grad_out=1.0, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, lp, ent = fn(h, w, targets, token_loss, temperature, **kw)
    (loss * grad_out).backward()
    return loss.detach().reshape(1), lp, ent, h.grad, w.grad


def _check_loss(shape, dtype, temperature, device, ulps=16.0, grad_out=1.0, **kw):
    hidden, weight, targets, _, _ = _inputs(*shape, dtype, device)
    token_loss = _grpo_like_token_loss(shape[0])
    assert K._use_triton(hidden), "the kernel path must run in this test"
    out = _run_loss(K.fused_linear_logprob_loss, hidden, weight, targets, token_loss, temperature, grad_out, **kw)
    eager = _run_loss(K.fused_linear_logprob_loss_ref, hidden, weight, targets, token_loss, temperature, grad_out)
    gd = gold_dtype(dtype)
    gold = _run_loss(K.fused_linear_logprob_loss_ref, hidden.to(gd), weight.to(gd), targets, token_loss,
                     temperature, grad_out)
    for name, o, e, gl in zip(["loss", "logprob", "entropy", "d_hidden", "d_weight"], out, eager, gold):
        assert_close_to_gold(f"loss-path {name} {shape} {dtype} {kw}", o, e, gl, ulps=ulps)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_loss_path_matches_reference(shape, interpret, monkeypatch):
    poison(monkeypatch)
    _check_loss(shape, torch.float32, 0.7, DEV)


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_loss_path_in_chunks(rows, interpret, monkeypatch):
    """Several chunks (one row each, 8 with a ragged last, 13/12/12): the per-chunk gradients add up to the
    reference's; a grad_out other than 1 scales both gradients."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch, rows)
    assert len(K._plan(CHUNKED[0], CHUNKED[2], 4, "recompute", budget)[1]) == -(-CHUNKED[0] // rows)
    _check_loss(CHUNKED, torch.float32, 1.3, DEV, grad_out=-2.5, budget_bytes=budget)


@pytest.mark.parametrize("dw_accum", ["fp32", "input"])
def test_loss_path_half_precision_chunks(dw_accum, interpret, monkeypatch):
    """bf16 in 37 one-row chunks, both d_weight accumulators within 8x eager's error (1-ulp floor). Their
    difference is below what this test sees: the bf16 rounding of dz dominates the max error (measured at
    200 chunks: max error equal within 25%, mean error 2x smaller with the fp32 accumulator)."""
    poison(monkeypatch)
    budget = _small_chunks(monkeypatch, 1, elem_bytes=2)
    _check_loss(CHUNKED, torch.bfloat16, 0.7, DEV, ulps=1.0,
                budget_bytes=budget, dw_accum=dw_accum)


def test_loss_path_frozen_weight_no_grad_and_errors(interpret, monkeypatch):
    budget = _small_chunks(monkeypatch)
    hidden, weight, targets, _, _ = _inputs(*CHUNKED, torch.float32, DEV)
    token_loss = _grpo_like_token_loss(CHUNKED[0])
    ref_loss, ref_lp, _ = K.fused_linear_logprob_loss_ref(hidden, weight, targets, token_loss)
    h = hidden.detach().clone().requires_grad_()
    loss, lp, ent = K.fused_linear_logprob_loss(h, weight, targets, token_loss, budget_bytes=budget)
    assert not lp.requires_grad and not ent.requires_grad and loss.requires_grad
    loss.backward()
    h_ref = hidden.detach().clone().requires_grad_()
    K.fused_linear_logprob_loss_ref(h_ref, weight, targets, token_loss)[0].backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="second forward"):
        loss.backward()
    with torch.no_grad():
        loss, lp, _ = K.fused_linear_logprob_loss(hidden, weight, targets, token_loss, budget_bytes=budget)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dw_accum"):
        K.fused_linear_logprob_loss(hidden, weight, targets, token_loss, dw_accum="bf16")
    with pytest.raises(TypeError, match="callable"):
        K.fused_linear_logprob_loss(hidden, weight, targets, "grpo")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_path_on_gpu(dtype, monkeypatch):
    poison(monkeypatch)
    monkeypatch.setattr(K, "MIN_CHUNK_ROWS", 1)
    shape = (1000, 512, 5000)
    _check_loss(shape, dtype, 1.0, "cuda", ulps=4.0, budget_bytes=256 * shape[2] * 2)  # 4 chunks
