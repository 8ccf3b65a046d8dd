"""kernels/tree_verify_attention.py: the ancestor mask from a parent array (chain, star, two-level tree), the
reference against dense masked SDPA, the kernel (Triton's interpreter on CPU) against the reference in values and
gradients, a chain tree against ordinary causal attention, bad input."""
import pytest
import torch
import torch.nn.functional as F

import kernels.tree_verify_attention as K
from _kernel_check import DEV, assert_close_to_gold, gold_dtype, interpret, poison  # noqa: F401

CHAIN = [-1, 0, 1, 2, 3]
STAR = [-1, -1, -1, -1]
TWO_LEVEL = [-1, 0, 0, 1, 1, 2, 2]  # a root, its two children, two grandchildren under each


def _random_parents(B, T, g):
    """Random topologically ordered forests: parents[i] uniform in -1..i-1."""
    return torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(T)])
                        for _ in range(B)])


def _inputs(B, H, P, T, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, H, P + T, D, generator=g) for _ in range(2))
    do = torch.randn(B, H, T, D, generator=g).to(device)
    return [x.to(dtype).to(device) for x in (q, k, v)], _random_parents(B, T, g).to(device), do


def _run(fn, xs, parents, do, dtype=None):
    xs = [x.detach().clone().to(dtype or x.dtype).requires_grad_() for x in xs]
    o = fn(*xs, parents)
    (o * do.to(o.dtype)).sum().backward()
    return [o.detach()] + [x.grad for x in xs]


def test_ancestor_mask_hand_built():
    chain = K.ancestor_mask(torch.tensor([CHAIN]))[0]
    assert torch.equal(chain, torch.ones(5, 5, dtype=torch.bool).tril())  # a chain is causal
    assert torch.equal(K.ancestor_mask(torch.tensor([STAR]))[0], torch.eye(4, dtype=torch.bool))
    two = K.ancestor_mask(torch.tensor([TWO_LEVEL]))[0]
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 2, 6}}
    for i, anc in expect.items():
        assert set(two[i].nonzero().flatten().tolist()) == anc, i
    assert K.tree_depths(torch.tensor([TWO_LEVEL]))[0].tolist() == [1, 2, 2, 3, 3, 3, 3]
    m = K.tree_attention_mask(torch.tensor([TWO_LEVEL, CHAIN + [4, 5]]), prefix_len=3)
    assert m.shape == (2, 7, 10) and m[:, :, :3].all() and torch.equal(m[0, :, 3:], two)


def test_bitmask_packs_every_bit():
    g = torch.Generator().manual_seed(3)
    anc = K.ancestor_mask(_random_parents(2, 70, g))  # three words a row, bit 31 included
    bits = K.ancestor_bits(anc)
    assert bits.shape == (2, 70, 3) and bits.dtype == torch.int32
    j = torch.arange(70)
    unpacked = (bits.long()[..., j // 32] >> (j % 32)) & 1
    assert torch.equal(unpacked.bool(), anc)
    slow = torch.zeros_like(anc)  # row i = row parent(i) plus i, node by node
    parents = _random_parents(2, 70, torch.Generator().manual_seed(3))
    for b in range(2):
        for i in range(70):
            if parents[b, i] >= 0:
                slow[b, i] = slow[b, parents[b, i]]
            slow[b, i, i] = True
    assert torch.equal(slow, anc)


def test_reference_equals_dense_masked_sdpa():
    (q, k, v), parents, _ = _inputs(2, 3, 6, 9, 16, torch.float64, "cpu", seed=1)
    mask = K.tree_attention_mask(parents, 6)[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(K.tree_verify_attention_ref(q, k, v, parents), o)


# (B, H, P, T, D): no prefix, a prefix shorter than a tile, a straddling one, trees past one 32-tile, odd D
SHAPES = [(1, 1, 0, 5, 16), (2, 2, 7, 11, 24), (1, 2, 37, 40, 16)]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference_values_and_gradients(shape, interpret, monkeypatch):
    poison(monkeypatch)
    xs, parents, do = _inputs(*shape, torch.float32, DEV)
    assert K._use_triton(*xs), "the kernel path must run in this test"
    out = _run(K.tree_verify_attention, xs, parents, do)
    eager = _run(K.tree_verify_attention_ref, xs, parents, do)
    gold = _run(K.tree_verify_attention_ref, xs, parents, do, gold_dtype(torch.float32))
    for name, o, e, gl in zip(["out", "d_q", "d_k", "d_v"], out, eager, gold):
        assert_close_to_gold(f"{name} {shape}", o, e, gl)


def test_chain_tree_is_causal_attention(interpret):
    """A chain of T nodes over a P-token prefix = the last T rows of causal attention over P + T tokens."""
    B, H, P, T, D = 1, 2, 9, 12, 16
    g = torch.Generator().manual_seed(2)
    q_all, k, v = (torch.randn(B, H, P + T, D, generator=g).to(DEV) for _ in range(3))
    o = K.tree_verify_attention(q_all[:, :, P:], k, v, torch.tensor([[-1] + list(range(T - 1))], device=DEV))
    ref = F.scaled_dot_product_attention(q_all, k, v, is_causal=True)[:, :, P:]
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-5)


def test_star_sees_prefix_and_itself(interpret):
    (q, k, v), _, _ = _inputs(1, 1, 4, 6, 16, torch.float32, DEV, seed=4)
    o = K.tree_verify_attention(q, k, v, torch.full((1, 6), -1, device=DEV))
    for i in range(6):
        kk, vv = torch.cat([k[:, :, :4], k[:, :, 4 + i:5 + i]], 2), torch.cat([v[:, :, :4], v[:, :, 4 + i:5 + i]], 2)
        torch.testing.assert_close(o[:, :, i:i + 1], F.scaled_dot_product_attention(q[:, :, i:i + 1], kk, vv),
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("parents,msg", [([[-1, 0, 2]], r"parents\[0, 2\] = 2"), ([[-1, 3, 0]], "come before"),
                                         ([[-2, 0, 1]], "-1 <= parents")])
def test_bad_parents_raise(parents, msg):
    (q, k, v), _, _ = _inputs(1, 1, 2, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=msg):
        K.tree_verify_attention(q, k, v, torch.tensor(parents))


def test_bad_shapes_raise():
    (q, k, v), parents, _ = _inputs(1, 2, 3, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"parents must be \[B, T\]"):
        K.tree_verify_attention(q, k, v, parents[:, :3])
    with pytest.raises(ValueError, match="P >= 0"):
        K.tree_verify_attention(q, k[:, :, :3], v[:, :, :3], parents)
    with pytest.raises(ValueError, match="k and v"):
        K.tree_verify_attention(q, k[..., :4], v[..., :4], parents)
    with pytest.raises(ValueError, match="integer"):
        K.tree_verify_attention(q, k, v, parents.float())


def test_precomputed_bits_are_used(interpret):
    xs, parents, _ = _inputs(1, 2, 5, 9, 16, torch.float32, DEV)
    bits = K.ancestor_bits(K.ancestor_mask(parents))
    torch.testing.assert_close(K.tree_verify_attention(*xs, parents, bits=bits), K.tree_verify_attention(*xs, parents))
    with pytest.raises(ValueError, match="bits must be int32"):
        K.tree_verify_attention(*xs, parents, bits=bits.long())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(2, 8, 1000, 64, 64), (1, 4, 256, 300, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(shape, dtype, monkeypatch):
    poison(monkeypatch)
    xs, parents, do = _inputs(*shape, dtype, "cuda")
    out = _run(K.tree_verify_attention, xs, parents, do)
    eager = _run(K.tree_verify_attention_ref, xs, parents, do)
    gold = _run(K.tree_verify_attention_ref, xs, parents, do, gold_dtype(dtype))
    for name, o, e, gl in zip(["out", "d_q", "d_k", "d_v"], out, eager, gold):
        assert_close_to_gold(f"{name} {shape} {dtype}", o, e, gl)
