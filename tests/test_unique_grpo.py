"""algos/unique_grpo.py: uniqueness weights against a loop, their GRPO degeneracies, the reach task, pass@k, learning."""
import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo, unique_grpo as m


def loop_weights(adv, labels, G, power):
    w = [1.0] * len(labels)
    for g in range(0, len(labels), G):
        pos = [i for i in range(g, g + G) if adv[i] > 0]
        raw = {i: sum(labels[j] == labels[i] for j in pos) ** -power for i in pos}
        for i in pos:
            w[i] = raw[i] / (sum(raw.values()) / len(pos))
    return w


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_uniqueness_weights_against_loop(power):
    rng = random.Random(power)
    G = 6
    r = torch.tensor([float(rng.random() < 0.5) for _ in range(8 * G)])
    labels = [rng.choice(["+", "++", "+-", "malformed"]) for _ in range(8 * G)]
    adv = grpo.group_advantages(r, G)
    w = m.uniqueness_weights(adv, labels, G, power)
    assert w.tolist() == pytest.approx(loop_weights(adv.tolist(), labels, G, power), rel=1e-6)
    got, w2 = m.uniqueness_advantages(r, labels, G, power=power)
    assert torch.equal(w, w2) and torch.allclose(got, adv * w)


def test_one_cluster_per_rollout_or_all_in_one_equals_grpo():
    torch.manual_seed(0)
    G = 8
    r = (torch.rand(5 * G) > 0.4).float()
    want = grpo.group_advantages(r, G)
    distinct = [str(i) for i in range(5 * G)]
    for labels in (distinct, ["+-"] * (5 * G)):
        for std_norm in (True, False):
            adv, w = m.uniqueness_advantages(r, labels, G, std_norm, power=1.0)
            assert torch.equal(adv, grpo.group_advantages(r, G, std_norm)) and torch.all(w == 1)
    # otherwise it differs (the test can fail): two clusters of unequal size among the successes
    mixed = ["+" if i % G < 2 else "++-" for i in range(5 * G)]
    assert not torch.allclose(m.uniqueness_advantages(r, mixed, G)[0], want)
    assert torch.equal(m.uniqueness_advantages(r, mixed, G, power=0.0)[0], want)  # alpha = 0: GRPO


def test_rare_correct_strategy_gets_more_credit_and_binary_advantages_still_sum_to_zero():
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    labels = ["++", "++", "++", "+-", "+", "malformed"]
    adv, w = m.uniqueness_advantages(r, labels, 6)
    assert adv[3] > adv[0] > 0 and adv[0] == adv[1] == adv[2]  # the lone "+-" success gets the most credit
    assert torch.equal(adv[4:], grpo.group_advantages(r, 6)[4:])  # failures keep GRPO's push down
    assert w[:4].mean().item() == pytest.approx(1.0) and abs(adv.sum().item()) < 1e-5


def test_strategy_label_is_the_operator_multiset():
    assert m.strategy_label("8+3") == m.strategy_label("3+8") == "+"
    assert m.strategy_label("5+8-3+1") == m.strategy_label("8-3+1+5") == "++-"
    assert m.strategy_label("68") == "" and m.strategy_label("2*3-1") == "*-"


def test_reach_task_verifier_and_split():
    t = m.ReachTask()
    assert t.verify("8+3", "3,5,8,1>11")[0] == 1.0
    assert t.verify("5+8-3+1", "3,5,8,1>11")[0] == 1.0
    assert t.verify("8+3+0", "3,5,8,1>11")[0] == 0.0  # 0 is not among the numbers
    assert t.verify("8+8-5", "3,5,8,1>11")[0] == 0.0  # 8 used twice, given once
    assert t.verify("9+2", "3,5,8,1>11")[0] == 0.0 and t.verify("11", "3,5,8,1>11")[0] == 0.0  # one number: no
    assert t.verify("8 + 3", "3,5,8,1>11")[1]["format"] == 0.0
    assert t.verify("3+3+5", "3,3,5,1>11")[0] == 1.0  # a repeated number may be used as often as it is given
    rng = np.random.default_rng(0)
    train, test = t.sample("train", 300, rng), t.sample("test", 300, rng)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    for e in train[:100] + test[:100]:
        assert t.verify(e.solution, e.answer)[0] == 1.0 and e.prompt == e.answer + ":"
        nums, target = e.answer.split(">")
        nums = tuple(int(x) for x in nums.split(","))
        sols = t.solutions(nums, int(target))
        assert len({s for _, s in sols}) >= 2  # several strategies reach every target
        # the enumeration is complete: every candidate over 2..4 of the numbers, brute force
        brute = set()
        for k in range(2, 5):
            for idx in itertools.permutations(range(4), k):
                for ops in itertools.product("+-", repeat=k - 1):
                    s = str(nums[idx[0]]) + "".join(o + str(nums[i]) for o, i in zip(ops, idx[1:]))
                    if t.verify(s, e.answer)[0]:
                        brute.add(s)
        assert brute == {s for s, _ in sols}


def test_pass_at_k_against_brute_force():
    for n, c in [(6, 0), (6, 2), (6, 6), (5, 3)]:
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert m.pass_at_k(n, c, k) == pytest.approx(sum(max(s) for s in subsets) / math.comb(n, k))


@pytest.fixture(scope="module")
def tiny():
    model, tok = common.load_model("tiny-reach", torch.device("cpu"))
    return model, tok, m.ReachTask()


def test_rollout_reweights_grpo_advantages_by_strategy(tiny):
    model, tok, task = tiny
    sampled = {}
    real = common.generate

    def spy(*a, **k):
        sampled["ro"] = real(*a, **k)
        return sampled["ro"]

    args = m.Args(prompts_per_step=16, group_size=8)
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "generate", spy)
        batch = m.rollout(model, tok, task, args, np.random.default_rng(0), torch.device("cpu"))
    texts = sampled["ro"].texts
    examples = task.sample("train", 16, np.random.default_rng(0))
    answers = [e.answer for e in examples for _ in range(8)]
    r = torch.tensor([task.verify(t, a)[0] for t, a in zip(texts, answers)])
    labels = [m.strategy_label(t) if task.verify(t, a)[1]["format"] else "malformed" for t, a in zip(texts, answers)]
    assert torch.equal(batch["rewards"], r)
    assert torch.allclose(batch["adv"], m.uniqueness_advantages(r, labels, 8)[0])


def test_diversity_eval_counts_strategies(tiny, monkeypatch):
    """Four fixed samples for each of two prompts '3,5,8,1>11': three right answers in two strategies ('+' twice,
    '++-' once), then none right. pass@k per prompt 3/4, 1, 1, 1 and 0, 0, 0, 0; distinct right strategies 2 and 0."""
    model, tok, task = tiny
    ex = llm.Example(prompt="3,5,8,1>11:", answer="3,5,8,1>11", solution="8+3")
    texts = ["8+3", "3+8", "5+8-3+1", "8+5"] + ["8+5", "1+1", "x", "3+5"]
    monkeypatch.setattr(m.common, "generate", lambda *a, **k: type("Ro", (), {"texts": texts})())
    out = m.diversity_eval(model, tok, task, [ex, ex], 4, 8, 1.0)
    assert out["eval/pass@1_sampled"] == pytest.approx(0.375) and out["eval/pass@4_curve"] == pytest.approx(0.5)
    assert out["eval/auc@4"] == pytest.approx((0.375 + 3 * 0.5) / 4)
    assert out["eval/distinct_strategies"] == pytest.approx(1.0)


SMALL = m.Args(steps=40, prompts_per_step=32, group_size=8, eval_every=40, eval_examples=300, pass_k=0,
               eval_hard=False, curve_k=0, out_dir="", exp_name="t", threads=1)


@pytest.mark.slow
def test_unique_grpo_learns(tmp_path):
    s = m.main(replace(SMALL, out_dir=str(tmp_path)))
    # stated margin: +4 points in 40 rollout batches of 32 prompts x 8 (the benchmark's alpha = 1 arm; measured, 1 thread:
    # 12.0 -> 20.0, 18.3, 19.3% for seeds 0, 1, 2; about 40 s); a flipped advantage sign loses accuracy
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.04, s


@pytest.mark.parametrize("change,msg", [({"uniqueness_power": -1.0}, "uniqueness-power"), ({"curve_k": -1}, "curve-k"),
                                        ({"group_size": 1}, "group-size"), ({"minibatches": 3}, "must divide")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        m.main(replace(SMALL, out_dir=str(tmp_path), **change))
