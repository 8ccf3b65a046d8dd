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
    (dict(rollout="beam"), "--rollout"),
    (dict(chains=0), "--chains"),
    (dict(chains=9, group_size=8), "--chains"),
    (dict(width_max=0), "--width-max"),
    (dict(entropy_low=1.0, entropy_high=1.0), "--entropy-high"),
    (dict(branch_conf=0.0), "--branch-conf"),
    (dict(prune_conf=1.5), "--prune-conf"),
    (dict(shape_coef=0.5), "--shape-coef"),
    (dict(token_budget=-1), "--token-budget"),
    (dict(width_conf_coef=-1.0), "--width-conf-coef"),
])
def test_bad_flags_are_refused(change, message):
    with pytest.raises(SystemExit, match=message):
        ttrl.check_args(replace(SMALL, **change))


# ---- ECHO's tree rollout ----
ECHO = replace(SMALL, rollout="tree-echo", group_size=8, chains=2)
ENTROPY = replace(ECHO, rollout="tree-entropy")


def naive_width(h, c, a):
    """The width rule written out: 1 + alpha (H - H_lo) / (H_hi - H_lo) [- beta (C - c_0) / c_0], rounded half up,
    clipped to [1, w_max]."""
    raw = 1.0 + a.width_entropy_coef * (h - a.entropy_low) / (a.entropy_high - a.entropy_low)
    if a.rollout == "tree-echo":
        raw = raw - a.width_conf_coef * (c - a.branch_conf) / a.branch_conf
    w = int(np.floor(raw + 0.5))
    return max(1, min(a.width_max, w))


def test_branch_width_on_hand_made_values_and_against_the_rule():
    """Defaults (alpha 2, beta 1, H in [0.1, 1.0], c_0 0.8, w_max 4): H = 0.55 is width 2 at C^G = c_0; low group
    confidence widens (C^G = 0.4: 2.5 -> 3), high narrows (1.0: 1.75 -> 2); the entropy arm ignores C^G. Then a grid
    of entropies, confidences and coefficients against the rule written out."""
    assert ttrl.branch_width(0.55, 0.8, ECHO) == 2
    assert ttrl.branch_width(0.55, 0.4, ECHO) == 3
    assert ttrl.branch_width(0.55, 1.0, ECHO) == 2
    assert ttrl.branch_width(0.55, 0.4, ENTROPY) == ttrl.branch_width(0.55, 1.0, ENTROPY) == 2
    assert ttrl.branch_width(0.0, 1.0, ECHO) == 1 and ttrl.branch_width(5.0, 0.1, ECHO) == 4  # clipped to [1, w_max]
    rng = random.Random(2)
    for _ in range(400):
        a = replace(rng.choice([ECHO, ENTROPY]), width_entropy_coef=rng.choice([0.0, 1.0, 2.0, 3.5]),
                    width_conf_coef=rng.choice([0.0, 1.0, 2.0]), width_max=rng.randint(1, 6),
                    branch_conf=rng.choice([0.5, 0.8, 1.0]))
        h, c = rng.uniform(0, 2), rng.uniform(0, 1)
        assert ttrl.branch_width(h, c, a) == naive_width(h, c, a), (h, c, a.rollout)


def test_window_mean_is_the_last_w_positions():
    x = [0.9, 0.5, 0.3, 1.0]
    assert ttrl.window_mean(x, 0, 2) == pytest.approx(0.9)  # fewer at the start of the path
    assert ttrl.window_mean(x, 2, 2) == pytest.approx(0.4)
    assert ttrl.window_mean(x, 3, 3) == pytest.approx(0.6)


def naive_prune(conf, start, window, thr, patience):
    for t in range(start, len(conf)):
        if t - patience + 1 < 0:
            continue
        lows = [np.mean(conf[max(0, s - window + 1):s + 1]) < thr for s in range(t - patience + 1, t + 1)]
        if all(lows):
            return t
    return None


def test_prune_point_ends_only_persistently_low_branches():
    """A branch ends where its group confidence stayed below the threshold for `patience` positions in a row, and only
    there: one low token is not enough, a run broken by a confident token restarts, positions before the segment's
    start count towards the run but are never cut. Then random paths against the rule written out."""
    assert ttrl.prune_point([0.9, 0.5, 0.5, 0.9], 0, 1, 0.7, 2) == 2
    assert ttrl.prune_point([0.9, 0.5, 0.9, 0.5, 0.9], 0, 1, 0.7, 2) is None  # never two in a row
    assert ttrl.prune_point([0.9, 0.5, 0.5, 0.9], 0, 1, 0.7, 3) is None  # patience 3: the run is 2
    assert ttrl.prune_point([0.5, 0.5, 0.5, 0.9], 3, 1, 0.7, 2) is None  # the run ended before the segment
    assert ttrl.prune_point([0.5, 0.5, 0.5, 0.9], 2, 1, 0.7, 2) == 2  # inherited low tokens count
    assert ttrl.prune_point([1.0, 0.3, 1.0, 1.0], 0, 2, 0.7, 2) == 2  # window 2: one very low token, two low means
    assert ttrl.prune_point([1.0, 0.5, 1.0, 1.0], 0, 2, 0.7, 2) is None  # (0.75, 0.75: not low)
    rng = random.Random(3)
    for _ in range(500):
        conf = [rng.choice([0.2, 0.5, 0.65, 0.75, 0.95, 1.0]) for _ in range(rng.randint(1, 9))]
        start, w, pat = rng.randint(0, len(conf) - 1), rng.randint(1, 3), rng.randint(1, 3)
        thr = rng.choice([0.6, 0.7, 0.8])
        assert ttrl.prune_point(conf, start, w, thr, pat) == naive_prune(conf, start, w, thr, pat), (conf, start, pat)


def hand_leaf(tokens, entropy, conf, pos=0, pruned=False, root=0):
    return {"tokens": tokens, "logprobs": [-0.1] * len(tokens), "entropy": entropy, "conf": conf, "pos": pos,
            "root": root, "finished": True, "pruned": pruned, "used": set()}


def test_round_requests_branch_at_the_highest_entropy_with_the_rule_width():
    """One tree of 2 leaves, G = 8: the point is leaf 0's token 1 (entropy 0.75, the highest legal one); group
    confidence over W = 2 tokens (1.0, 0.3) = 0.65: the entropy arm draws 2 continuations (2.44 -> 2), ECHO 3 (the low
    confidence adds 0.19); the point is then used. A pruned leaf is not branched from; a tree one leaf short draws
    one; a tree with no legal point gets fresh chains for all it lacks."""
    def tree(pruned0=False):
        return [hand_leaf([1, 2, 3], [0.1, 0.75, 0.3], [1.0, 0.3, 1.0], pruned=pruned0),
                hand_leaf([4, 5, 6], [0.1, 0.2, 0.6], [1.0, 1.0, 1.0], root=1)]
    for args, width in ((ENTROPY, 2), (ECHO, 3)):
        counts = dict(points=0, fallback=0)
        trees = [tree()]
        assert ttrl.round_requests(trees, args, random.Random(0), counts) == [(0, 0, 1)] * width
        assert trees[0][0]["used"] == {1} and counts == dict(points=1, fallback=0)
        naive = naive_width(0.75, (1.0 + 0.3) / 2, args)
        assert naive == width
    assert ttrl.round_requests([tree(pruned0=True)], ECHO, random.Random(0), dict(points=0, fallback=0)) == \
        [(0, 1, 2)] * ttrl.branch_width(0.6, 1.0, ECHO)
    full = tree() + [hand_leaf([7], [0.1], [1.0], root=2)] * 5  # 7 leaves: one short
    assert ttrl.round_requests([full], ECHO, random.Random(0), dict(points=0, fallback=0)) == [(0, 0, 1)]
    bare = [hand_leaf([1], [0.9], [1.0]), hand_leaf([2], [0.9], [1.0], root=1)]  # one-token leaves: no legal point
    counts = dict(points=0, fallback=0)
    assert ttrl.round_requests([bare], ECHO, random.Random(0), counts) == [(0, -1, 0)] * 6 and counts["fallback"] == 6


def fake_sample_fn(low_chain: int, calls: list):
    """Paths of 4 tokens, entropy rising along the path (0.2, 0.3, 0.4, 0.5); every token confident (C = 1) except on
    chain `low_chain` of each prompt, whose tokens 1 and 2 have C = 0.5, and chain 1 - low_chain, whose tokens 1 and 3
    have C = 0.5 (low twice, never twice in a row)."""
    def sample(groups, prefixes, budgets):
        segs, first = [], not calls
        calls.append(list(zip(groups, map(len, prefixes))))
        for r, (g, pre) in enumerate(zip(groups, prefixes)):
            n = 4 - len(pre)
            conf = [1.0] * n
            if first:
                conf = [1.0, 0.5, 0.5, 1.0] if r % 2 == low_chain else [1.0, 0.5, 1.0, 0.5]
            segs.append({"tokens": [1000 * len(calls) + 10 * r + i for i in range(n)], "logprobs": [-0.1] * n,
                         "entropy": [0.2 + 0.1 * (len(pre) + i) for i in range(n)], "conf": conf, "finished": True})
        return segs
    return sample


@pytest.mark.parametrize("low_chain", [0, 1])
def test_grow_trees_prunes_the_persistently_low_chain_and_no_other(low_chain):
    """Two prompts, 2 chains each, G = 8, W = 1, patience 2, tau 0.7: under tree-echo exactly the chain with two low
    tokens in a row is pruned, cut after its second (3 tokens kept), nothing is branched from it and the tree grows
    G unpruned leaves besides it; under tree-entropy nothing is pruned and each tree has G leaves. Sampled tokens are
    the own segments, the pruned one's included."""
    args = replace(ECHO, conf_window=1, prune_patience=2, prune_conf=0.7)
    calls = []
    trees, counts = ttrl.grow_trees(fake_sample_fn(low_chain, calls), 2, args, random.Random(0))
    for tree in trees:
        assert len(tree) == 9
        assert [leaf["pruned"] for leaf in tree] == [i == low_chain for i in range(9)]
        assert len(tree[low_chain]["tokens"]) == 3 and not tree[low_chain]["finished"]
        assert all(leaf["root"] == 1 - low_chain for i, leaf in enumerate(tree) if i >= 2)  # branched off the other
    assert counts["pruned"] == 2
    assert counts["sampled"] == sum(len(leaf["tokens"]) - leaf["pos"] for tree in trees for leaf in tree)
    trees, counts = ttrl.grow_trees(fake_sample_fn(low_chain, []), 2, replace(args, rollout="tree-entropy"),
                                    random.Random(0))
    assert counts["pruned"] == 0 and all(not leaf["pruned"] for tree in trees for leaf in tree)
    assert all(len(tree) == 8 for tree in trees)


def test_effective_branches_count_distinct_unpruned_trajectories():
    """Distinct leaf token sequences per tree, pruned leaves left out, averaged over trees; tree_metrics reports it
    with the share of unpruned leaves under the most branched chain."""
    a = [hand_leaf([1, 2], [0, 0], [1, 1]), hand_leaf([1, 2], [0, 0], [1, 1]), hand_leaf([1, 3], [0, 0], [1, 1]),
         hand_leaf([4], [0], [1], pruned=True, root=1)]
    b = [hand_leaf([5], [0], [1]), hand_leaf([6], [0], [1], root=1), hand_leaf([7], [0], [1], root=1),
         hand_leaf([8], [0], [1], root=1)]
    assert ttrl.effective_branches([a]) == 2 and ttrl.effective_branches([b]) == 4
    assert ttrl.effective_branches([a, b]) == 3
    m = ttrl.tree_metrics([a, b], dict(sampled=10, points=3, fallback=1, pruned=1))
    assert m["rollout/effective_branches"] == 3 and m["rollout/root_share"] == pytest.approx((3 / 3 + 3 / 4) / 2)
    assert m["rollout/pruned_frac"] == 1 / 8 and m["rollout/branch_points"] == 1.5 and m["rollout/leaf_tokens"] == 10


@pytest.mark.parametrize("args", [replace(ENTROPY, chains=8),
                                  replace(ECHO, chains=8, prune_conf=0.0, adaptive_clip=False, shape_coef=0.0)],
                         ids=["entropy", "echo"])
def test_tree_without_branching_is_the_group_rollout(args):
    """--chains G: no branching round (and no pruning): the tree rollout draws exactly the group rollout's completions
    (one generate call over the same rows), so tokens, behaviour log-probs, rewards and advantages are identical."""
    model, tok = common.load_model("tiny-0.6m", "cpu")
    task, out = llm.make_task("add", 2), []
    for a in (replace(args, rollout="group"), args):
        torch.manual_seed(4)
        out.append(ttrl.rollout(common.Sampler(model), tok, task, a, np.random.default_rng(4), "cpu"))
    plain, tree = out
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "rewards", "adv"):
        assert torch.equal(plain[k], tree[k]), k
    assert plain["reward_terms"] == tree["reward_terms"] and plain["finish_reasons"] == tree["finish_reasons"]
    assert tree["tree"]["rollout/branch_points"] == 0 and tree["rewards"].std() > 0


def test_tree_rollout_batch_reports_its_effective_branches():
    """A real tree-entropy batch (no pruning): rollout/effective_branches equals the distinct completion rows of each
    group counted from the batch itself; every group has G rows and the trees sampled fewer tokens than their leaves
    hold (shared prefixes)."""
    model, tok = common.load_model("tiny-0.6m", "cpu")
    torch.manual_seed(5)
    b = ttrl.rollout(common.Sampler(model), tok, llm.make_task("add", 2), replace(ENTROPY, prompts_per_step=8),
                     np.random.default_rng(5), "cpu")
    rows = [tuple(x for x, m in zip(ids, mask) if m) for ids, mask in
            zip(b["completion_ids"].tolist(), b["completion_mask"].tolist())]
    assert len(rows) == 8 * 8
    want = np.mean([len(set(rows[g:g + 8])) for g in range(0, 64, 8)])
    assert b["tree"]["rollout/effective_branches"] == pytest.approx(want)
    assert b["tree"]["rollout/sampled_tokens"] < b["tree"]["rollout/leaf_tokens"] == int(b["completion_mask"].sum())


# ---- ECHO's update ----
def test_adaptive_clip_and_hybrid_weight_against_naive_loops():
    """eps_i from the mean confidence of each completion's last 16 tokens; w_t = 1 + a clamp(z(H) + z(1 - C), -2, 2),
    z over the batch's completion tokens only (padding ignored)."""
    g = torch.Generator().manual_seed(6)
    B, C = 5, 20
    lengths = [20, 3, 16, 17, 1]
    mask = (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).float()
    conf, ent = torch.rand(B, C, generator=g), 2 * torch.rand(B, C, generator=g)
    eps = ttrl.adaptive_clip(conf, mask)
    for i, n in enumerate(lengths):
        tail = conf[i, max(0, n - 16):n].mean().item()
        assert eps[i, 0].item() == pytest.approx(0.05 + 0.15 / (1 + np.exp(-4 * (1 - tail))), rel=1e-6)
    w = ttrl.hybrid_weight(ent, conf, mask, 0.1)
    hs = [ent[i, j].item() for i, n in enumerate(lengths) for j in range(n)]
    us = [1 - conf[i, j].item() for i, n in enumerate(lengths) for j in range(n)]
    zs = lambda xs, x: (x - np.mean(xs)) / np.sqrt(np.var(xs) + 1e-8)  # noqa: E731
    for i, n in enumerate(lengths):
        for j in range(C):
            want = 1 + 0.1 * np.clip(zs(hs, ent[i, j].item()) + zs(us, 1 - conf[i, j].item()), -2, 2) if j < n else 0
            assert w[i, j].item() == pytest.approx(want, abs=1e-5)


def test_grpo_loss_takes_each_completions_clip_range_and_token_weights():
    """With clip_eps [b, 1] and tok_weight [b, C] in the micro-batch, the loss is seq-mean of
    w_t * -min(rho A, clip(rho, 1 - eps_i, 1 + eps_i) A), written out as a loop."""
    g = torch.Generator().manual_seed(7)
    b, C = 4, 6
    logp, old = -torch.rand(b, C, generator=g), -torch.rand(b, C, generator=g)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -2.0]), (torch.rand(b, C, generator=g) > 0.2).float()
    eps, w = torch.tensor([[0.05], [0.1], [0.2], [0.15]]), 0.8 + 0.4 * torch.rand(b, C, generator=g)
    mb = {"old": old, "adv": adv, "mask": mask, "ref": None, "clip_eps": eps, "tok_weight": w}
    loss, _ = ttrl.grpo_loss(logp, mb, b, int(mask.sum()), SMALL)
    want = 0.0
    for i in range(b):
        terms = []
        for t in range(C):
            if mask[i, t]:
                r = float(np.exp(logp[i, t] - old[i, t]))
                e = eps[i, 0].item()
                terms.append(w[i, t].item() * -min(r * adv[i].item(), min(max(r, 1 - e), 1 + e) * adv[i].item()))
        want += np.mean(terms) / b if terms else 0.0
    assert loss.item() == pytest.approx(want, rel=1e-5)


@pytest.mark.numerics
def test_short_echo_run_does_not_collapse(tmp_path):
    """3 batches of 8 prompts x 8 leaves of tree-echo training on tiny-0.6m at lr 1e-4: every batch keeps at least 2
    distinct unpruned trajectories per tree on average (3.0 to 4.25 measured over 6 batches) and no chain takes more
    than 80% of a tree's leaves (0.55 to 0.64 measured); the losses stay finite and pruning happens."""
    args = replace(ECHO, steps=3, prompts_per_step=8, eval_every=3, eval_examples=10, lr=1e-4, out_dir=str(tmp_path))
    s = ttrl.main(args)
    rows = [json.loads(line) for line in open(tmp_path / args.exp_name / "metrics.jsonl")
            if "rollout/root_share" in line]
    assert len(rows) == 3
    assert all(r["rollout/effective_branches"] >= 2 for r in rows), [r["rollout/effective_branches"] for r in rows]
    assert all(r["rollout/root_share"] <= 0.8 for r in rows)
    assert all(np.isfinite(r["loss/pg"]) for r in rows) and s["pruned_frac"] > 0


def test_token_budget_stops_the_run(tmp_path):
    """--token-budget ends the run at the first batch whose sampled tokens reach it (with its evaluation), counting a
    tree's shared prefixes once."""
    args = replace(ENTROPY, steps=50, prompts_per_step=4, token_budget=150, eval_every=50, eval_examples=10,
                   out_dir=str(tmp_path))
    s = ttrl.main(args)
    assert 1 <= s["batches"] < 50 and s["gen_tokens"] >= 150 and s["gen_tokens"] == s["tree_sampled_tokens"]
    assert s["gen_tokens"] - 150 < 4 * 8 * args.max_new_tokens  # stopped at the batch that crossed it
