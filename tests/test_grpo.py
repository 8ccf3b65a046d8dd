"""algos/grpo.py: equations against naive loops, degeneracies, learning, exact resume, bad input, launchers."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from algos import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- equations ----
def test_group_advantages_against_loop():
    torch.manual_seed(0)
    r = torch.rand(24)
    for std_norm in (True, False):
        out = grpo.group_advantages(r, 6, std_norm)
        for g in range(4):
            grp = r[g * 6:(g + 1) * 6].tolist()
            mean = sum(grp) / 6
            std = (sum((x - mean) ** 2 for x in grp) / 5) ** 0.5
            for j in range(6):
                want = (grp[j] - mean) / (std + 1e-6) if std_norm else grp[j] - mean
                assert abs(out[g * 6 + j].item() - want) < 1e-5
    assert torch.all(grpo.group_advantages(torch.ones(8), 4) == 0)  # zero-variance groups carry no signal


def naive_step_loss(token_loss, mask, mode, const):
    seqs = [[token_loss[i, t].item() for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    if mode == "seq-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    return sum(sum(s) for s in seqs) / (len(seqs) * const)


@pytest.mark.parametrize("mode", ["seq-mean", "token-mean", "const"])
def test_aggregate_loss_against_loop_and_micro_batching(mode):
    torch.manual_seed(0)
    B, C = 10, 7
    loss = torch.randn(B, C)
    lengths = torch.randint(1, C + 1, (B,))
    mask = (torch.arange(C)[None] < lengths[:, None]).float()
    n_tok = int(mask.sum())
    whole = grpo.aggregate_loss(loss, mask, mode, B, n_tok, 16).item()
    assert abs(whole - naive_step_loss(loss, mask, mode, 16)) < 1e-5
    # micro-batches with the step's normaliser add up to the whole-batch loss
    parts = sum(grpo.aggregate_loss(loss[i:i + 3], mask[i:i + 3], mode, B, n_tok, 16).item() for i in range(0, B, 3))
    assert abs(parts - whole) < 1e-5


def test_equal_lengths_token_mean_equals_seq_mean():
    loss, mask = torch.randn(6, 5), torch.ones(6, 5)
    a = grpo.aggregate_loss(loss, mask, "seq-mean", 6, 30, 5)
    b = grpo.aggregate_loss(loss, mask, "token-mean", 6, 30, 5)
    c = grpo.aggregate_loss(loss, mask, "const", 6, 30, 5)  # k = the common length: Dr. GRPO equals both
    assert torch.allclose(a, b) and torch.allclose(a, c)


def test_clipped_loss_against_loop_and_clip_fraction():
    torch.manual_seed(1)
    logp, old, adv = torch.randn(4, 3) * 0.3, torch.randn(4, 3) * 0.3, torch.randn(4)
    loss, clipped = grpo.clipped_pg_loss(logp, old, adv, 0.2, 0.28)
    for i in range(4):
        for t in range(3):
            ratio = torch.exp(logp[i, t] - old[i, t]).item()
            a = adv[i].item()
            want = -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
            assert abs(loss[i, t].item() - want) < 1e-6
            assert clipped[i, t].item() == float(min(max(ratio, 0.8), 1.28) * a < ratio * a)


def test_ratio_one_gives_reinforce_gradient():
    torch.manual_seed(2)
    logits = torch.randn(5, 4, requires_grad=True)
    logp = logits.log_softmax(-1)[:, 0]
    adv = torch.randn(5)
    loss, _ = grpo.clipped_pg_loss(logp[:, None], logp.detach()[:, None], adv, 0.2, 0.2)
    (g_ppo,) = torch.autograd.grad(loss.sum(), logits)
    (g_reinforce,) = torch.autograd.grad(-(adv * logits.log_softmax(-1)[:, 0]).sum(), logits)
    assert torch.allclose(g_ppo, g_reinforce, atol=1e-6)


def test_k3_kl():
    lp, ref = torch.randn(50), torch.randn(50)
    kl = grpo.k3_kl(lp, ref)
    assert (kl >= 0).all() and torch.allclose(grpo.k3_kl(lp, lp), torch.zeros(50))
    want = torch.tensor([math.exp(r - l) - (r - l) - 1 for l, r in zip(lp.tolist(), ref.tolist())])
    assert torch.allclose(kl, want, atol=1e-5)
    # unbiased for KL(p||q) when sampling from p: check on a 3-way categorical
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    exact = (p * (p / q).log()).sum()
    est = (p * grpo.k3_kl(p.log(), q.log())).sum()
    assert torch.allclose(exact, est, atol=1e-6)


def test_truncated_is_weight_against_loop():
    """w_t = min(pi_old / pi_sampler, C) token by token, with no gradient; equal log-probs give exactly 1."""
    torch.manual_seed(0)
    old, behaviour = (torch.randn(4, 6) * 0.5).requires_grad_(), torch.randn(4, 6) * 0.5
    w = grpo.truncated_is_weight(old, behaviour, 2.0)
    assert not w.requires_grad
    for i in range(4):
        for t in range(6):
            assert w[i, t].item() == pytest.approx(min(math.exp(old[i, t].item() - behaviour[i, t].item()), 2.0),
                                                   rel=1e-5)
    assert (w == 2.0).any() and (w < 1).any()  # the draw exercises both sides of the cap
    assert torch.equal(grpo.truncated_is_weight(behaviour, behaviour, 2.0), torch.ones(4, 6))


def test_sampler_gap_sums():
    """The mismatch and importance-weight sums of one micro-batch, against a loop over the masked tokens."""
    torch.manual_seed(1)
    old, behaviour = torch.randn(3, 5), torch.randn(3, 5)
    mask = (torch.arange(5)[None] < torch.tensor([[2], [5], [3]])).float()
    w = grpo.truncated_is_weight(old, behaviour, 1.5)
    out = grpo.sampler_gap(old, behaviour, w, mask, 1.5)
    toks = [(i, t) for i in range(3) for t in range(5) if mask[i, t]]
    assert out["gap/tokens"] == len(toks) == 10
    assert out["gap/sum"] == pytest.approx(sum(abs(old[i, t] - behaviour[i, t]).item() for i, t in toks), rel=1e-5)
    assert out["gap/is_w"] == pytest.approx(sum(w[i, t].item() for i, t in toks), rel=1e-5)
    assert out["gap/is_cut"] == sum(w[i, t].item() >= 1.5 for i, t in toks)
    assert "gap/is_w" not in grpo.sampler_gap(old, behaviour, None, mask, 1.5)  # no correction: no weight sums


# ---- learning, resume, tracking ----
SMALL = grpo.Args(steps=80, prompts_per_step=32, group_size=8, eval_every=40, eval_examples=300, pass_k=0,
                  eval_hard=False, out_dir="", exp_name="t")


def test_grpo_learns(tmp_path):
    s = grpo.main(replace(SMALL, out_dir=str(tmp_path)))
    # stated margin: +6 points of held-out greedy accuracy in 80 rollout batches (measured: about +10;
    # a flipped advantage sign or a broken mask loses accuracy instead)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s
    assert s["logprob_mismatch"] < 1e-3  # the HF sampler and the trainer agree on CPU
    assert (tmp_path / "t" / "curve.png").exists() and (tmp_path / "t" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.extended  # grpo's learning: test_grpo_learns, in the suite
def test_grpo_learns_long_responses(tmp_path):
    """The long-response task (5 one-digit operands with running totals, ~33 tokens) from tiny-sums."""
    s = grpo.main(replace(SMALL, model="tiny-sums", task="sums", digits=1, max_new_tokens=48, steps=30, eval_every=30,
                          out_dir=str(tmp_path)))
    # stated margin: +5 points of held-out greedy accuracy in 30 rollout batches (measured: about +12)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.05, s
    assert s["logprob_mismatch"] < 1e-3


def test_resume_is_exact(tmp_path):
    cfg = replace(SMALL, steps=4, eval_every=2, eval_examples=50, ppo_epochs=2, minibatches=2, micro_batch_size=64)
    straight = grpo.main(replace(cfg, out_dir=str(tmp_path / "a")))
    grpo.main(replace(cfg, steps=2, out_dir=str(tmp_path / "b")))
    resumed = grpo.main(replace(cfg, out_dir=str(tmp_path / "b"), resume=str(tmp_path / "b" / "t" / "checkpoint")))
    for k in ("eval_acc_end", "train_reward_last", "gen_tokens"):
        assert straight[k] == resumed[k], k
    assert straight["logprob_mismatch"] < 1e-3  # recomputed pi_old vs the sampler, before any update
    rows = lambda d: [json.loads(x) for x in open(tmp_path / d / "t" / "metrics.jsonl")]  # noqa: E731
    a = {r["step"]: r for r in rows("a")}
    b = {r["step"]: r for r in rows("b")}
    for step in (3, 4):  # everything except timings is identical after the resume
        for key in ("rollout/reward", "loss/pg", "loss/clipfrac", "loss/grad_norm"):
            assert a[step][key] == b[step][key], (step, key)


def test_track_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    grpo.main(replace(SMALL, steps=1, eval_examples=20, track=True, out_dir=str(tmp_path)))
    assert list((tmp_path / "t" / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("loss_agg,extra", [("token-mean", {}), ("const", {"adv_std_norm": False}),
                                            ("seq-mean", {"kl_coef": 0.05, "clip_eps_high": 0.28})])
def test_variants_run(tmp_path, loss_agg, extra):
    s = grpo.main(replace(SMALL, steps=2, eval_examples=20, loss_agg=loss_agg, out_dir=str(tmp_path), **extra))
    assert 0 <= s["eval_acc_end"] <= 1


# ---- bad input ----
@pytest.mark.parametrize("change,msg", [
    ({"group_size": 1}, "group-size"),
    ({"minibatches": 3}, "must divide"),
    ({"task": "subtract"}, "unknown task"),
    ({"model": "tiny-nope"}, "unknown tiny model"),
    ({"temperature": 0.0}, "temperature"),
    ({"minibatches": 0}, "--minibatches"),
    ({"ppo_epochs": 0}, "--ppo-epochs"),
    ({"kl_coef": -0.1}, "--kl-coef"),
    ({"max_grad_norm": 0.0}, "--max-grad-norm"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        grpo.main(replace(SMALL, out_dir=str(tmp_path), **change))


def test_cli_help_and_bad_flag():
    out = subprocess.run([sys.executable, "algos/grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--loss-agg" in out.stdout and "group baseline" not in out.stderr
    out = subprocess.run([sys.executable, "algos/grpo.py", "--group-size", "1"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "group-size must be at least 2" in out.stderr and "Traceback" not in out.stderr


# ---- a real model (two processes under FSDP2: tests/test_sharding.py) ----
@pytest.mark.slow
@pytest.mark.extended
def test_smollm2_two_steps(tmp_path):
    pytest.importorskip("gguf")
    s = grpo.main(replace(SMALL, model="smollm2-135m", steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6,
                          eval_examples=2, lr=1e-6, micro_batch_size=4, out_dir=str(tmp_path)))
    assert s["gen_tokens"] > 0 and s["logprob_mismatch"] < 0.05


@pytest.mark.parametrize("mode", ["seq-mean", "token-mean", "const"])
def test_kernel_loss_matches_reference_path(mode):
    """--kernels swaps grpo_loss for kernel_grpo_loss (kernels/clipped_pg_loss.py): same value and gradient."""
    torch.manual_seed(3)
    B, C = 6, 5
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (B,))[:, None]).float()
    logp = (torch.randn(B, C) * 0.1).requires_grad_()
    mb = {"old": logp.detach() + torch.randn(B, C) * 0.1, "ref": logp.detach() + torch.randn(B, C) * 0.1,
          "adv": torch.randn(B), "mask": mask}
    args = replace(SMALL, loss_agg=mode, kl_coef=0.1, clip_eps_high=0.28, agg_const=8)
    n_seqs, n_tok = 2 * B, int(mask.sum()) + 7  # this micro-batch is part of a larger step
    share, _ = grpo.kernel_grpo_loss(logp, mb, n_seqs, n_tok, args)
    want, _ = grpo.grpo_loss(logp, mb, n_seqs, n_tok, args)
    tok_loss, _ = grpo.clipped_pg_loss(logp, mb["old"], mb["adv"], 0.2, 0.28)
    naive = grpo.aggregate_loss(tok_loss + 0.1 * grpo.k3_kl(logp, mb["ref"]), mask, mode, n_seqs, n_tok, 8)
    assert torch.allclose(want, naive, atol=1e-6) and torch.allclose(share, want, atol=1e-6)
    g1, = torch.autograd.grad(share, logp)
    g2, = torch.autograd.grad(want, logp)
    assert torch.allclose(g1, g2, atol=1e-6)
