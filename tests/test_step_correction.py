"""algos/step_correction.py: the step checker on hand-written steps, the corrections (prefix kept, the checker's step
under SCOPE, a retry under R^3L), the ragged group baseline, Pivotal Credit Assignment and Positive Amplification
against naive loops, the importance weight on the checker's tokens inside the update, the tie to grpo.py, learning,
and bad input."""
import json
import math
import random
import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo
from algos import step_correction as sc

SUMS, ADDSTEPS = llm.make_task("sums", 1), llm.make_task("addsteps", 2)


# ---- the step checker ----
@pytest.mark.parametrize("task,prompt,response,want", [
    (SUMS, "7+2+9:", "7+2=9;9+9=18;=18", None),  # right throughout
    (SUMS, "7+2+9:", "7+2=8;8+9=17;=17", (0, 0)),  # the first step is wrong
    (SUMS, "7+2+9:", "7+2=9;9+9=19;=19", (1, 6)),  # a wrong sum in step 2
    (SUMS, "7+2+9:", "7+2=9;2+9=11;=11", (1, 6)),  # the wrong operand picked (tiny-sums' usual error)
    (SUMS, "7+2+9:", "7+2=9;9+9=18;=19", (2, 13)),  # every step right, the final answer wrong
    (SUMS, "7+2+9:", "7+2=9;9+9=18;", (2, 13)),  # stops before the final answer: the missing step is wrong
    (SUMS, "7+2+9:", "7+2=9;9+9=18;18+1=19;=19", (2, 13)),  # an extra step
    (SUMS, "7+2+9:", "", (0, 0)),
    (ADDSTEPS, "47+85:", "7+5=12;4+8+1=13;=132", None),
    (ADDSTEPS, "47+85:", "7+5=12;4+8=12;=122", (1, 7)),  # the carry forgotten
    (ADDSTEPS, "47+85:", "7+5=12;4+8+1=13;=131", (2, 16)),
    (ADDSTEPS, "47+85:", "7+5=2;4+8=12;=122", (0, 0)),
])
def test_first_wrong_step_on_hand_written_steps(task, prompt, response, want):
    """reference_steps rebuilds the steps from the prompt; first_wrong_step returns (step index, its first character),
    so response[:c] is exactly the correct prefix."""
    steps = sc.reference_steps(task, prompt)
    assert "".join(steps) == (task.make(*map(int, prompt[:-1].split("+"))) if task is ADDSTEPS else
                              task.make([int(x) for x in prompt[:-1].split("+")])).solution
    got = sc.first_wrong_step(steps, response)
    assert got == want
    if got is not None:
        assert "".join(steps).startswith(response[:got[1]]) and sc.split_steps(response[:got[1]]) == steps[:got[0]]


def naive_first_wrong_sum_step(operands: list[int], response: str):
    """An independent checker for sums: walks the steps 'a+x=b;' checking a = the running total, x = the next operand,
    b = a + x, then '=total'; returns the index of the first bad step (None when all are right)."""
    parts = response.split(";")
    total = operands[0]
    for k, x in enumerate(operands[1:]):
        if k >= len(parts) - 1:
            return k
        try:
            lhs, b = parts[k].split("=")
            a, y = lhs.split("+")
            ok = int(a) == total and int(y) == x and int(b) == total + x and parts[k] == f"{a}+{y}={b}" and \
                a == str(int(a)) and y == str(int(y)) and b == str(int(b))
        except ValueError:
            ok = False
        if not ok:
            return k
        total += x
    k = len(operands) - 1
    return None if parts[k:] == [f"={total}"] else k


def test_first_wrong_step_agrees_with_an_arithmetic_checker():
    """On 2,000 randomly corrupted sums responses (a digit changed, an operand swapped, a step dropped or doubled, the
    answer changed), the reference comparison finds the same first wrong step as a checker that does the arithmetic."""
    rng = random.Random(0)
    for _ in range(2000):
        ops = [rng.randrange(10) for _ in range(rng.randrange(2, 7))]
        prompt = "+".join(map(str, ops)) + ":"
        steps = sc.reference_steps(SUMS, prompt)
        pieces = list(steps)
        kind, k = rng.randrange(5), rng.randrange(len(pieces))
        if kind == 0:  # change one digit somewhere
            text = "".join(pieces)
            pos = rng.choice([i for i, ch in enumerate(text) if ch.isdigit()])
            text = text[:pos] + str((int(text[pos]) + rng.randrange(1, 10)) % 10) + text[pos + 1:]
        elif kind == 1 and k < len(pieces) - 1:  # the wrong operand
            a, rest = pieces[k].split("+")
            x = rng.randrange(10)
            pieces[k] = f"{a}+{x}={int(a) + x};"
            text = "".join(pieces)
        elif kind == 2:  # a step dropped
            text = "".join(pieces[:k] + pieces[k + 1:])
        elif kind == 3:  # a step doubled
            text = "".join(pieces[:k + 1] + pieces[k:])
        else:
            text = "".join(pieces)
        got = sc.first_wrong_step(steps, text)
        assert (None if got is None else got[0]) == naive_first_wrong_sum_step(ops, text), (prompt, text)


def test_prefix_tokens_finds_the_token_boundary():
    """Character tokenizer: n characters are n tokens; a tokenizer with two-character tokens has no boundary inside
    a token (None), so such a prefix is not kept."""
    _, tok = common.load_model("tiny-sums")
    ids = tok("7+2=9;9+9=19;=19", add_special_tokens=False)["input_ids"]
    assert sc.prefix_tokens(tok, ids, 6) == 6 and sc.prefix_tokens(tok, ids, 0) == 0

    class Pairs:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(["ab", "cd", "ef"][i] for i in ids)

    assert sc.prefix_tokens(Pairs(), [0, 1, 2], 4) == 2 and sc.prefix_tokens(Pairs(), [0, 1, 2], 3) is None


# ---- the credit rules against naive loops ----
def test_ragged_group_advantages_against_loop():
    torch.manual_seed(0)
    groups = torch.tensor([0] * 8 + [1] * 8 + [2] * 8 + [0, 2, 2])
    rewards = torch.randint(0, 2, (len(groups),)).float()
    rewards[:8] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1])
    for std_norm in (True, False):
        got = sc.ragged_group_advantages(rewards, groups, std_norm)
        for i in range(len(groups)):
            r = [float(rewards[j]) for j in range(len(groups)) if groups[j] == groups[i]]
            want = float(rewards[i]) - statistics.mean(r)
            if std_norm:
                want /= statistics.stdev(r) + 1e-6
            assert float(got[i]) == pytest.approx(want, abs=1e-5)
    # equal groups in group-major order: grpo's group_advantages (up to float summation order)
    r = torch.rand(32)
    assert torch.allclose(sc.ragged_group_advantages(r, torch.arange(32) // 8), sc.group_advantages(r, 8), atol=1e-6)


def test_positive_amplification_against_loop():
    adv = torch.randn(50)
    got = sc.positive_amplification(adv, 2.5)
    for a, g in zip(adv.tolist(), got.tolist()):
        assert g == pytest.approx(2.5 * a if a > 0 else a)
    assert torch.equal(sc.positive_amplification(adv, 1.0), adv)


def test_pivotal_mask_against_loop():
    mask = (torch.rand(6, 10) > 0.2).long()
    shared = torch.tensor([0, 3, 10, 1, 5, 0])
    got = sc.pivotal_mask(mask, shared)
    for i in range(6):
        for t in range(10):
            assert int(got[i, t]) == (int(mask[i, t]) if t >= int(shared[i]) else 0)


def test_offpolicy_weight_against_naive():
    """Guided tokens: min(pi_old / mu, 1) with mu = 1 (behaviour log-prob 0), i.e. pi_old; the policy's own tokens keep
    the sampler's weight (or 1 when the sampler is the trainer)."""
    torch.manual_seed(0)
    old = -torch.rand(3, 7) * 3
    guided = torch.rand(3, 7) > 0.6
    behaviour = torch.where(guided, torch.zeros_like(old), old + 0.01 * torch.randn(3, 7))
    sampler_w = torch.rand(3, 7) + 0.5
    for base in (None, sampler_w):
        got = sc.offpolicy_weight(old, behaviour, guided, base)
        for i in range(3):
            for t in range(7):
                want = min(math.exp(float(old[i, t])), 1.0) if guided[i, t] else (1.0 if base is None else
                                                                                   float(base[i, t]))
                assert float(got[i, t]) == pytest.approx(want, rel=1e-6)


# ---- the corrections on a real batch ----
def small_args(**kw):
    return replace(SMALL, prompts_per_step=8, group_size=8, **kw)


def corrected_batch(mode: str, seed: int = 0):
    torch.manual_seed(seed)
    model, tok = common.load_model("tiny-sums")
    args = small_args(mode=mode)
    sampler = common.Sampler(model)
    batch = sc.rollout(sampler, tok, SUMS, args, np.random.default_rng(seed), "cpu")
    ok, picks = sc.choose_corrections(tok, SUMS, batch, args)
    fix = sc.regenerate(sampler, tok, SUMS, batch, picks, args)
    return model, tok, args, batch, ok, picks, fix


@pytest.mark.parametrize("mode", ["scope", "r3l"])
def test_corrections_keep_the_prefix_and_count_what_they_generate(mode):
    """choose_corrections picks failures with at least one right step, at most --corrections per group, the longest
    correct prefix first; regenerate keeps each pick's prefix token for token (its behaviour log-probs too), puts the
    checker's step after it under SCOPE (flagged guided, behaviour log-prob 0) and nothing under R^3L, and counts only
    guided + regenerated tokens as new."""
    model, tok, args, batch, ok, picks, fix = corrected_batch(mode)
    assert picks and len(fix["rows"]) == len(picks)
    G = args.group_size
    for g in range(args.prompts_per_step):
        rows = [i for i, _, _ in picks if i // G == g]
        assert len(rows) <= args.corrections
        steps = sc.reference_steps(SUMS, batch["examples"][g].prompt)
        prefix = {i: sc.first_wrong_step(steps, batch["texts"][i]) for i in range(g * G, (g + 1) * G) if not ok[i]}
        eligible = sorted((-c, i) for i, (k, c) in prefix.items() if k >= 1)
        assert sorted(rows) == sorted(i for _, i in eligible[:args.corrections])  # the longest prefixes
    new = 0
    for j, (i, n, guided) in enumerate(picks):
        assert not ok[i]
        k, c = sc.first_wrong_step(sc.reference_steps(SUMS, batch["examples"][i // G].prompt), batch["texts"][i])
        assert n == c  # one character per token
        assert torch.equal(fix["completion_ids"][j, :n], batch["completion_ids"][i, :n])
        assert torch.equal(fix["logprobs"][j, :n], batch["logprobs"][i, :n])
        length = int(fix["completion_mask"][j].sum())
        assert fix["completion_mask"][j, :length].all() and length <= args.max_new_tokens
        g_pos = fix["guided"][j].nonzero().flatten().tolist()
        if mode == "scope":
            step = sc.reference_steps(SUMS, batch["examples"][i // G].prompt)[k]
            assert g_pos == list(range(n, n + len(step)))
            assert tok.decode(fix["completion_ids"][j, n:n + len(step)]) == step
            assert fix["logprobs"][j, g_pos].abs().sum() == 0
            later = sc.first_wrong_step(sc.reference_steps(SUMS, batch["examples"][i // G].prompt), fix["texts"][j])
            assert later is None or later[0] > k  # the salvaged rollout is right at least up to step k
        else:
            assert g_pos == [] and guided == []
        new += length - n
    assert fix["new_tokens"] == new and fix["ok"] == [SUMS.verify(t, batch["examples"][i // G].answer)[0] == 1.0
                                                      for t, i in zip(fix["texts"], fix["rows"])]


@pytest.mark.parametrize("mode", ["scope", "r3l"])
def test_training_batch_masks_and_advantages_against_naive(mode):
    """Corrections join their prompt's group (the ragged baseline, recomputed by a loop); R^3L doubles positive
    advantages and masks the shared prefix of every retried failure and of its retry, and nothing else; SCOPE trains
    every token and amplifies nothing."""
    model, tok, args, batch, ok, picks, fix = corrected_batch(mode)
    train = sc.training_batch(batch, fix, args, tok.pad_token_id)
    B, M, G = len(ok), len(picks), args.group_size
    assert train["completion_ids"].shape[0] == B + M
    groups = [i // G for i in range(B)] + [i // G for i in fix["rows"]]
    rewards = train["rewards"].tolist()
    shared = {i: n for i, n, _ in picks}
    for row in range(B + M):
        r = [rewards[j] for j in range(B + M) if groups[j] == groups[row]]
        want = (rewards[row] - statistics.mean(r)) / (statistics.stdev(r) + 1e-6)
        if mode == "r3l" and want > 0:
            want *= 2.0
        assert float(train["adv"][row]) == pytest.approx(want, abs=1e-5)
        n = (shared.get(row, 0) if row < B else picks[row - B][1]) if mode == "r3l" else 0
        for t in range(train["completion_mask"].shape[1]):
            assert int(train["loss_mask"][row, t]) == (int(train["completion_mask"][row, t]) if t >= n else 0)
    if mode == "r3l":
        assert train["loss_mask"].sum() < train["completion_mask"].sum()


def test_update_weights_the_checkers_tokens_by_pi_old():
    """Inside the update (SCOPE), each guided token's loss carries w = pi_old(token) (the trainer is the sampler on CPU,
    so the policy's own tokens carry no weight), and --no-guide-is drops it: the mechanism, not only its outcome."""
    from accelerate import Accelerator

    model, tok, args, batch, ok, picks, fix = corrected_batch("scope")
    train = sc.training_batch(batch, fix, args, tok.pad_token_id)
    assert train["guided"].any()
    for guide_is in (True, False):
        seen = []

        def spy(logp, mb, n_seqs, n_tokens, a):
            seen.append((logp.detach(), mb["is_weight"], mb["mask"]))
            return sc.grpo_loss(logp, mb, n_seqs, n_tokens, a)

        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        stats = sc.update(model, opt, train, spy, replace(args, guide_is=guide_is), 1, Accelerator(cpu=True),
                          common.Sampler(model))
        logp = torch.cat([s[0] for s in seen])
        if guide_is:
            w = torch.cat([s[1] if s[1] is not None else torch.ones_like(s[0]) for s in seen])
            g = train["guided"]
            assert torch.allclose(w[g], logp[g].exp(), atol=1e-6) and torch.equal(w[~g], torch.ones_like(w[~g]))
            assert stats["loss/guided_weight"] == pytest.approx(float(logp[g & train["loss_mask"].bool()].exp().mean()),
                                                               rel=1e-5)
        else:
            assert all(s[1] is None for s in seen) and "loss/guided_weight" not in stats


# ---- the loop ----
SMALL = sc.Args(steps=30, prompts_per_step=16, group_size=8, eval_every=15, eval_examples=200, pass_k=0,
                eval_hard=False, out_dir="", exp_name="t", threads=1)


def rows(path):
    return {r["step"]: r for r in map(json.loads, open(path))}


def test_no_corrections_equals_grpo(tmp_path):
    """--corrections 0 (SCOPE): no correction, no amplification, the rollout batch as grpo.py trains it."""
    cfg = dict(steps=2, eval_every=2, eval_examples=40, prompts_per_step=8, out_dir=str(tmp_path), model="tiny-sums",
               task="sums", digits=1, max_new_tokens=48)
    s = sc.main(replace(SMALL, corrections=0, exp_name="s", **cfg))
    g = grpo.main(grpo.Args(group_size=8, pass_k=0, eval_hard=False, exp_name="g", threads=1, **cfg))
    for k in ("eval_acc_end", "train_reward_last", "gen_tokens"):
        assert s[k] == g[k], k
    a, b = rows(tmp_path / "s" / "metrics.jsonl"), rows(tmp_path / "g" / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rollout/reward", "loss/pg", "loss/clipfrac", "loss/grad_norm", "loss/entropy"):
            assert a[step][key] == b[step][key], (step, key)
    assert s["corrected"] == 0 and s["successes"] == round(sum(a[t]["rollout/reward"] * 64 for t in (1, 2)))


def test_updates_on_a_corrected_batch_learn_the_right_step_over_the_wrong_one():
    """A short learning check: two gradient steps (SGD, lr 0.1, clipped at norm 1) on one SCOPE batch raise the
    policy's log-probability of the checker's token where each failure first went wrong, and lower that of the token
    the failure wrote there. A flipped advantage sign fails it (the two move the other way)."""
    from accelerate import Accelerator

    model, tok, args, batch, ok, picks, fix = corrected_batch("scope")
    train = sc.training_batch(batch, fix, args, tok.pad_token_id)
    B = len(ok)
    right = torch.zeros_like(train["completion_mask"], dtype=torch.bool)  # the checker's token in each correction
    wrong = torch.zeros_like(right)  # at the same place in the failure: the token where it went wrong
    for j, (i, n, guided) in enumerate(picks):
        d = next(t for t in range(len(guided)) if int(train["completion_ids"][i, n + t]) != guided[t])
        right[B + j, n + d], wrong[i, n + d] = True, bool(train["completion_mask"][i, n + d])

    def mean_logps():
        with torch.no_grad():
            lp = common.token_logprobs(model, train["prompt_ids"], train["prompt_mask"], train["completion_ids"],
                                       train["completion_mask"])
        return float(lp[right].mean()), float(lp[wrong].mean())

    before = mean_logps()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # plain gradient steps: the update's direction, not Adam's
    for step in (1, 2):
        sc.update(model, opt, train, sc.grpo_loss, replace(args, lr=0.1), step, Accelerator(cpu=True),
                  common.Sampler(model))
    after = mean_logps()
    # measured (seed 0, one thread): right -0.766 -> -0.726, wrong -1.535 -> -2.182; margins half of that or less
    assert after[0] > before[0] + 0.02 and after[1] < before[1] - 0.2, (before, after)


@pytest.mark.slow
def test_scope_learns(tmp_path):
    s = sc.main(replace(SMALL, steps=30, prompts_per_step=32, eval_every=30, eval_examples=300, out_dir=str(tmp_path)))
    # stated margin: +6 points of held-out greedy accuracy on sums in 30 batches of 32 prompts, a third of the measured
    # gain (seed 0, one thread: 49.0 -> 67.0, the step-30 point of benchmarks/results/step_correction.csv's SCOPE
    # seed 0, which this run repeats; GRPO: 61.3); a flipped advantage sign loses accuracy instead
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.06, s
    assert s["corrected"] > 0 and 0 < s["salvaged"] <= s["corrected"] and s["tokens_per_success"] > 0


# ---- bad input ----
@pytest.mark.parametrize("change,msg", [
    ({"task": "add"}, "checkable steps"),
    ({"task": "words"}, "checkable steps"),
    ({"corrections": 9}, "corrections"),
    ({"corrections": -1}, "corrections"),
    ({"beta": 0.5}, "beta"),
    ({"mode": "scope", "pivotal": False}, "no-pivotal"),
    ({"mode": "r3l", "guide_is": False}, "no-guide-is"),
    ({"group_size": 1}, "group-size"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        sc.main(replace(SMALL, out_dir=str(tmp_path), **change))


def test_reference_steps_rejects_prompts_it_cannot_check():
    with pytest.raises(ValueError, match="step checker"):
        sc.reference_steps(llm.make_task("add", 2), "12+3=")
    with pytest.raises(ValueError, match="step checker"):
        sc.reference_steps(SUMS, "seven plus two:")
    with pytest.raises(ValueError, match="two numbers"):
        sc.reference_steps(ADDSTEPS, "1+2+3:")
