"""algos/nudge_rl.py: the inter/intra-context advantage split and the distillation loss against hand-computed values,
one empty hint without distillation = GRPO exactly (same rollouts, same update), the hint contexts, P^2O's random
search and LENS's noise and purification on hand-built cases, a short learning run over two seeds, bad flags."""
import dataclasses
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo, nudge_rl

SMALL = nudge_rl.Args(steps=2, prompts_per_step=4, group_size=4, eval_every=2, eval_examples=20, threads=1,
                      out_dir="/tmp/test_nudge_rl")


# ---- the equations ----
def test_inter_intra_advantages_by_hand():
    """One prompt, 2 hints x 3 rollouts: rewards (1, 0, 0 | 1, 1, 0). Intra: each hint's GRPO, mean 1/3 and 2/3,
    std 0.57735 each; inter: the hint means 1/3, 2/3 centred (-1/6, +1/6) over their std 0.2357 = -+0.70711."""
    r = torch.tensor([1.0, 0, 0, 1, 1, 0])
    adv, intra, inter = nudge_rl.inter_intra_advantages(r, 6, 2, inter_coef=0.5, eps=0.0)
    s = (1 / 3) ** 0.5  # the unbiased std of (1, 0, 0)
    want_intra = torch.tensor([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]) / s
    want_inter = torch.tensor([-1, -1, -1, 1, 1, 1]) * 2 ** -0.5
    assert torch.allclose(intra, want_intra, atol=1e-5) and torch.allclose(inter, want_inter, atol=1e-5)
    assert torch.allclose(adv, want_intra + 0.5 * want_inter, atol=1e-5)
    # no std normalisation (Dr. GRPO): the bare centred values
    adv, intra, inter = nudge_rl.inter_intra_advantages(r, 6, 2, inter_coef=1.0, std_norm=False)
    assert torch.allclose(inter, torch.tensor([-1 / 6] * 3 + [1 / 6] * 3))
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]) + inter)


def test_inter_intra_advantages_against_loop():
    g = torch.Generator().manual_seed(0)
    for P, K, m in ((3, 2, 4), (2, 4, 2), (1, 1, 8)):
        r = torch.randint(0, 2, (P * K * m,), generator=g).float()
        adv, _, _ = nudge_rl.inter_intra_advantages(r, K * m, K, inter_coef=0.7)
        for p in range(P):
            means = [r[(p * K + k) * m:(p * K + k + 1) * m].mean() for k in range(K)]
            for k in range(K):
                block = r[(p * K + k) * m:(p * K + k + 1) * m]
                for j in range(m):
                    a = (block[j] - block.mean()) / (block.std() + 1e-6)
                    b = (means[k] - torch.stack(means).mean()) / (torch.stack(means).std() + 1e-6) if K > 1 else 0
                    assert abs(adv[(p * K + k) * m + j] - (a + 0.7 * b)) < 1e-5


def test_one_hint_is_grpo_advantage():
    r = torch.tensor([1.0, 0, 1, 1, 0, 0, 0, 1])
    adv, _, inter = nudge_rl.inter_intra_advantages(r, 4, 1)
    assert torch.equal(adv, grpo.group_advantages(r, 4)) and not inter.any()


def test_distill_token_loss_and_nudge_loss_by_hand():
    """Two rows: a rollout (A = 1, distill weight 0) and a distillation row (weight 1). On-policy ratio 1, so the
    rollout's per-token loss is -A = -1; the distillation row's is -log p. seq-mean over N = 2 rows:
    J = (1/2) [-1] + coef * (1/2) [-(log 0.5 + log 0.25) / 2]."""
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.25]]))
    w = torch.tensor([0.0, 1.0])
    assert torch.allclose(nudge_rl.distill_token_loss(logp, w), torch.tensor([[0.0, 0.0], [0.6931, 1.3863]]),
                          atol=1e-4)
    mb = {"adv": torch.tensor([1.0, 0.0]), "mask": torch.ones(2, 2), "old": logp.clone(), "ref": None,
          "is_weight": None, "distill": w}
    args = replace(SMALL, distill_coef=0.5)
    loss, stats = nudge_rl.nudge_loss(logp, mb, 2, 4, args)
    want = 0.5 * -1 + 0.5 * 0.5 * (0.6931 + 1.3863) / 2
    assert abs(loss.item() - want) < 1e-4 and "distill" in stats
    loss0, _ = nudge_rl.nudge_loss(logp, mb, 2, 4, replace(SMALL, distill_coef=0.0))
    assert abs(loss0.item() - grpo.grpo_loss(logp, mb, 2, 4, SMALL)[0].item()) < 1e-7


# ---- contexts, search, noise, purification ----
def test_hint_contexts_and_their_rewards():
    ex = llm.ArithmeticTask("add", 2).make(47, 85)
    assert nudge_rl.hint_context(ex, None) == ("47+85=", None)
    assert nudge_rl.hint_context(ex, 0) == ("47+85:", "")
    assert nudge_rl.hint_context(ex, 1) == ("47+85:7+5=12;", "7+5=12;")
    task, args = llm.ArithmeticTask("add", 2), SMALL
    texts = ["132", "4+8+1=13;=132", "4+8=12;=132", "4+8+1=13;=131"]
    shown = [None, "7+5=12;", "7+5=12;", "7+5=12;"]
    r, tr, _ = nudge_rl.hinted_rewards(texts, shown, ["47+85="] + ["47+85:7+5=12;"] * 3, ["132"] * 4, [4, 14, 12, 14],
                                       task, args)
    assert r == [1.0, 1.0, 1.0, 0.0]  # the scratchpad verifier checks the format and the final answer, not each step
    assert tr == ["132", "132", "132", "131"]  # a hinted rollout transfers its final answer
    assert nudge_rl.p2o_pool(3) == [0, 1, 2]


def test_random_search_stops_at_the_first_success():
    """Pool of 4 candidates; prompt 0 succeeds only with 'c', prompt 1 never, prompt 2 with anything. A search of 3
    tries follows each prompt's own random order and stops at its first success."""
    pool, calls = ["a", "b", "c", "d"], []

    def try_fn(pairs):
        calls.append(list(pairs))
        return [(g == 0 and c == "c") or g == 2 for g, c in pairs]

    found, tried = nudge_rl.random_search(3, pool, 3, try_fn, np.random.default_rng(3))
    ref = np.random.default_rng(3)  # each prompt's own order: one permutation per prompt, drawn in turn
    orders = [[pool[i] for i in ref.permutation(4)] for _ in range(3)]
    assert found[2] == orders[2][0] and tried[2] == orders[2][:1]  # solved in the first round
    assert found[1] is None and tried[1] == orders[1][:3]  # never: 3 tries, no more
    k = orders[0].index("c")
    assert (found[0], tried[0]) == (("c", orders[0][:k + 1]) if k < 3 else (None, orders[0][:3]))
    # a naive loop over rounds: the prompts still unsolved at round t are the ones tried in it
    want, solved = [], set()
    for t in range(3):
        todo = [(g, orders[g][t]) for g in range(3) if g not in solved]
        want.append(todo)
        solved |= {g for g, c in todo if (g == 0 and c == "c") or g == 2}
    assert calls == [w for w in want if w]
    assert nudge_rl.random_search(2, ["a"], 5, lambda pairs: [False] * len(pairs), np.random.default_rng(0))[1] == \
        [["a"], ["a"]]  # never more tries than candidates


def test_noisy_task_is_deterministic_and_keeps_the_answer():
    task = nudge_rl.NoisyTask(llm.ArithmeticTask("add", 2), 2)
    a = task.sample("test", 20, np.random.default_rng(0))
    b = task.sample("test", 20, np.random.default_rng(0))
    assert [e.prompt for e in a] == [e.prompt for e in b]
    for e in a:
        assert sum(c.isalpha() for c in e.prompt) == 2 and "".join(c for c in e.prompt if not c.isalpha()) == e.clean
        assert task.verify(e.answer, e.answer)[0] == 1.0
    s, where = nudge_rl.inject_noise("12+34=", 3, np.random.default_rng(1))
    assert len(s) == 9 and all(s[i].isalpha() for i in where) and len(where) == 3


def test_interference_tokens_and_purify_by_hand():
    surprisal = torch.tensor([[0.0, 1.0, 9.0, 2.0, 9.0, 0.5], [0.0, 3.0, 1.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    assert nudge_rl.interference_tokens(surprisal, valid, 2) == [[2, 4], [1, 2]]  # ties: the earlier first
    assert nudge_rl.interference_tokens(surprisal, valid, 5)[1] == [1, 2]  # never more than the valid tokens
    _, tok = common.load_model("tiny-0.6m")
    ids = common.encode_prompts(tok, ["1x2+3q4="])
    assert nudge_rl.purify(tok, ids, [[2, 6]]) == ["12+34="]  # position 0 is BOS


def test_surprisal_finds_injected_letters_in_the_tiny_policy():
    """The tiny policy never saw a letter in a prompt: removing the 2 highest-surprisal tokens restores the clean
    prompt on a share of them. Measured: 7 of 20 prompts restored exactly (2 distractor letters; the tiny policy never
    learned the prompts' own statistics, so a digit after a letter is surprising too). Deleting 2 of the 7 non-BOS
    tokens at random restores one prompt in 21 (about 1 of 20): the threshold, 4, is 4x that and under the 7 seen."""
    model, tok = common.load_model("tiny-0.6m")
    task = nudge_rl.NoisyTask(llm.ArithmeticTask("add", 2), 2)
    exs = task.sample("train", 20, np.random.default_rng(0))
    ids, s, valid = nudge_rl.prompt_surprisal(model, tok, [e.prompt for e in exs])
    clean = nudge_rl.purify(tok, ids, nudge_rl.interference_tokens(s, valid, 2))
    assert sum(c == e.clean for c, e in zip(clean, exs)) >= 4


# ---- the tie to the parent ----
def test_one_empty_hint_without_distillation_is_grpo(tmp_path):
    """hints = (none,), distill_coef = 0: the same rollouts, rewards, advantages and parameters after an update."""
    args = replace(SMALL, hints=("none",), distill_coef=0.0, max_new_tokens=8, lr=1e-3)
    gargs = grpo.Args(**{f.name: getattr(args, f.name) for f in dataclasses.fields(grpo.Args)})
    task = llm.ArithmeticTask("add", 2)
    out = {}
    for name, mod, a in (("grpo", grpo, gargs), ("nudge", nudge_rl, args)):
        torch.manual_seed(0)
        model, tok = common.load_model("tiny-0.6m")
        model.train()
        sampler = common.Sampler(model)
        batch = mod.rollout(sampler, tok, task, a, np.random.default_rng(5), torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        accel = type("A", (), {"num_processes": 1, "device": torch.device("cpu")})()
        loss_fn = grpo.grpo_loss if mod is grpo else nudge_rl.nudge_loss
        mod.update(model, opt, batch, loss_fn, a, 1, accel, sampler)
        out[name] = (batch, [p.detach().clone() for p in model.parameters()])
    (bg, pg), (bn, pn) = out["grpo"], out["nudge"]
    for k in ("completion_ids", "completion_mask", "rewards", "adv"):
        assert torch.equal(bg[k], bn[k]), k
    assert bn["completion_ids"].shape[0] == bn["n_rollouts"]  # no distillation rows
    assert all(torch.equal(a, b) for a, b in zip(pg, pn))


# ---- learning ----
class FixedTask:
    """A fixed pool of 2-digit additions (the learning test trains and measures on the same prompts)."""
    kind, name = "add", "fixed"

    def __init__(self, examples):
        self.examples, self.base = examples, llm.ArithmeticTask("add", 2)

    def sample(self, split, n, rng):
        return [self.examples[i] for i in rng.integers(0, len(self.examples), n)]

    def parse(self, response):
        return self.base.parse(response)

    def verify(self, response, answer):
        return self.base.verify(response, answer)


def greedy_acc(model, tok, task, examples):
    texts = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]), 1, 8,
                            greedy=True).texts
    return float(np.mean([task.verify(t, e.answer)[0] for t, e in zip(texts, examples)]))


def train_on_hard_prompts(change: dict, seed: int, steps: int = 8) -> float:
    """rollout -> update for `steps` batches of 8 prompts x 4 rollouts (lr 5e-4) on the 8 training prompts the tiny
    policy answers wrong greedily; returns its greedy accuracy on them afterwards (0 at the start)."""
    torch.manual_seed(seed)
    model, tok = common.load_model("tiny-0.6m")
    model.train()
    base = llm.ArithmeticTask("add", 2)
    pool = base.sample("train", 60, np.random.default_rng(123))
    texts = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in pool]), 1, 8, greedy=True).texts
    hard = [e for e, t in zip(pool, texts) if base.verify(t, e.answer)[0] == 0][:8]
    task = FixedTask(hard)
    args = replace(SMALL, prompts_per_step=8, group_size=4, lr=5e-4, seed=seed, **change)
    sampler, rng = common.Sampler(model), np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    accel = type("A", (), {"num_processes": 1, "device": torch.device("cpu")})()
    for step in range(1, steps + 1):
        batch = nudge_rl.rollout(sampler, tok, task, args, rng, torch.device("cpu"))
        nudge_rl.update(model, opt, batch, nudge_rl.nudge_loss, args, step, accel, sampler)
    return greedy_acc(model, tok, task, hard)


def test_nudging_learns_the_bare_prompts_grpo_cannot():
    """8 prompts the tiny policy gets wrong greedily (its bare-prompt success there is low, so GRPO's groups are
    mostly all-fail), while the `units` hint solves ~97%: NudgeRL's distillation teaches the bare prompts.
    Measured (seeds 0, 1, 2; 10 steps of 8 prompts x 4, 16 such prompts): NudgeRL 25 / 44 / 44%, GRPO 6 / 0 / 6%
    greedy accuracy on them afterwards. The margin, 15 points on the mean of two seeds, is under half that gap."""
    nudge = [train_on_hard_prompts({}, s) for s in (0, 1)]
    plain = [train_on_hard_prompts({"hints": ("none",), "distill_coef": 0.0}, s) for s in (0, 1)]
    assert np.mean(nudge) - np.mean(plain) > 0.15, (nudge, plain)


# ---- bad flags ----
@pytest.mark.parametrize("change, msg", [
    ({"hints": ("none", "nope")}, "--hints"),
    ({"hints": ("none", "none")}, "--hints"),
    ({"hints": ("none", "units", "steps")}, "--group-size"),
    ({"hints": ("none", "units"), "group_size": 2}, "--group-size"),
    ({"hints": ("none", "tens")}, "digits - 1"),
    ({"task": "sums"}, "--task add"),
    ({"hints": ("none",), "p2o": True, "task": "addsteps"}, "--task add"),
    ({"lens": True, "hints": ("none",)}, "--noise"),
    ({"noise": 2}, "--noise"),
    ({"noise": -1, "hints": ("none",)}, "--noise"),
    ({"distill_coef": -1.0}, "--distill-coef"),
    ({"p2o_tries": 0}, "--p2o-tries"),
    ({"kernels": True}, "--kernels"),
    ({"engine": "vllm"}, "--engine vllm"),
])
def test_bad_flags_are_refused(change, msg):
    with pytest.raises(SystemExit, match=msg):
        nudge_rl.check_args(replace(SMALL, **change))
