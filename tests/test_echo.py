"""algos/echo.py: the environment-token cross-entropy term (its gradient lives on observation tokens only), lambda = 0
gives multi-turn GRPO, learning."""
import pytest
import torch

from algos import echo


def make_mb(B=4, C=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (B, C), generator=g)  # 0 padding, 1 action, 2 observation
    kind[:, 0] = 1
    obs = (kind == 2).float()
    return {"adv": torch.randn(B, generator=g), "mask": (kind == 1).float(), "obs_mask": obs,
            "n_obs": int(obs.sum()) + 3, "old": -torch.rand(B, C, generator=g), "ref": None}


def test_echo_term_has_zero_gradient_on_action_tokens_and_the_policy_term_none_on_observations():
    mb = make_mb()
    logp = (-torch.rand(4, 9)).requires_grad_()
    args = echo.Args(echo_coef=0.5)
    total, _ = echo.echo_loss(logp, mb, 4, int(mb["mask"].sum()), args)
    pg, _ = echo.grpo_loss(logp, mb, 4, int(mb["mask"].sum()), args)
    g_total, = torch.autograd.grad(total, logp, retain_graph=True)
    g_pg, = torch.autograd.grad(pg, logp)
    g_echo = g_total - g_pg
    act, obs = mb["mask"].bool(), mb["obs_mask"].bool()
    assert torch.all(g_echo[act] == 0) and torch.all(g_pg[obs] == 0)
    # on observation tokens the term is the token-mean cross-entropy: d/dlogp = -lambda / n_obs
    assert torch.allclose(g_echo[obs], torch.full_like(g_echo[obs], -0.5 / mb["n_obs"]))
    assert (g_pg[act] != 0).any()


def test_zero_weight_is_multiturn_grpo():
    mb = make_mb(seed=1)
    logp = -torch.rand(4, 9)
    a, _ = echo.echo_loss(logp, mb, 4, int(mb["mask"].sum()), echo.Args(echo_coef=0.0))
    b, _ = echo.grpo_loss(logp, mb, 4, int(mb["mask"].sum()), echo.Args())
    assert torch.equal(a, b)


@pytest.mark.slow
def test_lowers_held_out_environment_cross_entropy_where_grpo_does_not(tmp_path):
    """What ECHO's term learns, on held-out rollouts of the initial policy: a short run of the default setting (12
    rollout batches of 8 seeds) ends with their observation tokens' cross-entropy at least 0.5 nats below the same run
    at lambda = 0 (measured: 9.87 vs 11.24 nats, from 11.09) and below its own start. Held-out success is not asserted
    here: both runs dip in their first batches; the 60-batch default raises it in every seed (benchmarks)."""
    kw = dict(threads=1, steps=12, prompts_per_step=8, eval_every=12, eval_examples=100, env_ce_examples=16)
    s = echo.main(echo.Args(out_dir=str(tmp_path / "echo"), **kw))
    s0 = echo.main(echo.Args(echo_coef=0.0, out_dir=str(tmp_path / "grpo"), **kw))
    assert s["eval_env_ce_start"] == s0["eval_env_ce_start"]
    assert s["eval_env_ce_end"] < s0["eval_env_ce_end"] - 0.5, (s, s0)
    assert s["eval_env_ce_end"] < s["eval_env_ce_start"] - 0.5, s


def test_top_p_and_a_validation_split_without_the_prompt_split_are_refused():
    """--top-p is refused, never ignored (rollouts sample the full tempered distribution that the trainer scores); the
    validation split that chooses lambda exists only under the prompt-keyed split."""
    with pytest.raises(SystemExit, match="--top-p"):
        echo.check_args(echo.Args(top_p=0.9))
    with pytest.raises(SystemExit, match="--eval-split val needs --env-split prompt"):
        echo.check_args(echo.Args(eval_split="val"))
    echo.check_args(echo.Args(eval_split="val", env_split="prompt"))
    env = echo.make_env(echo.Args(env_split="prompt"))
    assert env.split == "prompt" and echo.make_env(echo.Args()).split == "episode"
