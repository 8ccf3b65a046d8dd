"""algos/step_grpo.py: the step splitter on hand-written responses, the step-aware relative reward against a naive
per-group loop and in its degenerate cases (equal step counts, weight 0, no correct response), the credit it moves
inside a group, the rollout that applies it, the check task's references and verifier, the tie to grpo.py at
--step-reward 0, and bad input."""
import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import grpo
from algos import step_grpo as sg

SEPS, MARKERS = (";", "\n\n"), ("check", "wait", "alternatively", "verify")


# ---- semantic steps ----
@pytest.mark.parametrize("text,steps", [
    ("2+7=9;9+9=18;=18", ["2+7=9", "9+9=18", "=18"]),
    ("2+7=9;check 2+7=9;9+9=18;check 9+9=18;=18", ["2+7=9", "check 2+7=9", "9+9=18", "check 9+9=18", "=18"]),
    ("2+7=9;", ["2+7=9"]),  # a trailing separator opens no step
    ("", []),
    ("So x = 4. Wait, let me verify: 2 * 4 = 8. Alternatively we could solve it again.",
     ["So x = 4.", "Wait, let me", "verify: 2 * 4 = 8.", "Alternatively we could solve it again."]),
    ("First part.\n\nSecond part; third part", ["First part.", "Second part", "third part"]),
    ("We recheck nothing while checking", ["We recheck nothing while checking"]),  # markers are whole words
    ("CHECK 1+1=2;check 1+1=2", ["CHECK 1+1=2", "check 1+1=2"]),  # case-insensitive
])
def test_split_steps_on_hand_written_texts(text, steps):
    assert sg.split_steps(text, SEPS, MARKERS) == steps


def test_split_steps_without_markers_or_separators():
    """No markers: only the separators cut; no separators: only the markers; a marker at the start is one step."""
    assert sg.split_steps("a wait b;c", (";",), ()) == ["a wait b", "c"]
    assert sg.split_steps("a wait b;c", (), ("wait",)) == ["a", "wait b;c"]
    assert sg.split_steps("wait", (), ("wait",)) == ["wait"]


# ---- the step-aware relative reward ----
def naive_step_reward(r, c, s, G, w):
    """R_i = r_i - w c_i min((S_i - b_g) / b_g, 1), b_g the mean S of the group's correct responses, as a loop."""
    out = []
    for g in range(0, len(r), G):
        correct = [s[i] for i in range(g, g + G) if c[i]]
        b = sum(correct) / len(correct) if correct else 0.0
        for i in range(g, g + G):
            out.append(r[i] - w * min((s[i] - b) / b, 1.0) if c[i] and b > 0 else r[i])
    return out


@pytest.mark.parametrize("G,w", [(8, 0.5), (4, 1.0), (5, 0.2), (2, 0.7)])
def test_step_aware_reward_against_naive_loop(G, w):
    """Random groups (some with no correct response, some with a response more than twice the baseline, so that
    the cap binds), rewards = correctness + a format-like term: the same values as the loop, fp32 rounding only."""
    rng = random.Random(G * 100 + int(w * 10))
    B = 40 * G
    c = [float(rng.random() < 0.5) for _ in range(B)]
    s = [float(rng.randint(1, 12)) for _ in range(B)]
    c[:G] = [0.0] * G  # a group with no correct response
    c[G:2 * G], s[G:2 * G] = [1.0] * G, [1.0] * (G - 1) + [3.0 * G]  # one whose last response passes the cap
    r = [ci + 0.1 * rng.random() for ci in c]
    got, base = sg.step_aware_reward(torch.tensor(r), torch.tensor(c), torch.tensor(s), G, w)
    assert got.tolist() == pytest.approx(naive_step_reward(r, c, s, G, w), abs=1e-5)
    assert base.shape == (B // G,)
    if G >= 3:  # with two correct responses the excess stays below 1; with more, 3G steps pass the cap
        assert got[2 * G - 1] == pytest.approx(r[2 * G - 1] - w, abs=1e-5)


def test_degenerate_cases_equal_the_plain_reward():
    """Every response with the same step count, weight 0, or no correct response in a group: R = r exactly."""
    torch.manual_seed(0)
    r, c = torch.rand(64), (torch.rand(64) < 0.5).float()
    same = torch.full((64,), 5.0)
    assert torch.equal(sg.step_aware_reward(r, c, same, 8, 0.9)[0], r)
    assert torch.equal(sg.step_aware_reward(r, c, torch.randint(1, 9, (64,)).float(), 8, 0.0)[0], r)
    assert torch.equal(sg.step_aware_reward(r, torch.zeros(64), torch.randint(1, 9, (64,)).float(), 8, 0.9)[0], r)


def test_step_reward_moves_credit_from_the_over_checkers_to_the_concise():
    """The mechanism: one group, all correct, steps 4, 4, 6, 6: the shaping sums to zero over the correct responses,
    the concise pair gets a positive advantage and the over-checkers a negative one; in a second group the wrong
    response keeps its reward (0), and a correct one 2.5x the baseline (capped) falls to 0 at w = 1, not below it."""
    r, c = torch.tensor([1.0, 1, 1, 1]), torch.ones(4)
    R, base = sg.step_aware_reward(r, c, torch.tensor([4.0, 4, 6, 6]), 4, 0.5)
    assert base.item() == 5.0 and float((R - r).sum()) == pytest.approx(0.0, abs=1e-6)
    adv = grpo.group_advantages(R, 4)
    assert (adv[:2] > 0).all() and (adv[2:] < 0).all()
    assert torch.equal(grpo.group_advantages(r, 4), torch.zeros(4))  # plain GRPO: no signal at all
    R2, _ = sg.step_aware_reward(torch.tensor([1.0, 1, 1, 0]), torch.tensor([1.0, 1, 1, 0]),
                                 torch.tensor([1.0, 1, 10, 3]), 4, 1.0)
    assert R2.tolist() == pytest.approx([1.75, 1.75, 0.0, 0.0]) and R2[2] >= R2[3]


# ---- the rollout that applies it ----
class FakeTask:
    """A task whose verifier accepts any response ending in '=<answer>'."""
    name = "fake"

    def __init__(self, n):
        self.n = n

    def sample(self, split, n, rng):
        return [sg.llm.Example(f"{i}+0:", str(i), "") for i in range(n)]

    def verify(self, response, answer):
        ok = response.rsplit("=", 1)[-1] == answer
        return float(ok), {"correct": float(ok)}


def test_rollout_shapes_the_rewards_it_trains_on(monkeypatch):
    """common.generate stubbed with fixed responses (2 prompts x 4): with --step-reward 0.5 the batch's rewards and
    advantages are step_aware_reward's of the verifier's rewards and split_steps' counts; at 0, the plain ones."""
    tok = lambda text: {"input_ids": [1] * len(text)}  # noqa: E731 (encode_prompts' only use of the tokenizer)
    texts = ["0+0=0;=0", "0+0=0;check 0+0=0;=0", "0+0=0;check 0+0=0;check 0+0=0;=0", "0+0=1;=1",
             "1+0=1;=1", "1+0=1;=1", "1+0=1;wait 1+0=1;=1", "1+0=2;=2"]

    def fake_generate(sampler, tok_, prompts, G, *a, **k):
        ids = torch.ones(len(texts), 3, dtype=torch.long)
        return common.Rollout(ids[:, :2], ids[:, :2], ids, ids, torch.zeros(len(texts), 3), ["stop"] * 8, texts)

    monkeypatch.setattr(sg.common, "generate", fake_generate)
    args = sg.Args(group_size=4, prompts_per_step=2, threads=1)
    batch = sg.rollout(None, tok, FakeTask(2), args, np.random.default_rng(0), "cpu")
    plain = torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 0])
    steps = torch.tensor([2.0, 3, 4, 2, 2, 2, 3, 2])
    assert batch["steps"].tolist() == steps.tolist() and batch["correct"].tolist() == plain.tolist()
    want, _ = sg.step_aware_reward(plain, plain, steps, 4, 0.5)
    assert torch.allclose(batch["rewards"], want) and torch.allclose(batch["adv"], grpo.group_advantages(want, 4))
    off = sg.rollout(None, tok, FakeTask(2), replace(args, step_reward=0.0), np.random.default_rng(0), "cpu")
    assert torch.equal(off["rewards"], plain) and "reward/step_shaping" not in off["reward_terms"]


# ---- the check task ----
def test_check_task_references_verify_and_hold_checks_at_the_set_rate():
    """Every reference is correct under the verifier; a check follows a step with probability check_prob (2,000
    references of 3 steps, seed 0: 0.5 +- 0.02, three standard errors of 0.0065); check_prob 0 gives
    sums4's references exactly, and any check_prob the same prompts."""
    task = sg.make_check_task("checksums4", 1, 0.5)
    exs = task.sample("train", 2000, np.random.default_rng(0))
    assert all(task.verify(e.solution, e.answer)[0] == 1.0 for e in exs)
    rate = np.mean([task.verify(e.solution, e.answer)[1]["checks"] for e in exs]) / 3
    assert abs(rate - 0.5) < 0.02, rate
    plain = sg.make_check_task("checksums4", 1, 0.0).sample("test", 50, np.random.default_rng(1))
    checked = task.sample("test", 50, np.random.default_rng(1))
    sums = sg.llm.SumsTask(4, 1).sample("test", 50, np.random.default_rng(1))
    assert [(e.prompt, e.solution) for e in plain] == [(e.prompt, e.solution) for e in sums]
    assert [e.prompt for e in checked] == [e.prompt for e in sums]  # the same held-out prompts as sums4
    assert sg.make_check_task("sums4", 1, 0.5) is None


@pytest.mark.parametrize("response,reward,fmt", [
    ("2+7=9;9+9=18;=18", 1.0, 1.0),
    ("2+7=9;check 2+7=9;9+9=18;check 9+9=18;=18", 1.0, 1.0),
    ("2+7=9;check 2+7=10;9+9=18;=18", 1.0, 1.0),  # a wrong check is still only a check: never graded
    ("check 2+7=9;=9", 0.0, 0.0),  # no running total at all
    ("2+7=9;9+9=18;=17", 0.0, 1.0),
    ("2+7=9;check 2+7=9;9+9=18;check", 0.0, 0.0),  # cut off mid-check
])
def test_check_task_verifier(response, reward, fmt):
    task = sg.make_check_task("checksums3", 1, 0.5)
    got, comp = task.verify(response, "18")
    assert (got, comp["format"]) == (reward, fmt)


# ---- the tie to grpo.py, bad input ----
def rows(path):
    return {r["step"]: r for r in map(json.loads, open(path))}


def test_step_reward_zero_equals_grpo(tmp_path):
    """--step-reward 0 --warm-start-steps 0 on sums: grpo.py's run, metric for metric."""
    cfg = dict(steps=2, eval_every=2, eval_examples=40, prompts_per_step=4, group_size=4, pass_k=0, eval_hard=False,
               threads=1, model="tiny-sums", task="sums3", digits=1, max_new_tokens=24, lr=1e-4, out_dir=str(tmp_path))
    s = sg.main(sg.Args(step_reward=0.0, warm_start_steps=0, exp_name="s", **cfg))
    g = grpo.main(grpo.Args(exp_name="g", **cfg))
    for k in ("eval_acc_end", "train_reward_last", "gen_tokens", "zero_var_group_frac"):
        assert s[k] == g[k], k
    a, b = rows(tmp_path / "s" / "metrics.jsonl"), rows(tmp_path / "g" / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rollout/reward", "rollout/length", "loss/pg", "loss/grad_norm", "loss/entropy"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[2]["eval/acc"] == b[2]["eval/acc"] and "eval/length" in a[2]


def test_default_learns_to_stop_checking_from_the_shipped_warm_start(tmp_path):
    """The script's target on its default task: from tiny-checksums (the default's warm start, shipped), four rollout
    batches cut held-out tokens per response from about 42 to about 25 and semantic steps from 5.3 towards 4 (the
    checks dropped), accuracy kept within 3.5 binomial standard errors (100 problems). Measured at seeds 0-2:
    41.9 -> 24.5-24.9 tokens, 5.29 -> 4.00-4.03 steps, accuracy 78 -> 69-75%."""
    s = sg.main(sg.Args(model="tiny-checksums", warm_start_steps=0, steps=4, eval_every=4, eval_examples=100,
                        threads=1, out_dir=str(tmp_path), exp_name="learn"))
    assert s["eval_length_start"] > 38 and s["eval_steps_start"] > 5.0  # the shipped policy over-checks
    assert s["eval_length_end"] < s["eval_length_start"] - 10
    assert s["eval_steps_end"] < s["eval_steps_start"] - 0.8
    assert s["eval_acc_end"] >= s["eval_acc_start"] - 0.15


def test_save_warm_start_needs_a_warm_start():
    with pytest.raises(SystemExit, match="--save-warm-start needs --warm-start-steps"):
        sg.check_args(sg.Args(save_warm_start="x", warm_start_steps=0))


@pytest.mark.parametrize("flags,message", [
    (dict(step_reward=1.5), "--step-reward"),
    (dict(step_reward=-0.1), "--step-reward"),
    (dict(step_seps=(), step_markers=()), "cannot both be empty"),
    (dict(check_prob=2.0), "--check-prob"),
    (dict(warm_start_steps=-1), "--warm-start-steps"),
])
def test_bad_arguments_name_the_flag(flags, message):
    with pytest.raises(SystemExit, match=message):
        sg.check_args(sg.Args(**flags))
