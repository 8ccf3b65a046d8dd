"""NAT (algos/nat.py): the Horvitz-Thompson token subset is unbiased, keep-probability 1 is GRPO, RPC's truncated
forward gives the same gradient, and the script learns."""
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
from algos import _llm as llm  # noqa: E402
from algos import grpo, nat  # noqa: E402


def lengths_mask(lengths, C):
    """Right-padded completion mask [B, C] with the given lengths."""
    return (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).float()


def loss_inputs(seed=0, B=6, C=7):
    g = torch.Generator().manual_seed(seed)
    mask = lengths_mask([1, 3, 7, 5, 7, 2][:B], C)
    logp = (-torch.rand(B, C, generator=g) * 2).requires_grad_()
    mb = {"adv": torch.randn(B, generator=g), "mask": mask,
          "old": (logp.detach() + 0.3 * torch.randn(B, C, generator=g)),  # ratios on both sides of the clip range
          "ref": -torch.rand(B, C, generator=g) * 2}
    return logp, mb, g


ARGS = nat.Args(kl_coef=0.1)


def grad_of(loss_fn, logp, mb, args, n_seqs, n_tokens):
    logp.grad = None
    loss, _ = loss_fn(logp, mb, n_seqs, n_tokens, args)
    loss.backward()
    return loss.detach(), logp.grad.clone()


# ---- inclusion probabilities ----
@pytest.mark.parametrize("q", [0.25, 0.5, 0.8])
def test_rpc_inclusion_against_brute_force_count(q):
    """pi_t = P(K >= t), K = floor(n U^(1/q-1) + V): counted on a 1000 x 1000 midpoint grid of (U, V)."""
    n_grid = 1000
    u = (torch.arange(n_grid, dtype=torch.float64) + 0.5) / n_grid
    U, V = u[:, None], u[None, :]
    for n in (1, 2, 5, 9):
        K = torch.floor(n * U ** (1 / q - 1) + V)  # [grid, grid]
        counted = torch.stack([(K >= t).double().mean() for t in range(1, n + 1)])
        pi = nat.rpc_inclusion(lengths_mask([n], 9), q)[0]
        assert torch.allclose(pi[:n], counted, atol=2e-3), (n, pi[:n], counted)
        assert (pi[:n] > 0).all() and (pi[n:] == 0).all()
        assert abs(float(pi.sum()) - q * n) < 1e-9  # the mean kept fraction is exactly q


@pytest.mark.parametrize("q, n", [(0.99, 2048), (0.995, 1024), (0.999, 4096), (0.5, 4096)])
def test_rpc_inclusion_is_finite_for_long_completions_and_keep_probabilities_near_one(q, n):
    """t^(b+1) with b = q / (1 - q) overflows float64 (2048^100 > 1e308) and inf - inf is NaN; the probabilities
    must stay finite, in (0, 1], non-increasing in t, with sum_t pi_t = q n, and match the closed form where it is
    still representable (n^(b+1) < 1e304)."""
    pi = nat.rpc_inclusion(lengths_mask([n, 3], n), q)
    assert torch.isfinite(pi).all()
    p = pi[0]
    assert (p > 0).all() and (p <= 1).all() and (p[1:] <= p[:-1] + 1e-12).all()
    assert abs(float(p.sum()) - q * n) < 1e-6 * n
    b = q / (1 - q)
    m = min(64, int(math.exp(700 / (b + 1))))
    t = torch.arange(1, m + 1, dtype=torch.float64)
    small = 1 - (t ** (b + 1) - (t - 1) ** (b + 1)) / ((b + 1) * float(m) ** b)
    assert torch.allclose(nat.rpc_inclusion(lengths_mask([m], m), q)[0], small, rtol=0, atol=1e-12)
    assert torch.allclose(pi[1, :3], nat.rpc_inclusion(lengths_mask([3], 3), q)[0])


@pytest.mark.parametrize("selector", ["urs", "rpc"])
def test_selector_weights_have_mean_one_and_keep_the_stated_fraction(selector):
    mask = lengths_mask([1, 4, 8, 6], 8)
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([nat.select_tokens(mask, selector, 0.5, g) for _ in range(20000)])
    assert torch.allclose(draws.mean(0), mask, atol=0.05)  # E[keep / pi] = 1 on tokens, 0 on padding
    kept = float((draws > 0).float().sum() / (mask.sum() * len(draws)))
    assert abs(kept - 0.5) < 0.01, kept
    if selector == "rpc":  # a prefix: nothing kept after a dropped token
        keep = (draws > 0).float()
        assert (keep[..., 1:] <= keep[..., :-1]).all()


# ---- unbiasedness of the gradient ----
@pytest.mark.parametrize("selector", ["urs", "rpc"])
@pytest.mark.parametrize("loss_agg", ["seq-mean", "token-mean"])
def test_ht_gradient_averaged_over_masks_tends_to_the_full_gradient(selector, loss_agg):
    logp, mb, g = loss_inputs()
    args = replace(ARGS, loss_agg=loss_agg)
    n_seqs, n_tokens = mb["mask"].shape[0], int(mb["mask"].sum())
    full_loss, full = grad_of(grpo.grpo_loss, logp, mb, args, n_seqs, n_tokens)
    errs, total, count = {}, torch.zeros_like(full), 0
    for M in (100, 6400):
        while count < M:
            ht = nat.select_tokens(mb["mask"], selector, 0.5, g)
            total += grad_of(nat.nat_loss, logp, {**mb, "ht": ht}, args, n_seqs, n_tokens)[1]
            count += 1
        errs[M] = float((total / count - full).norm() / full.norm())
    # Monte Carlo error falls as 1/sqrt(M): 8x from 100 to 6400 masks; a biased weight (e.g. keep without
    # 1/pi, or a wrong pi) stalls at its bias instead
    assert errs[6400] < errs[100] / 3 and errs[6400] < 0.06, errs


def test_a_wrong_inclusion_probability_is_caught():
    """The same check fails for a plausible mistake: RPC weighted with keep / q instead of keep / P(K >= t)."""
    logp, mb, g = loss_inputs()
    n_seqs, n_tokens = mb["mask"].shape[0], int(mb["mask"].sum())
    _, full = grad_of(grpo.grpo_loss, logp, mb, ARGS, n_seqs, n_tokens)
    total = torch.zeros_like(full)
    for _ in range(6400):
        keep = (nat.select_tokens(mb["mask"], "rpc", 0.5, g) > 0).float()
        total += grad_of(nat.nat_loss, logp, {**mb, "ht": keep / 0.5}, ARGS, n_seqs, n_tokens)[1]
    assert float((total / 6400 - full).norm() / full.norm()) > 0.1


@pytest.mark.parametrize("selector", ["urs", "rpc", "full"])
@pytest.mark.parametrize("loss_agg", ["seq-mean", "token-mean", "const"])
def test_keep_prob_one_is_grpo_loss_exactly(selector, loss_agg):
    logp, mb, _ = loss_inputs(seed=3)
    args = replace(ARGS, loss_agg=loss_agg, selector=selector, keep_prob=1.0)
    n_seqs, n_tokens = mb["mask"].shape[0], int(mb["mask"].sum())
    ref_loss, ref_grad = grad_of(grpo.grpo_loss, logp, mb, args, n_seqs, n_tokens)
    ht = nat.select_tokens(mb["mask"], selector, 1.0)
    loss, grad = grad_of(nat.nat_loss, logp, {**mb, "ht": ht}, args, n_seqs, n_tokens)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_truncated_columns_give_the_same_loss():
    """nat_loss on the first L columns (L >= the last kept one) equals nat_loss on all of them."""
    logp, mb, g = loss_inputs(seed=4)
    ht = nat.select_tokens(mb["mask"], "rpc", 0.4, g)
    L = nat.kept_columns(ht)
    assert L < mb["mask"].shape[1]  # this draw does cut columns
    full, _ = nat.nat_loss(logp, {**mb, "ht": ht}, 6, int(mb["mask"].sum()), ARGS)
    cut = {**mb, "ht": ht[:, :L], "old": mb["old"][:, :L], "ref": mb["ref"][:, :L]}
    part, _ = nat.nat_loss(logp[:, :L], cut, 6, int(mb["mask"].sum()), ARGS)
    assert torch.allclose(full, part, atol=1e-7)


# ---- update: RPC's truncated, sorted micro-batches give the full-width gradient ----
def rollout_batch(selector):
    common.set_seed(0)
    args = nat.Args(prompts_per_step=8, group_size=4, micro_batch_size=5, selector=selector, lr=0.0,
                    max_grad_norm=1e9, threads=1)
    task = llm.make_task(args.task, args.digits)
    model, tok = common.load_model(args.model, torch.device("cpu"))
    batch = nat.rollout(model, tok, task, args, __import__("numpy").random.default_rng(0), torch.device("cpu"))
    return args, model, batch


class _OneProcess:
    num_processes = 1


class _Engine:
    """A stand-in rollout engine: the sampler is then not the trainer; counts the weight syncs."""
    syncs = 0

    def sync_weights(self, model):
        self.syncs += 1


def grads_after_update(mod, model, batch, args, sampler=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients stay in .grad, the weights unchanged
    out = mod.update(model, opt, batch, mod.nat_loss if mod is nat else mod.grpo_loss, args, 1, _OneProcess(),
                     sampler or common.Sampler(model))
    return [p.grad.clone() for p in model.parameters()], out


def test_rpc_update_with_truncated_micro_batches_matches_the_full_width_gradient(monkeypatch):
    args, model, batch = rollout_batch("rpc")
    mask = batch["completion_mask"]
    ht = nat.select_tokens(mask, "rpc", 0.5, torch.Generator().manual_seed(0))
    monkeypatch.setattr(nat, "select_tokens", lambda *a, **k: ht)
    grads, out = grads_after_update(nat, model, batch, args)
    # the reference: one full-width forward over all sequences, the same weights
    model.zero_grad()
    logp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask)
    mb = {"adv": batch["adv"], "mask": mask.float(), "ht": ht, "old": logp.detach(), "ref": None}
    nat.nat_loss(logp, mb, mask.shape[0], int(mask.sum()), args)[0].backward()
    for a, b in zip(grads, model.parameters()):
        assert torch.allclose(a, b.grad, atol=1e-6, rtol=1e-4)
    P, C = batch["prompt_ids"].shape[1], mask.shape[1]
    assert out["nat/positions"] < mask.shape[0] * (P + C)  # the forward and backward really were shorter
    assert out["nat/kept_frac"] == pytest.approx(float((ht > 0).sum() / mask.sum()))


def test_full_selector_update_equals_grpo_update():
    args, model, batch = rollout_batch("full")
    g_nat, out = grads_after_update(nat, model, batch, args)
    model.zero_grad()
    g_grpo, ref = grads_after_update(grpo, model, batch, args)
    for a, b in zip(g_nat, g_grpo):  # to fp32 rounding: see test_sampler_correction_is_grpos_when_...
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()
    for k in ("loss/pg", "loss/entropy", "loss/clipfrac"):
        assert out[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k


def test_sampler_correction_is_grpos_when_the_sampler_is_not_the_trainer():
    """With an engine as sampler and behaviour log-probs off the trainer's, each token gets grpo's weight
    min(pi_old / pi_sampler, C): the full selector gives grpo's gradient and logged weights; the trainer as sampler
    logs none; RPC weights its kept tokens (the logged mean is the HT estimate)."""
    args, model, batch = rollout_batch("full")
    g = torch.Generator().manual_seed(3)
    batch["logprobs"] = batch["logprobs"] + 0.5 * torch.randn(batch["logprobs"].shape, generator=g)
    engine = _Engine()
    g_nat, out = grads_after_update(nat, model, batch, args, common.Sampler(model, engine=engine))
    assert engine.syncs == 1  # refreshed after the optimiser step
    model.zero_grad()
    g_grpo, ref = grads_after_update(grpo, model, batch, args, common.Sampler(model, engine=_Engine()))
    # nat cuts each micro-batch to its longest kept prefix (kept_columns), grpo scores every column: with the prompt
    # computed once per group (common.prompt_shared_hidden) the completion forwards then run matmuls of other shapes,
    # so the gradients agree to fp32 rounding (the bound of tests/test_common.py's prompt-shared test), not bitwise
    for a, b in zip(g_nat, g_grpo):
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()
    for k in ("rollout/is_weight_mean", "rollout/is_truncated_frac", "rollout/logprob_mismatch", "loss/pg"):
        assert out[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    assert out["rollout/is_truncated_frac"] > 0 and out["rollout/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)
    model.zero_grad()
    g_plain, plain = grads_after_update(nat, model, batch, args)
    assert "rollout/is_weight_mean" not in plain
    assert any(not torch.allclose(a, b) for a, b in zip(g_plain, g_nat))  # the weight changed the gradient
    model.zero_grad()
    _, rpc = grads_after_update(nat, model, batch, replace(args, selector="rpc"), common.Sampler(model, engine=_Engine()))
    assert 0 < rpc["rollout/is_weight_mean"] < args.sampler_is_cap


# ---- learning ----
SMALL = nat.Args(steps=18, prompts_per_step=32, group_size=8, eval_every=18, eval_examples=200, pass_k=0,
                 eval_hard=False, micro_batch_size=64, out_dir="", exp_name="t")


def test_nat_rpc_learns(tmp_path):
    s = nat.main(replace(SMALL, out_dir=str(tmp_path)))
    # stated margin: +6 points of held-out greedy accuracy in 18 rollout batches on half of the tokens
    # (measured: 0.335 -> 0.465, 46 s on 2 cores; with the loss's sign flipped it fell to 0.045)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s
    assert 0.4 < s["kept_frac"] < 0.6, s
    assert (tmp_path / "t" / "curve.png").exists() and (tmp_path / "t" / "summary.json").exists()


# ---- bad input ----
@pytest.mark.parametrize("change,msg", [({"keep_prob": 0.0}, "keep-prob"), ({"keep_prob": 1.5}, "keep-prob"),
                                        ({"group_size": 1}, "group-size")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        nat.main(replace(SMALL, out_dir=str(tmp_path), **change))


def test_unknown_selector():
    with pytest.raises(ValueError, match="unknown selector"):
        nat.select_tokens(torch.ones(2, 3), "topk", 0.5)
    out = subprocess.run([sys.executable, "algos/nat.py", "--selector", "topk"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "selector" in out.stderr and "Traceback" not in out.stderr
