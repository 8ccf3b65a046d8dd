"""algos/hgpo.py: HGPO's hierarchical advantages against flat groups and a naive loop, LoGo's local groups, the
exact stepwise values, learning."""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from algos import hgpo


def test_all_steps_sharing_their_history_give_flat_advantages():
    """When every step of a group has the same history, every level's group is the flat group: HGPO = flat."""
    torch.manual_seed(0)
    h = (("#a", "=3;"), ("#b", "=4;"))
    steps = [(i, t, h[:t]) for i in range(8) for t in range(3)]
    rewards = torch.rand(8).round()
    rewards[0], rewards[1] = 0.0, 1.0
    groups = [0] * 4 + [1] * 4
    for std_norm in (True, False):
        flat = hgpo.hgpo_step_advantages(rewards, groups, steps, std_norm, 1.0, "flat")
        hier = hgpo.hgpo_step_advantages(rewards, groups, steps, std_norm, 1.0, "all")
        assert torch.allclose(flat, hier, atol=1e-6)
        assert flat.abs().sum() > 0


def naive_hgpo(rewards, groups, steps, std_norm, alpha):
    out = []
    for i, t, h in steps:
        num = den = 0.0
        for k in range(t + 1):
            members = [j for j, u, g in steps if groups[j] == groups[i] and u == t and g[t - k:] == h[t - k:]]
            if len(members) < 2:
                continue
            r = [rewards[j] for j in members]
            mean = sum(r) / len(r)
            std = (sum((x - mean) ** 2 for x in r) / (len(r) - 1)) ** 0.5
            a = (rewards[i] - mean) / (std + 1e-6) if std_norm else rewards[i] - mean
            num, den = num + (k + 1) ** alpha * a, den + (k + 1) ** alpha
        out.append(num / den if den else 0.0)
    return out


@pytest.mark.parametrize("std_norm", [True, False])
def test_hand_made_hierarchy_against_a_naive_loop(std_norm):
    """Five episodes of one seed with branching histories, one of another seed; alpha = 1 and 2."""
    A, B, E = ("#a", "=3;"), ("#b", "=4;"), ("zz", "err;")
    hist = [[A, B], [A, B], [A, E], [B, A], [E, E], [A, B]]
    steps = [(i, t, tuple(hist[i][:t])) for i in range(6) for t in range(3)]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    groups = [0, 0, 0, 0, 0, 1]
    for alpha in (1.0, 2.0):
        got = hgpo.hgpo_step_advantages(torch.tensor(rewards), groups, steps, std_norm, alpha, "all")
        want = naive_hgpo(rewards, groups, steps, std_norm, alpha)
        assert np.allclose(got.numpy(), want, atol=1e-5)
    # a worked value: episode 0 at turn 2 (history A, B) with std_norm off and alpha = 1:
    # level 0 {0..4}: 1 - 0.6; level 1 (last pair B) {0, 1}: 1 - 0.5; level 2 (A, B) {0, 1}: 1 - 0.5
    if not std_norm:
        got = hgpo.hgpo_step_advantages(torch.tensor(rewards), groups, steps, False, 1.0, "all")
        assert abs(got[2].item() - (1 * 0.4 + 2 * 0.5 + 3 * 0.5) / 6) < 1e-6
        assert got[17].item() == 0.0  # episode 5 is alone in its seed group


def test_logo_advantages_global_plus_local():
    """Two originals per group (group size 2); row 0 re-rolled twice (rows 4, 5) from turn 1."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = [0, 0, 1, 1, 0, 0]
    steps = [(i, t, ()) for i in range(6) for t in range(2)]
    sources = {0: 0, 4: 0, 5: 0}
    adv = hgpo.logo_step_advantages(rewards, groups, steps, sources, False, 1, 2)
    local0 = 1.0 - 1.0 / 3
    assert adv.tolist() == pytest.approx([0.5, 0.5 + local0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0,
                                          0.0, -1.0 / 3, 0.0, -1.0 / 3])


def test_per_token_loss_uses_each_steps_advantage():
    batch = {"logprobs": torch.zeros(2, 6), "turn": torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 1, 1, 1, 1]]),
             "action_mask": torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0]])}
    steps = [(0, 0, ()), (0, 1, ()), (1, 0, ()), (1, 1, ())]
    adv = hgpo.token_advantages(batch, steps, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert adv.tolist() == [[1, 1, 0, 2, 2, 0], [3, 0, 4, 0, 0, 0]]
    loss, _ = hgpo.clipped_pg_loss(torch.zeros(2, 6), torch.zeros(2, 6), adv, 0.2, 0.2)
    assert torch.equal(loss, -adv)


def test_exact_values_and_advantage_error_on_a_small_batch():
    """The reference is V(s_t+1) - V(s_t); an expert-like check: terminal steps use the episode's reward."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-toolenv")
    args = hgpo.Args(prompts_per_step=2, group_size=4, mse_rollouts=4, logo_k=2, threads=1, device="cpu")
    res = hgpo.advantage_mse(model, tok, hgpo.make_env(args), args, np.random.default_rng(0))
    assert res["n_steps"] >= 8 and res["logo_extra_turns"] > 0
    for k in ("flat", "hgpo", "logo", "trajectory"):
        assert 0 <= res[f"mse_{k}"] < 2
    assert 0 <= res["mse_reference_var"] < 0.5


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit, match="logo"):
        hgpo.check_args(hgpo.Args(logo_turn=9))


@pytest.mark.slow
def test_default_setting_trains_without_collapse(tmp_path):
    """The default (HGPO's advantages) from tiny-toolenv, shortened to 20 rollout batches. HGPO does not reliably raise
    held-out success that fast (benchmarks: 47.1 ± 11.1% after 8,000 sampled turns from 53.3%); the full default of 90
    batches does (65.0 ± 6.5%, +5.3 to +18.3 points, 3 seeds, about 4 minutes each: too long for the suite). So this
    guards against a broken update (a sign error drops success by tens of points) and checks that the run sampled its
    turns; it does not assert a gain the shortened run does not show."""
    s = hgpo.main(hgpo.Args(threads=1, out_dir=str(tmp_path), steps=20, eval_every=20, eval_examples=200,
                            env_ce_examples=16))
    assert s["eval_acc_end"] - s["eval_acc_start"] >= -0.05, s
    assert s["sampled_turns"] > 20 * 16 * 8 * 3, s
