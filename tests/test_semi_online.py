"""algos/semi_online.py: the patch step, discounted step returns and step/episode advantages against naive loops, the
semi-online score on hand-made patched rollouts, the online mode against multi-turn GRPO, learning, bad flags."""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from algos import _toolenv
from algos import multiturn_grpo as mt
from algos import semi_online as so

ACCEL = SimpleNamespace(num_processes=1)


@pytest.fixture(scope="module")
def toolenv():
    torch.manual_seed(0)
    return common.load_model("tiny-toolenv")


def scripted_generate(tok, script: list[str]):
    """A stand-in for common.generate that answers turn k of every live context with script[k] (ids + EOS)."""
    calls = []

    def generate(policy, tok_, prompts, group_size=1, max_new_tokens=6, temperature=1.0, top_p=1.0, greedy=False):
        text = script[len(calls)]
        calls.append([list(p) for p in prompts])
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(prompts)
        return common.Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                              torch.tensor([ids] * n), torch.ones(n, len(ids), dtype=torch.long),
                              torch.full((n, len(ids)), -0.5), ["stop"] * n, [text] * n)
    return generate, calls


def test_patch_step_puts_the_expert_action_in_the_context_and_trains_the_models(toolenv, monkeypatch):
    _, tok = toolenv
    env = _toolenv.LookupEnv()
    seed = env.seeds("train", 1, np.random.default_rng(3))[0]
    env.reset(seed)
    q, store = env.query, env.store
    wrong_key = next(k for k in "abcdefgh" if k not in store)
    # turn 0 right, turn 1 a key that is not in the store (diverges), turn 2 right, turn 3 a wrong sum (diverges)
    script = [f"#{q[0]}", f"#{wrong_key}", f"#{q[2]}", f"!{env.answer + 1}"]
    gen, calls = scripted_generate(tok, script)
    monkeypatch.setattr(common, "generate", gen)
    prompt = common.encode_prompts(tok, [env.transcript])[0]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tok.eos_token_id]
    (ep,) = so.patched_play(None, tok, [env.clone()], [prompt], 6)
    assert ep.actions == script and ep.step_rewards == [1.0, 0.0, 1.0, 0.0] and ep.patched == [False, True, False, True]
    assert [a for a in ep.ids] == [enc(a) + eos for a in script]  # the model's own actions are the trained ones
    # the context of turn 2: the model's turn 0, then the expert's `#q1` (not the model's `#wrong_key`)
    want = prompt + enc(f"#{q[0]}") + eos + enc(f"={store[q[0]]};") + enc(f"#{q[1]}") + eos + enc(f"={store[q[1]]};")
    assert ep.ctx[2] == want and calls[2] == [want]
    assert ep.env.done and ep.env.reward == 1.0  # the patched answer finished the episode
    assert ep.env.transcript.endswith(f"#{q[1]}={store[q[1]]};#{q[2]}={store[q[2]]};!{env.answer}")
    # a patch budget of 0 ends the episode at its first divergence, without stepping the environment
    gen, _ = scripted_generate(tok, script)
    monkeypatch.setattr(common, "generate", gen)
    (ep0,) = so.patched_play(None, tok, [env.clone()], [prompt], 6, patch_budget=0)
    assert ep0.stopped and ep0.patched == [False, True] and not ep0.env.done
    # one training row per step: the completion is exactly the model's action, observations only in the prompt
    batch = so.pack_steps(ep.ctx, ep.ids, ep.logprobs, ep.step_rewards, tok, torch.device("cpu"))
    for r in range(4):
        n = int(batch["action_mask"][r].sum())
        assert batch["completion_ids"][r, :n].tolist() == ep.ids[r]
        assert batch["prompt_ids"][r][batch["prompt_mask"][r].bool()].tolist() == ep.ctx[r]
    assert batch["obs_mask"].sum() == 0 and torch.equal(batch["action_mask"], batch["completion_mask"])
    assert batch["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_accepts_any_order_of_lookups_and_the_scratchpad_answer():
    env = _toolenv.LookupEnv()
    env.reset(env.seeds("train", 1, np.random.default_rng(5))[0])
    q = env.query
    assert so.accepts(env, f"#{q[1]}") and so.accepts(env, f" #{q[0]}")
    env.step(f"#{q[1]}")
    assert not so.accepts(env, f"#{q[1]}")  # a repeated lookup diverges
    assert so.accepts(env, f"!{env.answer}") and so.accepts(env, f"!1+2={env.answer}")
    assert not so.accepts(env, f"!{env.answer + 1}") and not so.accepts(env, "hello")


def naive_advantages(step_rewards, G, gamma, omega, std_norm):
    out = []
    R = [sum(r) for r in step_rewards]
    ret = []
    for r in step_rewards:
        ret.append([sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))])
    for i, r in enumerate(step_rewards):
        g = range(i // G * G, i // G * G + G)
        Rg = np.array([R[j] for j in g])
        a_ep = (R[i] - Rg.mean()) / ((Rg.std(ddof=1) if std_norm else 1.0) + (1e-6 if std_norm else 0.0))
        row = []
        for t in range(len(r)):
            Gt = np.array([ret[j][t] for j in g if len(ret[j]) > t])
            a_st = 0.0
            if len(Gt) >= 2:
                a_st = (ret[i][t] - Gt.mean()) / ((Gt.std(ddof=1) + 1e-6) if std_norm else 1.0)
            row.append(a_ep + omega * a_st)
        out.append(row)
    return out


@pytest.mark.parametrize("std_norm", [True, False])
def test_discounted_returns_and_step_episode_advantages_against_a_naive_loop(std_norm):
    rng = np.random.default_rng(0)
    rewards = [[float(x) for x in rng.integers(0, 2, size=int(rng.integers(1, 5)))] for _ in range(9)]
    got = so.semi_online_advantages(rewards, 3, 0.7, 0.5, std_norm)
    want = naive_advantages(rewards, 3, 0.7, 0.5, std_norm)
    assert [len(r) for r in got] == [len(r) for r in rewards]
    assert np.allclose(np.concatenate(got), np.concatenate(want), atol=1e-5)
    assert so.discounted_returns([1.0, 0.0, 1.0], 0.5) == [1.25, 0.5, 1.0]
    # omega = 0: the episode-level advantage (multi-turn GRPO's on the summed step rewards) on every step
    ep = so.semi_online_advantages(rewards, 3, 0.7, 0.0, std_norm)
    flat = mt.group_advantages(torch.tensor([sum(r) for r in rewards]), 3, std_norm)
    assert all(np.allclose(row, flat[i].item()) for i, row in enumerate(ep))


def test_sop_on_hand_made_patched_rollouts():
    def ep(patched, reward):
        return so.PatchedEpisode(env=SimpleNamespace(reward=reward), patched=patched)
    eps = [ep([False] * 4, 1.0),  # solved on its own: counts for SOP, progress 1
           ep([False, True, False, False], 1.0),  # patched once (the expert finished it): not an own success, 1/4
           ep([True, False, False, False], 1.0),  # diverged at once: 0
           ep([False, False, False, False], 0.0),  # own steps all accepted but the episode hit a limit: 1, no success
           ep([False, False, True], 0.0)]  # stopped by the patch budget at turn 2: 2/4
    m = so.sop_metrics(eps, 4)
    assert m["sop"] == pytest.approx(1 / 5)
    assert m["sop_progress"] == pytest.approx((1 + 0.25 + 0 + 1 + 0.5) / 5)


def test_online_mode_equals_multiturn_grpo(toolenv):
    """--mode online is multi-turn GRPO: the same rollout batch and the same optimiser step."""
    model, tok = toolenv
    params = []
    for mod in (mt, so):
        args = mod.Args(prompts_per_step=2, group_size=4, threads=1, device="cpu")
        m = copy.deepcopy(model)
        torch.manual_seed(7)
        batch = mod.rollout(m, tok, mod.make_env(args), args, np.random.default_rng(1), torch.device("cpu"))
        batch["adv"] = torch.randn(len(batch["adv"]), generator=torch.Generator().manual_seed(0))
        mod.update(m, torch.optim.AdamW(m.parameters(), lr=1e-3), batch, mod.grpo_loss, args, 1, ACCEL,
                   common.Sampler(m))
        params.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    base = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (params[0] - base).abs().max() > 1e-5
    assert torch.equal(params[0], params[1])


def test_offline_bc_rows_are_the_expert_steps(toolenv):
    model, tok = toolenv
    args = so.Args(prompts_per_step=1, group_size=2, threads=1, device="cpu", mode="offline-bc")
    batch = so.expert_rollout(common.Sampler(model), tok, so.make_env(args), args, np.random.default_rng(0),
                              torch.device("cpu"))
    assert len(batch["adv"]) == 2 * (args.n_query + 1) and torch.equal(batch["adv"], torch.ones(8))
    texts = tok.batch_decode(batch["completion_ids"] * batch["completion_mask"], skip_special_tokens=True)
    assert [t.startswith("#") for t in texts] == [True, True, True, False] * 2 and texts[3].startswith("!")


@pytest.mark.parametrize("kw, flag", [(dict(patch_budget=-2), "--patch-budget"), (dict(gamma=1.5), "--gamma"),
                                      (dict(step_adv_weight=-1.0), "--step-adv-weight"),
                                      (dict(ppo_epochs=2), "--ppo-epochs"), (dict(group_size=1), "--group-size"),
                                      (dict(mode="offline-bc", kl_coef=0.1), "--kl-coef"), (dict(top_p=0.9), "--top-p")])
def test_bad_flags_are_refused(kw, flag):
    with pytest.raises(SystemExit, match=flag):
        so.check_args(so.Args(**kw))
    so.check_args(so.Args())
    so.check_args(so.Args(mode="online", ppo_epochs=2, minibatches=2))


def test_sop_evaluate_scores_the_expert_one_and_a_wrong_first_step_zero(toolenv, monkeypatch):
    model, tok = toolenv
    args = so.Args(threads=1, device="cpu")
    env = so.make_env(args)
    seed = env.seeds("test", 1, np.random.default_rng(2))[0]
    e = env.clone()
    e.reset(seed)
    expert = []
    while not e.done:
        expert.append(e.expert_action())
        e.step(expert[-1])
    wrong = next(k for k in "abcdefgh" if k not in e.store)
    for script, want in ((expert, 1.0), ([f"#{wrong}"] + expert[1:], 0.0)):
        monkeypatch.setattr(common, "generate", scripted_generate(tok, script)[0])
        res = so.sop_evaluate(SimpleNamespace(model=model), tok, env, [seed], args)
        assert res == {"eval/sop": want, "eval/sop_progress": want}


@pytest.mark.slow
@pytest.mark.numerics
def test_default_setting_learns_the_expert_steps_without_collapse(tmp_path):
    """The default from tiny-toolenv, shortened to 30 rollout batches (about 3 minutes on one thread). Measured (seeds
    0 and 1): SOP progress (the share of expert steps taken before the first divergence, greedy, 300 held-out
    episodes) 79.2% -> 87.5% and 87.7% (+8.3, +8.5 points), while online success stays near its start (53.3% -> 51.0%
    and 53.0%). The margin is half the smaller gain; success may not fall by more than 5 points."""
    s = so.main(so.Args(threads=1, out_dir=str(tmp_path), steps=30, eval_every=30, eval_examples=300,
                        env_ce_examples=16))
    assert s["eval_sop_progress_end"] - s["eval_sop_progress_start"] >= 0.04, s
    assert s["eval_acc_end"] - s["eval_acc_start"] >= -0.05, s
