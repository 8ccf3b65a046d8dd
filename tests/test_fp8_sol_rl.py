"""algos/fp8_sol_rl.py: Sol-RL's regeneration is exactly on-policy and replays the candidates' noise, a short run
logs the sol/ figures, bad input names the flag. The FP8 numerics, corrections and metrics it shares with its parent
are tested in tests/test_fp8_rollout.py."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import fp8_sol_rl as s


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    return model, tok, llm.make_task("add", 2)


def test_sol_regeneration_is_exactly_on_policy(tiny):
    model, tok, task = tiny
    args = s.Args(sol_candidates=8, group_size=4, prompts_per_step=6)
    engine = s.FP8Engine(model, args.rollout_dtype, args.kv_fp8, args.kv_scale)
    torch.manual_seed(4)
    b = s.sol_rollout(model, tok, task, args, np.random.default_rng(0), "cpu", engine)
    assert b["completion_ids"].shape[0] == 24
    lp = common.token_logprobs(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"])
    assert ((lp - b["logprobs"]).abs() * b["completion_mask"]).max() < 1e-5  # behaviour = the fp32 trainer
    # replaying the same noise through the same policy reproduces the same tokens
    prompts = [p[m.bool()].tolist() for p, m in zip(b["prompt_ids"], b["prompt_mask"])]
    again, _, _ = s.sample(model, tok, prompts, 1, args.max_new_tokens, 1.0, b["noise"])
    assert torch.equal(again.completion_ids, b["completion_ids"])
    assert 0.5 <= b["sol"]["sol/same_tokens_frac"] <= 1


SMALL = s.Args(steps=2, prompts_per_step=4, group_size=4, sol_candidates=8, eval_every=2, eval_examples=20, pass_k=0,
               eval_hard=False, threads=1, out_dir="", exp_name="t")


def test_a_short_run_trains_on_the_regenerated_samples(tmp_path):
    summary = s.main(replace(SMALL, out_dir=str(tmp_path)))
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rollout/reward" in r]
    assert len(train) == 2 and all("sol/pair_order_kept" in r for r in train)
    assert summary["logprob_mismatch"] < 1e-4  # the trained samples came from the fp32 policy itself
    assert "sol_same_reward_frac" in summary and "kl_fp8" in summary  # the Sol-RL figures are reported


def test_grpos_sampler_weight_is_refused(tmp_path):
    """The FP8 candidates' sampler is not the trainer and --correction corrects its mismatch: grpo's second weight is
    refused, naming the flag."""
    with pytest.raises(SystemExit, match="sampler-is-cap: the FP8 sampler is not the trainer's .* --correction"):
        s.main(replace(SMALL, sampler_is_cap=2.0, out_dir=str(tmp_path)))


@pytest.mark.parametrize("change,msg", [
    ({"sol_candidates": 4}, "sol-candidates"),
    ({"unified": True}, "excludes --unified"),
])
def test_bad_input_names_the_flag(change, msg):
    with pytest.raises(SystemExit, match=msg):
        s.check_args(replace(SMALL, **change))
