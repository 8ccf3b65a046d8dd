"""algos/dapo.py: dynamic sampling, overlong shaping, clip-higher; equals GRPO token-mean when its extras are off."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import dapo, grpo


# ---- equations ----
def test_informative_groups_against_loop():
    r = torch.tensor([0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0.])
    want = [len(set(r[g * 4:(g + 1) * 4].tolist())) > 1 for g in range(4)]
    assert dapo.informative_groups(r, 4).tolist() == want == [False, True, False, True]


def test_overlong_penalty_against_loop():
    max_len, buf = 20, 6
    lengths = torch.arange(0, 25)
    out = dapo.overlong_penalty(lengths, max_len, buf, factor=0.5)
    for n in lengths.tolist():
        if n <= max_len - buf:
            want = 0.0
        elif n <= max_len:
            want = (max_len - buf - n) / buf
        else:
            want = -1.0
        assert abs(out[n].item() - 0.5 * want) < 1e-6, n
    assert out[max_len].item() == pytest.approx(-0.5)  # -factor exactly at the budget
    assert torch.all(dapo.overlong_penalty(lengths, max_len, 0) == 0)  # buffer 0 = off


def test_clip_higher_is_asymmetric():
    logp, old = torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1)  # ratio 1.25
    pos, _ = dapo.clipped_pg_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    sym, _ = dapo.clipped_pg_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    assert pos.item() == pytest.approx(-1.25) and sym.item() == pytest.approx(-1.2)  # 1.25 < 1.28: not clipped


def test_loss_functions_equal_grpo_token_mean():
    """Dynamic sampling off and a symmetric clip: DAPO's per-step loss is GRPO's with token-mean aggregation."""
    torch.manual_seed(0)
    B, C = 12, 6
    mask = (torch.arange(C)[None] < torch.randint(1, C + 1, (B,))[:, None]).float()
    logp = (torch.randn(B, C) * 0.2).requires_grad_()
    old, rewards = logp.detach() + torch.randn(B, C) * 0.2, (torch.rand(B) > 0.5).float()
    n_tok = int(mask.sum())
    a_d, a_g = dapo.group_advantages(rewards, 4), grpo.group_advantages(rewards, 4)
    assert torch.equal(a_d, a_g)
    l_d = dapo.aggregate_loss(dapo.clipped_pg_loss(logp, old, a_d, 0.2, 0.2)[0], mask, "token-mean", B, n_tok, 0)
    l_g = grpo.aggregate_loss(grpo.clipped_pg_loss(logp, old, a_g, 0.2, 0.2)[0], mask, "token-mean", B, n_tok, 0)
    assert torch.equal(l_d, l_g)
    assert torch.equal(*(torch.autograd.grad(x, logp, retain_graph=True)[0] for x in (l_d, l_g)))
    # and against a naive per-sample loop
    naive = 0.0
    for i in range(B):
        for t in range(C):
            if mask[i, t]:
                ratio = float(torch.exp(logp[i, t] - old[i, t]).detach())
                naive += -min(ratio * a_d[i].item(), min(max(ratio, 0.8), 1.2) * a_d[i].item())
    assert l_d.item() == pytest.approx(naive / n_tok, abs=1e-5)


def test_concat_and_select_keep_log_probs():
    """Rollouts of several rounds (different prompt and completion widths) stack without changing log-probs."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    task = common.make_task("add")
    a = common.generate(model, tok, common.encode_prompts(tok, ["1+2=", "3+4="]), 2, 4)
    b = common.generate(model, tok, common.encode_prompts(tok, ["12+34=", "56+78="]), 2, 7)
    both = dapo.concat_rollouts([a, b], tok.pad_token_id)
    lp = lambda r: common.token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,  # noqa: E731
                                         r.completion_mask)
    with torch.no_grad():
        whole, parts = lp(both), [lp(a), lp(b)]
    for k, part in enumerate(parts):
        rows = whole[4 * k:4 * k + 4, :part.shape[1]]
        assert torch.allclose(rows, part, atol=1e-5)
        assert torch.all(whole[4 * k:4 * k + 4, part.shape[1]:] == 0)
    assert both.texts == a.texts + b.texts
    sel = dapo.select_groups(both, torch.tensor([False, True, True, False]), 2)
    assert sel.texts == both.texts[2:6] and torch.equal(sel.completion_ids, both.completion_ids[2:6])
    assert task.verify(both.texts[0], "3")[1]["format"] in (0.0, 1.0)


# ---- the loop ----
SMALL = dapo.Args(steps=40, prompts_per_step=32, group_size=8, eval_every=20, eval_examples=300, pass_k=0,
                  eval_hard=False, out_dir="", exp_name="t", threads=1)


def rows(path):
    return {r["step"]: r for r in map(json.loads, open(path))}


def test_extras_off_equals_grpo_token_mean(tmp_path):
    cfg = dict(steps=2, eval_every=2, eval_examples=40, loss_agg="token-mean", out_dir=str(tmp_path))
    d = dapo.main(replace(SMALL, dynamic_sampling=False, clip_eps_high=0.2, overlong_buffer=0, exp_name="d", **cfg))
    g = grpo.main(grpo.Args(prompts_per_step=32, group_size=8, pass_k=0, eval_hard=False, exp_name="g", **cfg))
    for k in ("eval_acc_end", "train_reward_last", "gen_tokens"):
        assert d[k] == g[k], k
    a, b = rows(tmp_path / "d" / "metrics.jsonl"), rows(tmp_path / "g" / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rollout/reward", "loss/pg", "loss/clipfrac", "loss/grad_norm"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_dynamic_sampling_fills_the_batch_and_counts_rollouts(tmp_path):
    s = dapo.main(replace(SMALL, steps=3, eval_every=3, eval_examples=40, out_dir=str(tmp_path)))
    for r in rows(tmp_path / "t" / "metrics.jsonl").values():
        if "rollout/sampled" in r:
            assert r["rollout/sampled"] <= 3 * 32 * 8
            assert r["rollout/rollouts_per_informative_group"] == r["rollout/sampled"] / r["rollout/informative_groups"]
            assert r["rollout/informative_groups"] == 32 or r["rollout/sampled"] == 3 * 32 * 8
    assert s["rollouts_per_informative_group"] >= 8  # at least one group of G per informative group


def test_rollout_budget_stops_early(tmp_path):
    s = dapo.main(replace(SMALL, steps=10, eval_every=5, eval_examples=40, prompts_per_step=8,
                          rollout_budget=3 * 8 * 8, out_dir=str(tmp_path)))
    assert s["rollouts_sampled"] >= 3 * 8 * 8 and s["steps_done"] <= 3 and s["steps_done"] < 10


def test_dapo_learns(tmp_path):
    s = dapo.main(replace(SMALL, out_dir=str(tmp_path)))
    # stated margin: +3 points in 40 steps (measured, seed 0, 1 thread: +6.7 at the end, +13 at best; the
    # comparison's 20-step runs gained 10.4 +- 2.8; a flipped sign loses accuracy instead)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.03, s
    assert (tmp_path / "t" / "curve.png").exists()


# ---- bad input ----
@pytest.mark.parametrize("change,msg", [
    ({"max_sample_rounds": 0}, "max-sample-rounds"),
    ({"overlong_buffer": 8}, "overlong-buffer"),
    ({"rollout_budget": -1}, "rollout-budget"),
    ({"group_size": 1}, "group-size"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        dapo.main(replace(SMALL, out_dir=str(tmp_path), **change))
