"""algos/td3_bc.py: alpha = 0 is exactly behaviour cloning; it learns on pendulum-medium; clear errors."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tyro

from algos import _offline_data as D
from algos import td3_bc

ROOT = Path(__file__).resolve().parent.parent


def test_alpha_zero_gradient_equals_bc_gradient():
    torch.manual_seed(0)
    actor, critic = D.Actor(3, 1, 32), D.Critic(3, 1, 32)
    s, a = torch.randn(64, 3), torch.rand(64, 1) * 2 - 1
    g_td3 = torch.autograd.grad(td3_bc.actor_loss(actor, critic, s, a, alpha=0.0), list(actor.parameters()))
    g_bc = torch.autograd.grad(td3_bc.bc_loss(actor, s, a), list(actor.parameters()))
    for x, y in zip(g_td3, g_bc):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    g_q = torch.autograd.grad(td3_bc.actor_loss(actor, critic, s, a, alpha=2.5), list(actor.parameters()))
    assert any((x - y).abs().max() > 1e-6 for x, y in zip(g_q, g_bc))  # alpha > 0 does use the critic


def test_critic_target_uses_min_of_twins_and_done_mask():
    torch.manual_seed(0)
    critic, actor = D.Critic(3, 1, 16), D.Actor(3, 1, 16)
    s, a, s2 = torch.randn(8, 3), torch.rand(8, 1), torch.randn(8, 3)
    r, d = torch.randn(8), torch.ones(8)  # terminal: target is just r
    loss, _ = td3_bc.critic_loss(critic, critic, actor, s, a, r, s2, d, 0.99, 0.0, 0.5)
    q1, q2 = critic(s, a)
    torch.testing.assert_close(loss, ((q1 - r) ** 2).mean() + ((q2 - r) ** 2).mean())


def test_learns_on_pendulum_medium(tmp_path):
    s = td3_bc.main(td3_bc.Args(total_steps=1600, eval_every=800, out_dir=str(tmp_path)))
    assert s["score_last"] > s["score_first"] + 30, s  # untrained policy ~ random; trained well above
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "curve.png").exists()


@pytest.mark.parametrize("kw,msg", [({"alpha": -1.0}, "--alpha"), ({"dataset": "hopper"}, "--dataset 'hopper'"),
                                    ({"total_steps": 0}, "--total-steps"), ({"lr": -1e-3}, "--lr"),
                                    ({"tau": 0.0}, "--tau")])
def test_bad_args(kw, msg, tmp_path):
    with pytest.raises(SystemExit, match=msg):
        td3_bc.main(td3_bc.Args(out_dir=str(tmp_path), **kw))


def test_a_bad_flag_on_the_command_line_ends_with_its_message():
    """The offline scripts stop on a bad flag as the LLM scripts do: the message, no traceback."""
    out = subprocess.run([sys.executable, "algos/td3_bc.py", "--alpha", "-1"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "--alpha must be >= 0" in out.stderr and "Traceback" not in out.stderr


def test_cli_flags_of_the_shared_and_own_fields():
    """Args extends D.TD3Args: the shared fields keep their flags and defaults next to TD3+BC's own."""
    a = tyro.cli(td3_bc.Args, args=["--alpha", "0", "--policy-freq", "3", "--hidden", "64", "--no-normalize-states"])
    assert (a.alpha, a.policy_freq, a.hidden, a.normalize_states) == (0.0, 3, 64, False)
    assert (a.exp_name, a.dataset, a.tau, a.total_steps, a.policy_noise) == ("td3_bc", "pendulum-medium", 0.005,
                                                                            10_000, 0.2)
