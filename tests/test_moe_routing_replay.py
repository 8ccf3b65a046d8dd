"""algos/moe_routing_replay.py: replay reproduces the rollout exactly, noise breaks it without replay, the gradient paths
of R3's replayed gate and of the load-balancing loss, PR2's predicted routes, the diagnostics against naive loops, and a
short learning run from the shipped tiny-moe."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
from algos import _llm as llm  # noqa: E402
from algos import moe_routing_replay as mrr  # noqa: E402

torch.set_num_threads(1)


def small_args(**kw):
    base = dict(prompts_per_step=8, group_size=4, max_new_tokens=8, minibatches=1, eval_examples=50, pass_k=0)
    return mrr.Args(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny():
    model, tok = common.load_model("tiny-moe", "cpu", "fp32")
    return model, tok, llm.make_task("add", 2)


def roll(model, tok, task, args, noise=0.0, dtype="fp32", predictors=None, pr2_scale=1.0, seed=0):
    """One rollout batch from a fresh engine, and a fresh trainer Routing on a copy of the policy."""
    import copy

    trainer = copy.deepcopy(model)
    engine = mrr.MoERolloutEngine(trainer, dtype, noise, predictors, pr2_scale)
    routing = mrr.Routing(trainer)
    torch.manual_seed(seed)
    batch = mrr.rollout(trainer, tok, task, args, np.random.default_rng(seed), "cpu", engine)
    return trainer, routing, batch


def max_gap(trainer, routing, batch, args):
    with torch.no_grad():
        lp = mrr.scored(trainer, routing, batch, torch.arange(len(batch["rewards"])), args)
    return float(((lp - batch["logprobs"]).abs() * batch["completion_mask"]).max())


def test_shipped_model_is_a_transformers_moe(tiny):
    model, _, _ = tiny
    routers = mrr.find_routers(model)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and len(routers) == model.config.num_hidden_layers
    assert routers[0].top_k == 2 and routers[0].weight.shape[0] == 4
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_sft_makes_the_moe_architecture_with_its_load_balancing_loss(tiny, tmp_path):
    from algos import sft

    shipped = tiny[0].config
    for key, value in sft.NEW_MOE_MODELS["new-moe"].items():  # the card's command rebuilds the shipped architecture
        assert getattr(shipped, key) == value, key
    s = sft.main(sft.Args(model="new-moe", steps=2, batch_size=8, eval_every=2, eval_examples=4, max_new_tokens=4,
                          threads=1, out_dir=str(tmp_path)))
    assert s["n_params"] == sum(p.numel() for p in tiny[0].parameters())
    model, _ = sft.new_model("new-moe", 0)
    ids = torch.randint(3, 99, (2, 6))
    out = model(input_ids=ids, output_router_logits=True)
    assert out.aux_loss is not None and out.aux_loss > 0  # what sft.main adds, times router_aux_loss_coef


def test_replay_reproduces_the_rollout_exactly_and_noise_breaks_it_without(tiny):
    model, tok, task = tiny
    args = small_args(replay="r3")
    # same precision, no noise: the trainer's forward on the recorded routes gives the rollout's log-probs
    trainer, routing, batch = roll(model, tok, task, args)
    assert batch["routes"].shape[:2] == (2, 32) and batch["routes"].shape[2] == batch["scoring"].shape[1]
    assert max_gap(trainer, routing, batch, args) < 1e-5
    # noisy rollout routers: replay still reproduces them; the trainer's own routes do not
    trainer, routing, batch = roll(model, tok, task, args, noise=1.0)
    assert max_gap(trainer, routing, batch, args) < 1e-5
    free = small_args(replay="none")
    assert max_gap(trainer, routing, batch, free) > 1e-2
    with torch.no_grad():
        mrr.scored(trainer, routing, batch, torch.arange(32), free, keep=True)
    n, c = mrr.route_disagreement(routing.kept, batch["routes"], batch["scoring"])
    assert 0.05 < n / c < 0.95


def test_replayed_gradient_is_the_same_with_gradient_checkpointing(tiny):
    """A checkpointed layer recomputes its forward in the backward: it must route the recomputation the same way."""
    model, tok, task = tiny
    args = small_args(replay="r3")
    trainer, routing, batch = roll(model, tok, task, args, noise=1.0)
    grads = []
    for ckpt in (False, True):
        trainer.train()
        if ckpt:
            trainer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer.zero_grad(set_to_none=True)
        lp = mrr.scored(trainer, routing, batch, torch.arange(32), args, keep=True)
        ((lp * batch["adv"][:, None]).sum() + routing.aux_loss()).backward()
        routing.set()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_pr2_routes_by_the_prediction_and_the_trainer_replays_it(tiny):
    model, tok, task = tiny
    predictors = torch.nn.ModuleList(torch.nn.Linear(64, 4) for _ in range(2))
    for p in predictors:  # a predicted router change that strongly favours expert 3
        torch.nn.init.zeros_(p.weight)
        p.bias.data = torch.tensor([0.0, 0.0, 0.0, 50.0])
    args = small_args(replay="pr2")
    trainer, routing, batch = roll(model, tok, task, args, predictors=predictors)
    fed = batch["routes"][batch["routes"] >= 0].view(-1, 2)
    assert (fed == 3).any(-1).all()  # every fed token of every layer was routed to expert 3
    assert max_gap(trainer, routing, batch, args) < 1e-5  # replayed exactly


def test_fit_predictors_learns_a_linear_router_change():
    torch.manual_seed(0)
    h = [torch.randn(256, 8) for _ in range(2)]
    true = [torch.randn(8, 4) for _ in range(2)]
    delta = [x @ a for x, a in zip(h, true)]
    predictors = torch.nn.ModuleList(torch.nn.Linear(8, 4) for _ in range(2))
    opt = torch.optim.Adam(predictors.parameters(), lr=5e-2)
    before, _ = mrr.fit_predictors(predictors, opt, h, delta, 300)
    forecast, fitted = mrr.fit_predictors(predictors, opt, h, delta, 1)
    assert fitted <= forecast < 1e-3 * before


def test_gate_weights_against_a_naive_loop_and_no_gradient_through_the_ids():
    """R3's choice: the replayed mask fixes which experts run; their gate weights are the trainer's softmax over that
    set, so the policy gradient reaches the router through the gate weights and not through the (integer) mask."""
    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    ids = torch.tensor([[3, 0], [1, 2], [0, 1], [2, 3], [3, 1], [0, 2]])  # not the top-2 of the logits
    g = mrr.gate_weights(logits, ids, True)
    for n in range(6):
        z = sum(torch.exp(logits[n, j]) for j in ids[n])
        for slot in range(2):
            assert torch.allclose(g[n, slot], torch.exp(logits[n, ids[n, slot]]) / z, atol=1e-6)
    assert not ids.dtype.is_floating_point  # nothing to differentiate
    (g * torch.randn(6, 2)).sum().backward()
    grad = logits.grad
    assert (grad.abs().sum(1) > 0).all()
    unused = torch.ones(6, 4, dtype=torch.bool).scatter(1, ids, False)
    assert grad[unused].abs().max() < 1e-6 * grad.abs().max()  # an expert outside the replayed set: none (rounding)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(40, 4)
    ids = torch.softmax(logits, -1).topk(2, -1).indices
    ours = mrr.load_balancing_loss(logits, ids, torch.ones(40), 4)
    theirs = load_balancing_loss_func((logits,), 4, 2)
    assert torch.allclose(ours, theirs, atol=1e-6)
    mask = (torch.arange(40) % 3 != 0).float()  # masked rows leave both the counts and the probabilities
    assert torch.allclose(mrr.load_balancing_loss(logits, ids, mask, 4),
                          mrr.load_balancing_loss(logits[mask.bool()], ids[mask.bool()], torch.ones(int(mask.sum())), 4))


def test_router_gradient_comes_from_the_load_balancing_loss_under_replay():
    """Top-1 routing with a renormalised gate: the replayed gate is exactly 1, so the policy loss gives the router no
    gradient at all (the route is data), while the load-balancing loss does; the experts learn from the policy loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=1, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg)
    routing = mrr.Routing(model)
    ids, mask = torch.randint(0, 20, (3, 5)), torch.ones(3, 5)
    routing.set(torch.randint(0, 4, (1, 3, 5, 1)), mask, keep=True)
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    router, experts = routing.routers[0], model.model.layers[0].mlp.experts
    assert router.weight.grad is None or router.weight.grad.abs().max() < 1e-9  # g = p_i / p_i = 1: rounding only
    assert experts.down_proj.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    model(input_ids=ids)
    routing.aux_loss().backward()
    assert router.weight.grad.abs().sum() > 0


def test_mismatch_metrics_and_disagreement_against_loops():
    torch.manual_seed(0)
    old, mu = torch.randn(4, 5) * 0.3 - 1, torch.randn(4, 5) * 0.3 - 1
    mask = (torch.rand(4, 5) > 0.3).float()
    out = mrr.mismatch_metrics(old, mu, mask)
    r = [float(torch.exp(old[i, j] - mu[i, j])) for i in range(4) for j in range(5) if mask[i, j]]
    assert out["mismatch/kl_k3"] == pytest.approx(np.mean([x - 1 - np.log(x) for x in r]), rel=1e-5)
    assert out["mismatch/ratio_var"] == pytest.approx(np.var(r), rel=1e-4)
    own = torch.tensor([[[0, 1], [2, 3]]])  # [L=1, N=2, k]
    kept = [(None, None, own.view(2, 2), None)]
    routes = torch.tensor([[[[1, 0], [2, 1]]]])  # [L=1, b=1, T=2, k]: the same set, then a different one
    assert mrr.route_disagreement(kept, routes, torch.ones(1, 2)) == (1.0, 2.0)


def test_bad_input():
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(SystemExit, match="mixture-of-experts"):
        mrr.find_routers(LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
                                                      num_attention_heads=2, intermediate_size=8)))
    with pytest.raises(SystemExit, match="router-noise"):
        mrr.check_args(mrr.Args(router_noise=-1))
    with pytest.raises(SystemExit, match="minibatches"):
        mrr.check_args(mrr.Args(minibatches=3))
    with pytest.raises(SystemExit, match="--engine vllm"):  # the routes are recorded by the Hugging Face engine
        mrr.check_args(mrr.Args(engine="vllm"))
    with pytest.raises(SystemExit, match="sampler-is-cap"):
        mrr.check_args(mrr.Args(sampler_is_cap=-1))


def test_tis_weights_tokens_only_when_the_engine_is_not_the_trainer(tiny):
    """grpo.py's sampler correction (R3's TIS arm): with --sampler-is-cap > 0 the update weights each token by
    min(pi_old / mu, C) and logs it, but only when the engine samples another computation than the trainer's."""
    import copy
    from types import SimpleNamespace

    model, tok, task = tiny
    assert mrr.MoERolloutEngine(model, "fp32", 0.0).is_trainer
    assert not mrr.MoERolloutEngine(model, "bf16", 0.0).is_trainer
    assert not mrr.MoERolloutEngine(model, "fp32", 0.5).is_trainer
    for dtype, noise, cap, corrected in (("bf16", 1.0, 2.0, True), ("bf16", 1.0, 0.0, False), ("fp32", 0.0, 2.0, False)):
        trainer = copy.deepcopy(model)
        engine = mrr.MoERolloutEngine(trainer, dtype, noise)
        routing = mrr.Routing(trainer)
        args = small_args(replay="none", sampler_is_cap=cap)
        torch.manual_seed(0)
        batch = mrr.rollout(trainer, tok, task, args, np.random.default_rng(0), "cpu", engine)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        stats = mrr.update(trainer, opt, batch, routing, args, 1, SimpleNamespace(num_processes=1), engine)
        assert ("rollout/is_weight_mean" in stats) == corrected
        if corrected:  # the noisy bf16 engine: some tokens' ratio pi_old / mu exceeds the cap
            assert 0 < stats["rollout/is_weight_mean"] <= cap and 0 < stats["rollout/is_truncated_frac"] < 1


def test_learns_from_the_shipped_tiny_moe(tmp_path):
    s = mrr.main(mrr.Args(**LEARN, out_dir=str(tmp_path)))
    assert s["eval_acc_end"] - s["eval_acc_start"] >= LEARN_MARGIN
    assert s["disagree"] > 0.01 and s["kl_k3"] > 0  # the rollout really routes differently


LEARN = dict(steps=20, eval_every=20, eval_examples=200, pass_k=0, eval_hard=False)
LEARN_MARGIN = 0.05
