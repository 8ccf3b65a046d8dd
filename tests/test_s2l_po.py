"""algos/s2l_po.py: the annealing schedule and the split of each group, the explorer's truncated importance weight,
the rollout-compute count and the merge of two rollouts against hand-computed values; a real mixed rollout whose
behaviour log-probs are each model's own; the degenerate cases that tie it to grpo.py (no explorer = GRPO exactly on
the same rollouts; an all-explorer batch = grpo.py's sampler correction with the explorer as the sampler); a short
learning run over two seeds; bad flags refused."""
import copy
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo
from algos import s2l_po

SMALL = s2l_po.Args(steps=2, prompts_per_step=4, group_size=4, eval_every=1, eval_examples=20, pass_k=0,
                    eval_hard=False, threads=1, out_dir="/tmp/test_s2l_po", model="tiny-0.6m")


# ---- the schedule and who samples ----
def test_explorer_fraction_by_hand():
    """alpha(s) = alpha_0 max(0, 1 - (s - 1) / S): S = 4 from 1 gives 1, 0.75, 0.5, 0.25, then 0 from s = 5."""
    assert [s2l_po.explorer_fraction(s, 1.0, 4) for s in range(1, 8)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert [s2l_po.explorer_fraction(s, 0.5, 2) for s in (1, 2, 3, 10)] == [0.5, 0.25, 0.0, 0.0]
    assert [s2l_po.explorer_fraction(s, 0.7, 0) for s in (1, 50, 10_000)] == [0.7, 0.7, 0.7]  # S = 0: no annealing
    assert s2l_po.explorer_fraction(1, 0.0, 4) == 0.0  # alpha_0 = 0: GRPO


def test_explorer_count_by_hand():
    """n_e = floor(alpha G + 1/2), at most G."""
    assert s2l_po.explorer_count(0.75, 8) == 6
    assert s2l_po.explorer_count(0.3125, 8) == 3  # 2.5 rounds up (Python's round would give 2)
    assert s2l_po.explorer_count(0.06, 8) == 0  # 0.48
    assert s2l_po.explorer_count(1.0, 8) == 8 and s2l_po.explorer_count(0.0, 8) == 0
    assert s2l_po.explorer_count(0.5, 2) == 1


# ---- the off-policy weight ----
def test_mixed_is_weight_by_hand():
    """Row 0 from the explorer: pi_old / pi_x = 0.5 / 0.25 = 2 -> cut at C_e = 1.5, and 0.2 / 0.4 = 0.5; row 1 from the
    learner: 1 when the sampler is the trainer, grpo's weight min(ratio, C = 3) when it is not."""
    old = torch.log(torch.tensor([[0.5, 0.2], [0.5, 0.2]]))
    beh = torch.log(torch.tensor([[0.25, 0.4], [0.25, 0.4]]))
    x = torch.tensor([True, False])
    w = s2l_po.mixed_is_weight(old, beh, x, 1.5, 3.0, False)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5], [1.0, 1.0]]), atol=1e-6)
    w = s2l_po.mixed_is_weight(old, beh, x, 1.5, 3.0, True)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5], [2.0, 0.5]]), atol=1e-6)
    assert s2l_po.mixed_is_weight(old, beh, torch.tensor([False, False]), 1.5, 3.0, False) is None  # plain GRPO
    assert torch.allclose(s2l_po.mixed_is_weight(old, beh, torch.tensor([True, True]), 9.0, 3.0, False),
                          torch.tensor([[2.0, 0.5], [2.0, 0.5]]), atol=1e-6)


def test_rollout_flops_and_group_rewards_by_hand():
    assert s2l_po.rollout_flops(5_140_480, 1000) == 2 * 5_140_480 * 1000
    assert s2l_po.rollout_flops(652_544, 0) == 0
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]), "from_explorer": torch.tensor([True, False, True, False])}
    assert s2l_po.group_rewards(batch, 1) == {"s2l/explorer_reward": 1.0, "s2l/learner_reward": 0.5}
    batch["from_explorer"] = torch.tensor([False] * 4)
    assert s2l_po.group_rewards(batch, 0) == {"s2l/learner_reward": 0.75}


def test_merge_groups_by_hand():
    """2 prompts; a: 1 completion each, 2 tokens wide; b: 2 completions each, 3 wide -> groups [a, b, b], a padded."""
    pr = torch.tensor([[7], [8]])
    a = SimpleNamespace(prompt_ids=pr, prompt_mask=torch.ones(2, 1, dtype=torch.long),
                        completion_ids=torch.tensor([[1, 2], [3, 4]]), completion_mask=torch.tensor([[1, 1], [1, 0]]),
                        logprobs=torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]), finish_reasons=["length", "stop"],
                        texts=["a0", "a1"])
    pb = pr.repeat_interleave(2, 0)
    b = SimpleNamespace(prompt_ids=pb, prompt_mask=torch.ones(4, 1, dtype=torch.long),
                        completion_ids=torch.arange(10, 22).view(4, 3),
                        completion_mask=torch.ones(4, 3, dtype=torch.long),
                        logprobs=-torch.ones(4, 3), finish_reasons=["length"] * 4, texts=["b0", "b1", "b2", "b3"])
    m = s2l_po.merge_groups(a, b, 1, 2, pad_id=0)
    assert m["prompt_ids"].view(-1).tolist() == [7, 7, 7, 8, 8, 8]
    assert m["completion_ids"].tolist() == [[1, 2, 0], [10, 11, 12], [13, 14, 15], [3, 4, 0], [16, 17, 18],
                                            [19, 20, 21]]
    assert m["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert m["logprobs"][0].tolist() == [-1.0, -2.0, 0.0] and m["logprobs"][3].tolist() == [-3.0, 0.0, 0.0]
    assert m["texts"] == ["a0", "b0", "b1", "a1", "b2", "b3"]
    assert m["finish_reasons"] == ["length", "length", "length", "stop", "length", "length"]


# ---- a real mixed rollout ----
@pytest.fixture(scope="module")
def models():
    learner, tok = common.load_model("tiny-5m", "cpu")
    explorer, _ = common.load_model("tiny-0.6m", "cpu")
    return learner, explorer.eval(), tok


def test_mixed_rollout_carries_each_models_own_logprobs(models):
    """8 prompts x G = 4, n_e = 1: the first completion of every group is the explorer's, and its behaviour log-probs
    are the explorer's scores of its tokens (the learner's would differ by about 0.9 nats per token), the other three
    are the learner's own; rewards and advantages are per mixed group."""
    learner, explorer, tok = models
    args = replace(SMALL, prompts_per_step=8, group_size=4)
    torch.manual_seed(0)
    batch = s2l_po.rollout(common.Sampler(learner), tok, llm.make_task("add", 2), args, np.random.default_rng(0), "cpu",
                           common.Sampler(explorer), 1)
    x = batch["from_explorer"]
    assert x.tolist() == [True, False, False, False] * 8
    m = batch["completion_mask"]
    score = lambda model: common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],  # noqa: E731
                                                batch["completion_ids"], m)
    with torch.no_grad():
        by_x, by_l = score(explorer), score(learner)
    lp = batch["logprobs"]
    assert torch.allclose((lp - by_x)[x] * m[x], torch.zeros_like(lp[x]), atol=1e-4)
    assert torch.allclose((lp - by_l)[~x] * m[~x], torch.zeros_like(lp[~x]), atol=1e-4)
    assert ((by_x - by_l)[x].abs() * m[x]).sum() / m[x].sum() > 0.1  # the two models do differ on these tokens
    assert torch.allclose(batch["adv"], grpo.group_advantages(batch["rewards"], 4))


# ---- degenerate cases: grpo.py ----
class NotTrainer(common.Sampler):
    """A sampler that says it is another computation than the trainer (what a bf16 copy or vLLM says)."""

    @property
    def is_trainer(self) -> bool:
        return False


def updated(module, model, batch, args, sampler_cls=common.Sampler):
    model = copy.deepcopy(model)
    opt = llm.make_optimizer(model.parameters(), args)
    accel = SimpleNamespace(num_processes=1)
    stats = module.update(model, opt, batch, module.grpo_loss, args, 1, accel, sampler_cls(model))
    return model, stats


def test_no_explorer_is_grpo_exactly(models):
    """--explorer-frac 0 (or annealed to 0): the same rollout as grpo.py's under the same seeds, and the same weights
    after the update."""
    learner, explorer, tok = models
    args = replace(SMALL, prompts_per_step=8, group_size=4, model="tiny-5m")
    gargs = grpo.Args(**{k: getattr(args, k) for k in grpo.Args.__dataclass_fields__})
    task = llm.make_task("add", 2)
    torch.manual_seed(3)
    mine = s2l_po.rollout(common.Sampler(learner), tok, task, args, np.random.default_rng(3), "cpu",
                          common.Sampler(explorer), 0)
    torch.manual_seed(3)
    theirs = grpo.rollout(common.Sampler(learner), tok, task, gargs, np.random.default_rng(3), "cpu")
    for k in ("prompt_ids", "completion_ids", "completion_mask", "logprobs", "rewards", "adv"):
        assert torch.equal(mine[k], theirs[k]), k
    assert not mine["from_explorer"].any()
    a, _ = updated(s2l_po, learner, mine, args)
    b, _ = updated(grpo, learner, theirs, gargs)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), learner.parameters()))  # it did update


def test_all_explorer_batch_is_grpos_sampler_correction(models):
    """A batch the explorer sampled whole is, for the update, grpo.py's batch from a sampler that is not the trainer
    with C = C_e: the same weights after one step. A weight of 1 instead (no correction) or pi_x / pi_old would
    differ: the explorer's tokens sit about 0.9 nats from the learner's."""
    learner, explorer, tok = models
    args = replace(SMALL, prompts_per_step=8, group_size=4, model="tiny-5m", explorer_is_cap=1.5)
    gargs = grpo.Args(**{**{k: getattr(args, k) for k in grpo.Args.__dataclass_fields__}, "sampler_is_cap": 1.5})
    torch.manual_seed(4)
    batch = s2l_po.rollout(common.Sampler(learner), tok, llm.make_task("add", 2), args, np.random.default_rng(4), "cpu",
                           common.Sampler(explorer), 4)
    assert batch["from_explorer"].all()
    a, stats = updated(s2l_po, learner, batch, args)
    b, _ = updated(grpo, learner, batch, gargs, NotTrainer)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7)
    uncorrected, _ = updated(grpo, learner, batch, gargs)  # grpo.py on the trainer's sampler: weight 1
    assert any(not torch.allclose(p, q, atol=1e-7) for p, q in zip(a.parameters(), uncorrected.parameters()))
    assert 0 < stats["s2l/explorer_is_truncated_frac"] < 1 and stats["s2l/explorer_logprob_gap"] > 0.1


# ---- learning ----
def answer_margin(model, tok, examples) -> float:
    """Mean log-prob (nats) of the right answer (then EOS) minus that of its near misses a - 1, a + 1, a - 10, a + 10:
    how well the learner tells right from almost right on these prompts."""
    def mean_logp(prompts, answers):
        pids, pmask = common.left_pad(common.encode_prompts(tok, prompts), tok.pad_token_id)
        ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
        cids, cmask = common.left_pad([list(reversed(x)) for x in ids], tok.pad_token_id)  # right-pad by reversing
        cids, cmask = cids.flip(1), cmask.flip(1)
        with torch.no_grad():
            return float((common.token_logprobs(model, pids, pmask, cids, cmask) * cmask).sum()) / len(answers)

    near = [(e.prompt, str(x)) for e in examples for d in (-1, 1, -10, 10) if (x := int(e.answer) + d) >= 0]
    return mean_logp([e.prompt for e in examples], [e.answer for e in examples]) - \
        mean_logp([p for p, _ in near], [a for _, a in near])


def test_learns_from_the_explorers_rollouts_alone(models):
    """The off-policy half of the method on its own: 8 rollout batches of 16 prompts x 8, every completion from
    tiny-0.6m (--anneal-steps 0), train tiny-5m at the default lr; on 128 held-out prompts the learner's margin of the
    right answer over its near misses grows. Measured on seeds 0-3: +0.12, +0.30, +0.35, +0.17 nats (mean 0.23); the
    same runs with the advantage's sign flipped: -0.57, -0.58, -0.75, -0.51. The bar, each of seeds 0 and 1 above 0.03
    and their mean above 0.08 (a third of the measured mean), fails on a sign error, on a weight that zeroes the
    explorer's tokens or on an update that does not move the learner."""
    learner, explorer, tok = models
    task = llm.make_task("add", 2)
    held_out = task.sample("test", 128, np.random.default_rng(123))
    args = replace(SMALL, model="tiny-5m", prompts_per_step=16, group_size=8, steps=8, anneal_steps=0)
    gains = []
    for seed in (0, 1):
        model = copy.deepcopy(learner)
        opt, accel = llm.make_optimizer(model.parameters(), args), SimpleNamespace(num_processes=1)
        before = answer_margin(model, tok, held_out)
        for step in range(1, args.steps + 1):
            torch.manual_seed(hash((seed, step)) % 2**31)
            n = s2l_po.explorer_count(s2l_po.explorer_fraction(step, 1.0, 0), args.group_size)
            batch = s2l_po.rollout(common.Sampler(model), tok, task, args, np.random.default_rng([seed, step]), "cpu",
                                   common.Sampler(explorer), n)
            assert batch["from_explorer"].all()
            s2l_po.update(model, opt, batch, s2l_po.grpo_loss, args, step, accel, common.Sampler(model))
        gains.append(answer_margin(model, tok, held_out) - before)
    assert min(gains) > 0.03 and float(np.mean(gains)) > 0.08, gains


def test_main_counts_rollout_flops_per_model(tmp_path):
    """Two rollout batches, --anneal-steps 2: batch 1 all explorer, batch 2 half (2 of G = 4); the logged running total
    is 2 x parameters x generated tokens of whichever model generated them, and the summary carries it."""
    args = replace(SMALL, model="tiny-5m", anneal_steps=2, explorer_frac=1.0, out_dir=str(tmp_path))
    s = s2l_po.main(args)
    rows = [json.loads(line) for line in open(tmp_path / args.exp_name / "metrics.jsonl") if '"s2l/alpha"' in line]
    assert [r["s2l/alpha"] for r in rows] == [1.0, 0.5] and [r["s2l/explorer_frac"] for r in rows] == [1.0, 0.5]
    assert "s2l/learner_reward" not in rows[0] and "s2l/learner_reward" in rows[1]
    assert s["learner"] == 5_140_480 and s["explorer"] == 652_544
    assert s["rollout_flops"] == rows[-1]["s2l/rollout_flops"] > rows[0]["s2l/rollout_flops"] > 0
    first = rows[0]["s2l/rollout_flops"] / (2 * 652_544)  # batch 1: the explorer's tokens only
    assert first == math.floor(first) and 16 <= first <= 16 * args.max_new_tokens  # 4 prompts x 4, 1 to 8 tokens


# ---- bad input ----
@pytest.mark.parametrize("change, message", [
    (dict(explorer_frac=1.5), "--explorer-frac"),
    (dict(explorer_frac=-0.1), "--explorer-frac"),
    (dict(explorer_frac=float("nan")), "--explorer-frac"),
    (dict(anneal_steps=-1), "--anneal-steps"),
    (dict(explorer_is_cap=0.0), "--explorer-is-cap"),
    (dict(explorer_is_cap=float("nan")), "--explorer-is-cap"),
    (dict(explorer=""), "--explorer"),
    (dict(group_size=1), "--group-size"),
])
def test_bad_flags_are_refused(change, message):
    with pytest.raises(SystemExit, match=message):
        s2l_po.check_args(replace(SMALL, **change))


def test_explorer_with_another_tokenizer_is_refused(tmp_path, monkeypatch):
    """The learner scores the explorer's token ids: an explorer with another vocabulary stops the run at start."""
    real = common.load_model

    def load(name, *a, **k):
        model, tok = real("tiny-0.6m" if name == "other" else name, *a, **k)
        if name == "other":
            tok = copy.deepcopy(tok)
            tok.add_tokens(["<extra>"])
        return model, tok

    monkeypatch.setattr(common, "load_model", load)
    with pytest.raises(SystemExit, match="--explorer other has another tokenizer"):
        s2l_po.main(replace(SMALL, explorer="other", out_dir=str(tmp_path)))
