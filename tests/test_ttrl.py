"""algos/ttrl.py: the majority vote and its tie rule, TTRL's and DARE's rewards (distribution, pruning, bonus) against
naive loops on hand-made groups, the reference answer kept out of every training reward, the unlabelled prompts drawn
from the split asked for, a short learning run and bad flags refused."""
import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import ttrl

SMALL = ttrl.Args(steps=2, prompts_per_step=4, group_size=4, eval_every=1, eval_examples=20, pass_k=0, eval_hard=False,
                  threads=1, out_dir="/tmp/test_ttrl", model="tiny-0.6m")


# ---- the vote ----
def test_majority_vote_ties_go_to_the_answer_sampled_first():
    assert ttrl.majority_vote(["3", "5", "3", "5"]) == "3"  # a 2-2 tie: the first sampled wins
    assert ttrl.majority_vote(["5", "3", "3", "5"]) == "5"
    assert ttrl.majority_vote(["5", "3", "3", "5", "3"]) == "3"  # no tie: the count decides, not the order
    assert ttrl.majority_vote([None, "7", None, None]) == "7"  # no answer is not a vote
    assert ttrl.majority_vote([None, None]) is None


def test_majority_rewards_against_naive_loop():
    """r_i = 1[a_i = the most frequent answer, first-sampled on ties], all 0 without any answer."""
    rng = random.Random(0)
    for _ in range(300):
        g = rng.randint(2, 9)
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(g)]
        counts = {}
        for a in answers:
            if a is not None:
                counts[a] = counts.get(a, 0) + 1
        best = None
        for a in answers:  # the first answer, in sampling order, whose count is the largest
            if a is not None and counts[a] == max(counts.values()):
                best = a
                break
        want = [1.0 if best is not None and a == best else 0.0 for a in answers]
        assert ttrl.majority_rewards(answers) == want, answers
    assert ttrl.majority_rewards([None, None, None]) == [0.0, 0.0, 0.0]


# ---- DARE ----
def naive_dare(answers, conf, prune, bonus):
    g = len(answers)
    n = {a: sum(1 for b in answers if b == a) for a in answers if a is not None}
    kept = [a for a in n if n[a] / g >= prune]
    total = sum(n[a] for a in kept)
    top = max((n[a] for a in kept), default=0)
    out = []
    for a, c in zip(answers, conf):
        if a is None or a not in kept:
            out.append(0.0)
        else:
            out.append(n[a] / total + (bonus * c if n[a] < top else 0.0))
    return out


def test_dare_rewards_on_a_hand_made_group():
    """8 completions: a x4, b x2, c x1, no answer x1. Pruning at 0.2 drops c (1/8); the kept distribution is a 4/6,
    b 2/6; b, below the top count, gets the bonus 0.5 x its confidence."""
    answers = ["a", "b", "a", "c", None, "b", "a", "a"]
    conf = [0.9, 0.6, 0.8, 0.7, 0.1, 0.4, 0.9, 0.9]
    got = ttrl.dare_rewards(answers, conf, prune=0.2, bonus=0.5)
    want = [4 / 6, 2 / 6 + 0.3, 4 / 6, 0.0, 0.0, 2 / 6 + 0.2, 4 / 6, 4 / 6]
    assert got == pytest.approx(want, abs=1e-12)
    # no pruning, no bonus: the bare share among the answers given (c now counts, 1/7)
    got = ttrl.dare_rewards(answers, conf, prune=0.0, bonus=0.0)
    assert got == pytest.approx([4 / 7, 2 / 7, 4 / 7, 1 / 7, 0.0, 2 / 7, 4 / 7, 4 / 7], abs=1e-12)
    # a tie at the top: both answers are the majority, no bonus, and the order does not matter
    assert ttrl.dare_rewards(["x", "y", "y", "x"], [1.0] * 4, 0.2, 0.5) == [0.5] * 4
    # everything pruned (all answers distinct, each 1/4 < 0.3): no signal
    assert ttrl.dare_rewards(["1", "2", "3", "4"], [1.0] * 4, 0.3, 0.5) == [0.0] * 4


def test_dare_rewards_against_naive_loop():
    """Random groups, confidences, thresholds and bonuses against the loop above; catches a share over G instead of
    the kept answers, pruning after the renormalisation, a bonus on the majority or on pruned answers."""
    rng = random.Random(1)
    for _ in range(500):
        g = rng.randint(2, 12)
        answers = [rng.choice(["1", "2", "3", "4", None]) for _ in range(g)]
        conf = [rng.random() for _ in range(g)]
        prune, bonus = rng.choice([0.0, 0.1, 0.2, 0.34, 0.5]), rng.choice([0.0, 0.3, 1.0])
        got = ttrl.dare_rewards(answers, conf, prune, bonus)
        assert got == pytest.approx(naive_dare(answers, conf, prune, bonus), abs=1e-12), (answers, prune, bonus)


def test_pseudo_rewards_match_the_per_group_rules():
    """Group-major lists: each group's slice gets its own vote, in either mode."""
    answers = ["1", "1", "2", None, "5", "6", "6", "6"]
    conf = [0.5] * 8
    maj = replace(SMALL, reward_mode="majority")
    assert ttrl.pseudo_rewards(answers, conf, 4, maj) == ttrl.majority_rewards(answers[:4]) + \
        ttrl.majority_rewards(answers[4:])
    dare = replace(SMALL, reward_mode="dare", prune_threshold=0.3, explore_bonus=0.5)
    assert ttrl.pseudo_rewards(answers, conf, 4, dare) == ttrl.dare_rewards(answers[:4], conf[:4], 0.3, 0.5) + \
        ttrl.dare_rewards(answers[4:], conf[4:], 0.3, 0.5)


def test_answer_of_reads_the_final_answer_without_a_reference():
    add, words = llm.make_task("add", 2), llm.make_task("words")
    assert ttrl.answer_of(add, " 68 ") == "68"
    assert ttrl.answer_of(add, "") is None
    assert ttrl.answer_of(llm.make_task("addsteps", 2), "3+5=8;2+4=6;=68") == "68"
    assert ttrl.answer_of(words, "She has 12 pens, so 19.") == "19"
    assert ttrl.answer_of(words, "no number here") is None


def test_label_stats_against_hand_count():
    """Two prompts of 4: the first votes the right 68 (2 of 4, first sampled in a tie), the second votes a wrong 13
    with 3 of 4 (locked, at the 3/4 share)."""
    task = llm.make_task("add", 2)
    texts = ["68", "67", "67", "68", "13", "13", "12", "13"]
    answers = [ttrl.answer_of(task, t) for t in texts]
    s = ttrl.label_stats(answers, texts, ["68", "12"], 4, task)
    assert s == {"ttrl/label_acc": 0.5, "ttrl/wrong_majority": 0.5, "ttrl/locked_wrong": 0.5,
                 "ttrl/true_reward": 3 / 8}


# ---- the reference answer never reaches the training reward ----
class PlantedKey:
    """The task with every reference answer replaced by one no completion can give (a letter in front)."""

    def __init__(self, task):
        self.task = task

    def sample(self, split, n, rng):
        return [llm.Example(e.prompt, "x" + e.answer, e.solution) for e in self.task.sample(split, n, rng)]

    def __getattr__(self, name):
        return getattr(self.task, name)


@pytest.mark.parametrize("mode", ["majority", "dare"])
def test_planted_wrong_answer_key_leaves_training_batch_unchanged(mode):
    """The same rollout under the true key and under a wrong one: rewards, advantages and tokens are identical (the
    vote never reads the key); the logged label figures do change, so the planted key did take effect."""
    model, tok = common.load_model("tiny-0.6m", "cpu")
    args = replace(SMALL, prompts_per_step=16, group_size=8, reward_mode=mode)
    task = llm.make_task("add", 2)
    out = []
    for t in (task, PlantedKey(task)):
        torch.manual_seed(0)
        out.append(ttrl.rollout(common.Sampler(model), tok, t, args, np.random.default_rng(0), "cpu"))
    true, planted = out
    for k in ("completion_ids", "rewards", "adv"):
        assert torch.equal(true[k], planted[k]), k
    assert true["rewards"].std() > 0  # a real signal, not all zeros
    assert planted["reward_terms"]["ttrl/true_reward"] == 0.0 < true["reward_terms"]["ttrl/true_reward"]
    assert planted["reward_terms"]["ttrl/label_acc"] == 0.0 < true["reward_terms"]["ttrl/label_acc"]


def test_rollout_rewards_match_dare_with_the_sampler_confidence():
    """In a real rollout, DARE's bonus uses c_i = exp(mean log pi_sampler) over the completion's own tokens: rewards
    recomputed from the decoded answers and the batch's behaviour log-probs agree; a sum instead of a mean, or padding
    counted, would change every bonus."""
    model, tok = common.load_model("tiny-0.6m", "cpu")
    args = replace(SMALL, prompts_per_step=16, group_size=8, reward_mode="dare", explore_bonus=1.0)
    task = llm.make_task("add", 2)
    torch.manual_seed(1)
    batch = ttrl.rollout(common.Sampler(model), tok, task, args, np.random.default_rng(1), "cpu")
    texts = tok.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    answers = [ttrl.answer_of(task, t) for t in texts]
    conf = []
    for lp, m in zip(batch["logprobs"].tolist(), batch["completion_mask"].tolist()):
        toks = [x for x, keep in zip(lp, m) if keep]
        conf.append(float(np.exp(sum(toks) / len(toks))))
    want = ttrl.pseudo_rewards(answers, conf, args.group_size, args)
    assert torch.allclose(batch["rewards"], torch.tensor(want, dtype=batch["rewards"].dtype), atol=1e-5)
    n = batch["completion_mask"].sum(1).tolist()
    assert len(set(n)) > 1  # completions of different lengths: the padding matters
    assert want != ttrl.pseudo_rewards(answers, conf, args.group_size, replace(args, explore_bonus=0.0))  # bonus paid


@pytest.mark.parametrize("split", ["test", "train"])
def test_rollout_prompts_come_from_the_split_asked_for(split):
    """--train-split test draws held-out prompts (test-time RL), train draws training prompts."""
    model, tok = common.load_model("tiny-0.6m", "cpu")
    args = replace(SMALL, prompts_per_step=16, group_size=2, train_split=split)
    batch = ttrl.rollout(common.Sampler(model), tok, llm.make_task("add", 2), args, np.random.default_rng(3), "cpu")
    prompts = tok.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    pairs = [tuple(int(x) for x in p.strip().rstrip("=").split("+")) for p in prompts]
    assert all(llm.ArithmeticTask.is_held_out(a, b) == (split == "test") for a, b in pairs), pairs


# ---- learning ----
@pytest.mark.parametrize("mode", ["majority", "dare"])
def test_learns_to_agree_without_labels(mode, tmp_path):
    """What test-time RL optimises without labels: the group's agreement. 24 batches of 16 prompts x 8 on tiny-0.6m
    at grpo's lr (1e-4): the mean pseudo-reward of the last 6 batches is above that of the first 6 and the groups give
    fewer distinct answers (about +0.15 and -1.0 on this run; a sign error in the update reverses both). True accuracy
    is not asserted: it follows the vote, which tiny-0.6m gets right on only about 40% of prompts (the benchmark
    measures it on tiny-5m)."""
    args = replace(SMALL, steps=24, prompts_per_step=16, group_size=8, eval_every=24, lr=1e-4, reward_mode=mode,
                   out_dir=str(tmp_path))
    s = ttrl.main(args)
    rows = [json.loads(line) for line in open(tmp_path / args.exp_name / "metrics.jsonl") if '"rollout/reward"' in line]
    first, last = rows[:6], rows[-6:]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs]))  # noqa: E731
    assert mean(last, "rollout/reward") > mean(first, "rollout/reward") + 0.05
    assert mean(last, "ttrl/distinct_answers") < mean(first, "ttrl/distinct_answers") - 0.3
    assert s["distinct_answers_last"] < s["distinct_answers_first"]  # the summary reads the same history


# ---- bad input ----
@pytest.mark.parametrize("change, message", [
    (dict(reward_mode="vote"), "--reward-mode"),
    (dict(train_split="dev"), "--train-split"),
    (dict(prune_threshold=1.5), "--prune-threshold"),
    (dict(prune_threshold=-0.1), "--prune-threshold"),
    (dict(explore_bonus=-1.0), "--explore-bonus"),
    (dict(explore_bonus=float("nan")), "--explore-bonus"),
    (dict(group_size=1), "--group-size"),
])
def test_bad_flags_are_refused(change, message):
    with pytest.raises(SystemExit, match=message):
        ttrl.check_args(replace(SMALL, **change))
