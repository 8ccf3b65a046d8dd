"""algos/multiturn_grpo.py: observation tokens out of the policy loss, the single-turn reduction to grpo.py, learning."""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo, multiturn_grpo as mt

ACCEL = SimpleNamespace(num_processes=1)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return common.load_model("tiny-0.6m")


def small_args(**kw):
    return mt.Args(prompts_per_step=3, group_size=4, threads=1, device="cpu", **kw)


def test_policy_loss_has_zero_gradient_on_observation_tokens(tiny):
    """Through update(): d(loss)/d(log pi) is zero at every observation token and nonzero on action tokens."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    args = small_args()
    env = mt.make_env(args)
    torch.manual_seed(1)
    batch = mt.rollout(model, tok, env, args, np.random.default_rng(0), torch.device("cpu"))
    batch["adv"] = torch.randn_like(batch["adv"])  # the base model earns no reward: give every episode a signal
    assert batch["obs_mask"].sum() > 0 and batch["action_mask"].sum() > 0
    grads = []

    def loss_fn(logp, mb, n_seqs, n_tokens, a):
        loss, st = mt.grpo_loss(logp, mb, n_seqs, n_tokens, a)
        grads.append((torch.autograd.grad(loss, logp, retain_graph=True)[0], mb["obs_mask"], mb["mask"]))
        return loss, st

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stats = mt.update(model, opt, batch, loss_fn, args, 1, ACCEL, common.Sampler(model))
    for g, obs, act in grads:
        assert torch.all(g[obs.bool()] == 0)
        assert (g[act.bool()] != 0).float().mean() > 0.9
    assert stats["loss/env_ce"] > 0
    # pack_episodes: the three masks partition the real tokens; env_token_ce is the mean observation-token NLL
    assert torch.equal(batch["action_mask"] + batch["obs_mask"], batch["completion_mask"])
    assert (batch["turn"][batch["completion_mask"].bool()] >= 0).all()
    assert (batch["logprobs"][batch["obs_mask"].bool()] == 0).all()
    with torch.no_grad():
        lp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], 1.0)
    want = -(lp * batch["obs_mask"]).sum() / batch["obs_mask"].sum()
    assert abs(mt.env_token_ce(model, batch, args) - want.item()) < 1e-5


def test_sampler_correction_weights_action_tokens_when_the_sampler_is_not_the_trainer(tiny):
    """grpo.py's truncated importance weight min(pi_old / pi_sampler, C) on action tokens, logged, only when the
    sampler is another computation than the trainer (a bf16 copy, vLLM): here the behaviour log-probs are lowered
    by 1 nat on every other action token, so those weights are e > C = 2 and truncated."""
    model, tok = tiny
    args = small_args()
    torch.manual_seed(1)
    batch = mt.rollout(model, tok, mt.make_env(args), args, np.random.default_rng(0), torch.device("cpu"))
    batch["adv"] = torch.randn_like(batch["adv"])
    act = batch["action_mask"].bool()
    shifted = act & (torch.arange(act.shape[1]) % 2 == 0)
    batch["logprobs"] = batch["logprobs"] - shifted.float()
    other = SimpleNamespace(is_trainer=False, refresh=lambda: None)
    params, out = [], []
    for sampler in (common.Sampler(model), other):
        m = copy.deepcopy(model)
        out.append(mt.update(m, torch.optim.AdamW(m.parameters(), lr=1e-3), batch, mt.grpo_loss, args, 1, ACCEL,
                             sampler))
        params.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert "rollout/is_weight_mean" not in out[0]
    frac = shifted.sum().item() / act.sum().item()
    assert out[1]["rollout/is_truncated_frac"] == pytest.approx(frac, abs=1e-6)
    assert out[1]["rollout/is_weight_mean"] == pytest.approx(2 * frac + (1 - frac), rel=1e-4)
    assert not torch.allclose(params[0], params[1])  # the weights change the update


def test_one_turn_without_tool_calls_equals_grpo_step(tiny):
    """A batch of single-turn completions (no observation tokens) gives the same update as grpo.py's."""
    model, tok = tiny
    gargs = grpo.Args(prompts_per_step=4, group_size=4, threads=1, max_new_tokens=4, device="cpu")
    torch.manual_seed(2)
    batch = grpo.rollout(model, tok, llm.make_task("add", 2), gargs, np.random.default_rng(0), torch.device("cpu"))
    batch["adv"] = torch.randn_like(batch["adv"])
    mbatch = {**batch, "action_mask": batch["completion_mask"], "obs_mask": torch.zeros_like(batch["completion_mask"])}
    margs = mt.Args(prompts_per_step=4, group_size=4, threads=1, max_new_tokens=4, device="cpu", micro_batch_size=5,
                    lr=gargs.lr, temperature=gargs.temperature)  # the two scripts' defaults differ in these
    gargs.micro_batch_size = 5
    params = []
    for upd, b, a in ((grpo.update, batch, gargs), (mt.update, mbatch, margs)):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        upd(m, opt, b, grpo.grpo_loss if upd is grpo.update else mt.grpo_loss, a, 1, ACCEL, common.Sampler(m))
        params.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    base = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (params[0] - base).abs().max() > 1e-5  # the step moved the weights
    assert torch.allclose(params[0], params[1], atol=1e-7)


def test_sampler_and_trainer_agree_on_every_action_token_after_a_multi_turn_rollout():
    """The behaviour log-probs recorded turn by turn (each turn sampled from the context of every earlier action and
    observation, KV-cached, left-padded per turn) equal the trainer's log-probs of the packed episodes (one padded
    forward) at the sampling temperature, on every action token of every turn, within 1e-4 (fp32 with the same
    weights: the two computations differ only in reduction order, about 1e-6 per token); the update logs the same gap.
    A sampler that never sees the observations, or a turn's log-probs stored out of order, fails here."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-toolenv")
    args = mt.Args(prompts_per_step=4, group_size=4, threads=1, device="cpu")
    batch = mt.rollout(model, tok, mt.make_env(args), args, np.random.default_rng(0), torch.device("cpu"))
    assert max(len(e.actions) for e in batch["episodes"]) >= 4  # lookups, their answers, then the answer turn
    act = batch["action_mask"].bool()
    assert (act & (batch["turn"] >= 2)).sum() >= 20
    with torch.no_grad():
        lp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], args.temperature)
    assert (lp - batch["logprobs"])[act].abs().max() < 1e-4
    m = copy.deepcopy(model)
    stats = mt.update(m, torch.optim.AdamW(m.parameters(), lr=1e-4), batch, mt.grpo_loss, args, 1, ACCEL,
                      common.Sampler(m))
    assert stats["rollout/logprob_mismatch"] < 1e-4


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit, match="group-size"):
        mt.check_args(mt.Args(group_size=1))
    with pytest.raises(SystemExit, match="max-turns"):
        mt.check_args(mt.Args(max_turns=0))
    with pytest.raises(SystemExit, match="eval-split"):
        mt.check_args(mt.Args(eval_split="val"))
    with pytest.raises(SystemExit, match="--env-ce-examples"):
        mt.check_args(mt.Args(env_ce_examples=0))


@pytest.mark.parametrize("kw, flag", [(dict(task="sums"), "--task"), (dict(digits=3), "--digits"),
                                      (dict(top_p=0.9), "--top-p"), (dict(pass_k=8), "--pass-k"),
                                      (dict(eval_hard=True), "--eval-hard")])
def test_prompt_task_flags_are_refused(kw, flag):
    """Inherited plumbing flags that the multi-turn scripts cannot honour are refused, naming the flag."""
    with pytest.raises(SystemExit, match=flag):
        mt.check_args(mt.Args(**kw))
    mt.check_args(mt.Args())


@pytest.mark.slow
def test_learns_on_the_default_setting(tmp_path):
    """The default run from the shipped tiny-toolenv raises held-out episode success (shortened here)."""
    s = mt.main(mt.Args(threads=1, out_dir=str(tmp_path), steps=20, eval_every=20, eval_examples=200,
                        env_ce_examples=16))
    assert s["eval_acc_end"] - s["eval_acc_start"] >= 0.02, s
