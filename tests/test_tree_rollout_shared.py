"""algos/tree_rollout_shared.py: the shared-token loss and gradient against the replicated-leaf loss (per-leaf and
per-token advantages, eager and SDPA attention, the sampler's truncated importance weight), attention without 4-D masks
refused, the update's sampler correction, one step equal to the parent's one-sequence-per-leaf step, --tree-attention
kernel (the Triton tree kernel through the interpreter, and its reference) equal to the mask path, bad input."""
import copy
import json
import math
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
import kernels.tree_verify_attention as K
from _kernel_check import DEV, interpret, poison  # noqa: F401 - interpret: a fixture (Triton's interpreter on CPU)
from _tree_policy import TablePolicy, tree_args
from algos import _llm as llm, tree_rollout_adv as ta, tree_rollout_grpo as tr, tree_rollout_shared as ts


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    return model, tok


@pytest.mark.parametrize("agg,per_token,kl,attn,is_w", [
    ("seq-mean", True, 0.0, "sdpa", False), ("token-mean", False, 0.1, "sdpa", False), ("const", True, 0.1, "sdpa", False),
    ("seq-mean", True, 0.1, "eager", False), ("seq-mean", False, 0.1, "sdpa", True), ("token-mean", True, 0.0, "sdpa", True)])
def test_shared_token_loss_equals_the_replicated_leaf_loss(tiny, agg, per_token, kl, attn, is_w):
    """Every tree token once, weighted by its leaves, gives the same loss and gradient as one sequence per leaf, with
    clipping active (old log-probs away from the current ones), from fewer forward tokens; under eager attention
    (which adds the mask to the scores) as under SDPA; with one advantage per leaf (the parent's) or per token
    (tree_rollout_adv.py's TreeRL, whose loss is the reference then); with the sampler's truncated importance weight
    per tree token (is_weight) as the parent's per leaf token."""
    model, tok = tiny
    model.set_attn_implementation(attn)
    try:
        _shared_equals_replicated(model, tok, agg, per_token, kl, is_w)
    finally:
        model.set_attn_implementation("sdpa")


def _shared_equals_replicated(model, tok, agg, per_token, kl, is_w=False):
    args = tree_args(ts, chains=2, rounds=2, branches=1, continuations=2, loss_agg=agg, kl_coef=kl, clip_eps_high=0.28)
    ids = [4, 5, 6, 7, 8]
    trees, _ = ts.grow_trees(TablePolicy(np.full((6, 5), 0.2), 6, ids=ids), [3] * 3, args, np.random.default_rng(1), len)
    prompts = [[1, 9, 10, 11], [1, 12, 13], [1, 14, 15, 16, 17]]
    leaves = [l for t in trees for l in t]
    B, C = len(leaves), max(len(l["tokens"]) for l in leaves)
    comp, mask = torch.full((B, C), tok.pad_token_id), torch.zeros(B, C)
    for i, l in enumerate(leaves):
        comp[i, :len(l["tokens"])], mask[i, :len(l["tokens"])] = torch.tensor(l["tokens"]), 1
    pids, pmask = common.left_pad([p for p in prompts for _ in range(args.group_size)], tok.pad_token_id)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(B, C, generator=g) * mask if per_token else torch.randn(B, generator=g)
    pk = ts.pack_trees(trees, prompts, adv, args, tok.pad_token_id, "cpu")
    lp_shared = ts.packed_logprobs(model, pk, torch.arange(3), chunk_mb=0.001)  # several chunks, checkpointed
    noise = torch.randn(lp_shared.shape, generator=g) * 0.3
    old_shared, ref_shared = lp_shared.detach() + noise, lp_shared.detach() - noise
    w_shared = ts.truncated_is_weight(old_shared, old_shared + torch.randn(lp_shared.shape, generator=g), 2.0) \
        if is_w else None
    row = torch.arange(B) // args.group_size
    gather = lambda x: x[row[:, None], pk["leaf_index"]] * mask  # noqa: E731
    lp_rep = common.token_logprobs(model, pids, pmask, comp, mask.long())
    # tree attention = separate sequences: log-probs near -12, where one fp32 ulp is 1e-6; the two layouts differ by a
    # few ulps (up to 5 measured over the AVX-512, AVX2 and default vector paths), a leak across branches by ~0.1
    assert torch.allclose(gather(lp_shared), lp_rep, atol=2e-5)
    n_seqs, n_tokens = B, int(mask.sum())
    rep_loss = ta.grpo_loss if per_token else tr.grpo_loss
    rep, _ = rep_loss(lp_rep, {"adv": adv, "mask": mask, "old": gather(old_shared),
                               "ref": gather(ref_shared) if kl else None,
                               "is_weight": gather(w_shared) if is_w else None}, n_seqs, n_tokens, args)
    shared, st = ts.shared_token_loss(lp_shared, {**{k: pk[k] for k in ("pos_w", "neg_w", "kl_w", "mask")},
                                                  "old": old_shared, "ref": ref_shared if kl else None,
                                                  "is_weight": w_shared}, n_seqs, n_tokens, args)
    # Equal in exact arithmetic; in fp32 the two layouts (tree attention over packed tokens, one sequence per leaf)
    # round differently, and by how much depends on the CPU's vector path and thread count. So the tolerances follow
    # from the measured log-prob difference instead of one machine's digits: the loss moves by at most its slope in
    # the log-probs (the L1 norm of dL/dlogp) times their largest difference, plus fp32 rounding of that weighted sum;
    # each gradient by at most 1e-4 of its norm (fp32 backward through two layouts; a wrong weight on one leaf moves
    # it by percents).
    slope = torch.autograd.grad(rep, lp_rep, retain_graph=True)[0].abs().sum()
    dlp = (gather(lp_shared) - lp_rep).abs().max()
    g_rep = torch.autograd.grad(rep, list(model.parameters()), retain_graph=True)
    g_shared = torch.autograd.grad(shared, list(model.parameters()))
    gap = float((shared - rep).detach())
    assert abs(gap) <= float(slope * (dlp + 1e-6)), (gap, float(slope * dlp))
    for a, b in zip(g_rep, g_shared):
        assert (a - b).norm() <= 1e-4 * a.norm(), float((a - b).norm() / a.norm())
    assert float((st["clipfrac"] * pk["mask"]).sum()) > 0  # the clipped branch was active somewhere
    # fewer forward tokens: prompt + tree tokens once per tree instead of prompt + leaf per leaf
    assert pk["mask"].sum() + sum(map(len, prompts)) < mask.sum() + args.group_size * sum(map(len, prompts))


def test_shared_training_refuses_attention_without_4d_masks(tiny):
    model, tok = tiny
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(SystemExit, match="eager or sdpa"):
            ts.tree_attention_mask(model, torch.ones(1, 3, 3, dtype=torch.bool))
    finally:
        model.config._attn_implementation = "sdpa"


def test_update_shared_applies_the_sampler_weight_when_the_sampler_is_not_the_trainer(tiny):
    """update_shared on one batch of trees: with the trainer as sampler, no weight and no is_weight statistics; with
    a sampler that is another computation (a bf16 copy, vLLM: stubbed here) whose log-probs sit log 3 below pi_old,
    every tree token's weight is truncated at C = 2 (rollout/is_weight_mean 2, is_truncated_frac 1) and the
    on-policy gradient doubles."""
    model, tok = tiny
    args = tree_args(ts, chains=2, rounds=1, branches=1, continuations=1, prompts_per_step=3, steps=1, lr=1e-5)
    torch.manual_seed(0)
    batch = ts.rollout(common.Sampler(model), tok, llm.make_task("add"), args, np.random.default_rng(0), "cpu")
    accel, outs = types.SimpleNamespace(num_processes=1), []  # one process
    for sampler, shift in ((None, 0.0), (types.SimpleNamespace(is_trainer=False, refresh=lambda: None), math.log(3))):
        m = copy.deepcopy(model)
        b = {**batch, "packed": {**batch["packed"], "logprobs": batch["packed"]["logprobs"] - shift}}
        opt = torch.optim.AdamW(m.parameters(), lr=args.lr)
        outs.append(ts.update_shared(m, opt, b, args, 1, accel, sampler or common.Sampler(m)))
    assert "rollout/is_weight_mean" not in outs[0] and outs[0]["rollout/logprob_mismatch"] < 1e-4
    assert outs[1]["rollout/is_weight_mean"] == pytest.approx(2.0) and outs[1]["rollout/is_truncated_frac"] == 1.0
    assert outs[1]["rollout/logprob_mismatch"] == pytest.approx(math.log(3), rel=1e-3)
    assert outs[1]["loss/grad_norm"] == pytest.approx(2 * outs[0]["loss/grad_norm"], rel=1e-4)


SMALL = dict(steps=1, prompts_per_step=4, eval_every=1, eval_examples=10, pass_k=0, eval_hard=False, threads=1,
             exp_name="t")


def test_shared_training_equals_leaf_training(tmp_path, monkeypatch):
    """One step from the same trees: each tree token once has the parent's (one sequence per leaf) loss and gradient
    norm; so has --tree-attention kernel, whose packed forwards go through tree_kernel_attention (the kernel module's
    reference on CPU) while its sampling stays SDPA (the same trees)."""
    tree_calls, attention = [], ts.tree_kernel_attention

    def counted(module, q, k, v, mask, **kw):  # whether each call carried the kernel's tree (an integer mask)
        tree_calls.append(mask is not None and not mask.dtype.is_floating_point and mask.dtype != torch.bool)
        return attention(module, q, k, v, mask, **kw)

    monkeypatch.setattr(ts, "tree_kernel_attention", counted)
    tr.main(tr.Args(out_dir=str(tmp_path / "a"), **SMALL))
    ts.main(ts.Args(out_dir=str(tmp_path / "b"), **SMALL))
    ts.main(ts.Args(out_dir=str(tmp_path / "c"), tree_attention="kernel", **SMALL))
    a, b, c = [[json.loads(x) for x in open(tmp_path / d / "t" / "metrics.jsonl")][1] for d in "abc"]
    assert any(tree_calls) and not all(tree_calls)  # the packed forwards had the tree, sampling and evaluation not
    for x in (b, c):
        assert a["rollout/reward"] == x["rollout/reward"] and a["rollout/sampled_tokens"] == x["rollout/sampled_tokens"]
        assert x["loss/pg"] == pytest.approx(a["loss/pg"], rel=1e-4, abs=1e-6)
        assert x["loss/grad_norm"] == pytest.approx(a["loss/grad_norm"], rel=1e-3)
        assert x["rollout/logprob_mismatch"] < 1e-3


def test_bad_input(tmp_path):
    with pytest.raises(SystemExit, match="must divide"):
        ts.main(ts.Args(out_dir=str(tmp_path), **{**SMALL, "minibatches": 3}))


# ---- --tree-attention kernel ----
def _packed(tok, device="cpu"):
    """_shared_equals_replicated's trees (three prompts, ten leaves each), packed, with a per-leaf advantage."""
    args = tree_args(ts, chains=2, rounds=2, branches=1, continuations=2, kl_coef=0.1, clip_eps_high=0.28)
    trees, _ = ts.grow_trees(TablePolicy(np.full((6, 5), 0.2), 6, ids=[4, 5, 6, 7, 8]), [3] * 3, args,
                             np.random.default_rng(1), len)
    prompts = [[1, 9, 10, 11], [1, 12, 13], [1, 14, 15, 16, 17]]
    adv = torch.randn(len(trees) * args.group_size, generator=torch.Generator().manual_seed(2))
    return args, prompts, ts.pack_trees(trees, prompts, adv, args, tok.pad_token_id, device)


def _one_update(model, pk, args):
    """Log-probs of the packed trees, and the loss and gradient of one update from them (clipping and KL active)."""
    lp = ts.packed_logprobs(model, pk, torch.arange(pk["ids"].shape[0]), chunk_mb=0.001)
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3)).to(lp.device) * 0.3
    mb = {**{k: pk[k] for k in ("pos_w", "neg_w", "kl_w", "mask")}, "old": lp.detach() + noise,
          "ref": lp.detach() - noise}
    loss, _ = ts.shared_token_loss(lp, mb, pk["leaf_index"].shape[0], int(pk["leaf_tokens"].sum()), args)
    slope = torch.autograd.grad(loss, lp, retain_graph=True)[0].abs().sum()
    return lp.detach(), loss.detach(), slope, torch.autograd.grad(loss, list(model.parameters()))


def test_tree_kernel_attention_equals_the_mask_path(tiny, interpret, monkeypatch):
    """--tree-attention kernel: tree_kernel_attention runs kernels/tree_verify_attention.py's Triton kernels, forward
    and backward (through the interpreter on CPU; the pure-torch reference is made to fail, so it cannot stand in),
    from each packed row's parent array (tree_kernel_mask); its log-probs, and the loss and gradient of one update,
    equal the additive-mask path's under SDPA."""
    poison(monkeypatch)
    model, tok = tiny
    args, _, pk = _packed(tok, DEV)
    mask_model, kernel_model = copy.deepcopy(model).to(DEV), copy.deepcopy(model).to(DEV)
    ts.use_tree_kernel(kernel_model)
    monkeypatch.setattr(K, "tree_verify_attention_ref", lambda *a, **k: pytest.fail("the reference ran instead"))
    lp_m, loss_m, slope, g_m = _one_update(mask_model, pk, args)
    lp_k, loss_k, _, g_k = _one_update(kernel_model, pk, args)
    mask = pk["mask"].bool()
    # Both fp32, equal in exact arithmetic; the kernel's online softmax over 32-key blocks and SDPA sum in different
    # orders, a few ulps per attention output, carried through three layers to log-probs between -15 and -9, where one
    # ulp is 1e-6 (measured at most 6 ulps on the AVX-512, AVX2 and default vector paths). One leaf segment's first
    # token given a parent one position off moves log-probs by nats (4.1 measured).
    dlp = float((lp_k - lp_m)[mask].abs().max())
    assert dlp <= 2e-5, dlp
    # the loss moves by at most its slope in the log-probs times their largest difference (plus fp32 rounding of the
    # weighted sum); each gradient by at most 1e-4 of its norm (fp32 backward through two attention computations)
    assert abs(float(loss_k - loss_m)) <= float(slope) * (dlp + 1e-6), (float(loss_k - loss_m), dlp)
    for a, b in zip(g_m, g_k):
        assert (a - b).norm() <= 1e-4 * a.norm(), float((a - b).norm() / a.norm())


def test_tree_kernel_reference_with_grouped_heads_equals_the_mask_path(tiny):
    """Without Triton (CPU, no interpreter) tree_kernel_attention runs the kernel module's reference, on a model with
    grouped-query heads (key and value heads repeated): the packed log-probs equal the mask path's. Outside the packed
    forward (token_logprobs, as sampling and evaluation) a model under use_tree_kernel computes SDPA exactly. Attention
    dropout is refused by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = tiny
    torch.manual_seed(0)
    gqa = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       attn_implementation="sdpa"))
    _, prompts, pk = _packed(tok)
    kernel_model = copy.deepcopy(gqa)
    ts.use_tree_kernel(kernel_model)
    idx = torch.arange(3)
    with torch.no_grad():
        assert torch.allclose(ts.packed_logprobs(kernel_model, pk, idx), ts.packed_logprobs(gqa, pk, idx), atol=2e-5)
        pids, pmask = common.left_pad(prompts, tok.pad_token_id)
        comp = torch.randint(4, 9, (3, 5), generator=torch.Generator().manual_seed(0))
        cmask = torch.ones_like(comp)
        assert torch.equal(common.token_logprobs(kernel_model, pids, pmask, comp, cmask),
                           common.token_logprobs(gqa, pids, pmask, comp, cmask))
    tree, q = ts.tree_kernel_mask(pk["parents"][:1]), torch.zeros(1, 4, pk["ids"].shape[1], 16)
    with pytest.raises(SystemExit, match="dropout"):
        ts.tree_kernel_attention(kernel_model.model.layers[0].self_attn, q, q, q, tree, dropout=0.1)


def test_a_lora_policys_reference_is_the_base_model_on_packed_trees(tiny):
    """--lora-rank with a KL term: the reference (common.AdaptersOff, the policy with its adapters disabled) scores the
    packed trees as the base model does, and the policy with its (moved) adapters does not."""
    model, tok = tiny
    base = copy.deepcopy(model)
    args, _, pk = _packed(tok)
    lora = llm.add_lora(copy.deepcopy(model), replace(args, lora_rank=4))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        idx = torch.arange(pk["ids"].shape[0])
        ref, plain = ts.packed_logprobs(common.AdaptersOff(lora), pk, idx), ts.packed_logprobs(base, pk, idx)
        adapted = ts.packed_logprobs(lora, pk, idx)
    assert torch.allclose(ref, plain, atol=1e-6)  # the same weights and the same computation
    assert (adapted - plain).abs().max() > 0.1
