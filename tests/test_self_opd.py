"""algos/self_opd.py: privileged context never reaches the student (rollouts or gradient), position weights,
clipped forward KL, span marks, the KL-channel schedule, identical views give zero loss, the chunked update
against the previous full-tensor computation, learning, bad input."""
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from _full_vocab import assert_close, chunked_step, full_gradient, full_logprobs
from algos import self_opd as so


def test_privileged_prompt_is_the_worked_solution():
    task = llm.make_task("add")
    ex = task.make(47, 85)
    assert so.privileged_prompt(ex, task, "solution") == "47+85:7+5=12;4+8+1=13;="
    assert so.privileged_prompt(ex, task, "answer") == "47+85=132\n47+85="


def test_position_weights_increase_with_mean_one():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).float()
    w = so.position_weights(mask)
    for i in range(2):
        n = int(mask[i].sum())
        assert torch.allclose(w[i, :n].mean(), torch.tensor(1.0)) and (w[i, 1:n] > w[i, :n - 1]).all()
        assert (w[i, n:] == 0).all()


def test_clipped_fkl_value_and_gradient():
    logits = (torch.randn(6, 9) * 3).requires_grad_(True)
    s, t = torch.log_softmax(logits, -1), torch.log_softmax(torch.randn(6, 9) * 3, -1)
    f = so.forward_kl(s, t)
    out = so.clipped_fkl(s, t, 0.5)
    assert torch.allclose(out, f.clamp(max=0.5), atol=1e-6)
    assert so.clipped_fkl(s, s.detach(), 0.5).abs().max() < 1e-6
    (g,) = torch.autograd.grad(so.clipped_fkl(s, s.detach(), 0.5).sum(), logits)
    assert g.abs().max() < 1e-6  # the student's own view as teacher: no signal


def test_trace_loss_identical_views_is_pure_grpo():
    logits = torch.randn(2, 3, 7).requires_grad_(True)
    s = torch.log_softmax(logits, -1)
    tokens = torch.randint(0, 7, (2, 3))
    s_tok = s.gather(-1, tokens[..., None]).squeeze(-1)
    m, key, err = torch.ones(2, 3), torch.tensor([[0, 1, 0], [0, 0, 0.]]), torch.tensor([[0, 0, 0], [1, 1, 0.]])
    adv = torch.tensor([1.0, -1.0])
    loss = so.trace_loss(s, s.detach(), s_tok, adv[:, None], m, key, err, 1.0, True)
    want = -(adv[:, None] * s_tok) * (1 - key - err)
    assert torch.allclose(loss, want, atol=1e-6)


def test_critical_masks_mark_carries_and_first_error():
    task = llm.make_task("add")
    exs = [task.make(47, 85), task.make(47, 85), task.make(12, 13)]
    key, err = so.critical_masks(task, exs, ["132", "142", "25"], [1.0, 0.0, 1.0], 5)
    assert key[0].tolist() == [1, 1, 0, 0, 0]  # 132: the hundreds and tens digits receive carries
    assert err[1].tolist() == [0, 1, 0, 0, 0]  # 142 vs 132: first wrong character
    assert key[2].sum() == 0 and err[2].sum() == 0 and err[0].sum() == 0
    assert so.error_mask(err, 2, torch.ones(3, 5))[1].tolist() == [0, 1, 1, 0, 0]
    steps = llm.make_task("addsteps")
    key, _ = so.critical_masks(steps, [steps.make(47, 85)], ["7+5=12;4+8+1=13;=132"], [1.0], 24)
    t = "7+5=12;4+8+1=13;=132"
    assert [t[j] for j in key[0].nonzero().flatten().tolist()] == ["1", "1", "3"]  # "+1" term, carried digits


@pytest.mark.parametrize("a,b,text,marked", [
    (23, 41, "3+1=4;2+4=6;=64", []),  # no carry: the operand 1 of "3+1=" is not a carry term
    (51, 1, "1+1=2;5+0=5;=52", []),
    (19, 1, "9+1=10;1+0+1=2;=20", [11, 16]),  # operand "+1=" in step 1 unmarked; carry "+1" and the carried "2"
    (19, 11, "9+1=10;1+1+1=3;=30", [11, 16]),
    (47, 85, "7+5=12;4+8+1=13;=132", [11, 17, 18]),
    (155, 250, "5+0=5;5+5=10;1+2+1=4;=405", [17, 22]),  # carry into the hundreds only
    (23, 41, "3+1=4;2+4+1=6;=64", []),  # a "+1" written where no carry exists is not a carry span
])
def test_carry_spans_mark_only_real_carries(a, b, text, marked):
    task = llm.make_task("addsteps", digits=3)
    key, _ = so.critical_masks(task, [task.make(a, b)], [text], [1.0], 30)
    assert key[0].nonzero().flatten().tolist() == marked, [text[j] for j in key[0].nonzero().flatten().tolist()]
    assert all(text[j] in "0123456789" for j in marked)


def test_kl_channel_schedule():
    a = so.Args(kl_coef=2.0, kl_warmup=3, kl_decay=4)
    assert [so.kl_channel_weight(s, a) for s in (1, 3, 5, 7, 9)] == [2.0, 2.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("privileged", ["solution", "answer"])
def test_privileged_context_never_reaches_the_student(tmp_path, monkeypatch, privileged):
    """The leak this guards against: the privileged context x* (worked solution or answer) reaching the student,
    through the prompts its rollouts are sampled from or through the forward pass that carries the gradient.
    The privileged-view evaluation, which shows x* to the model on purpose, is stubbed out, so every x* seen
    below comes from training. Checked exactly, token for token: every rollout is sampled from a plain prompt x;
    every forward with gradient sees exactly x + that rollout's completion; the teacher's forward (no
    gradient) sees x* + the same completion."""
    task = llm.make_task("add")
    events = []  # in call order: ("rollout", prompts, Rollout) and ("forward", ids, grad enabled)
    generate, load_model = common.generate, common.load_model

    def spy_generate(model, tok, prompts, *a, **kw):
        ro = generate(model, tok, prompts, *a, **kw)
        events.append(("rollout", prompts, ro))
        return ro

    def spy_load_model(*a, **kw):
        model, tok = load_model(*a, **kw)
        model.get_input_embeddings().register_forward_hook(
            lambda mod, inp, out: events.append(("forward", inp[0].detach().clone(), torch.is_grad_enabled())))
        return model, tok

    monkeypatch.setattr(common, "generate", spy_generate)
    monkeypatch.setattr(common, "load_model", spy_load_model)
    monkeypatch.setattr(so, "privileged_eval", lambda *a, **kw: float("nan"))
    so.main(so.Args(steps=2, prompts_per_step=4, group_size=2, eval_examples=4, eval_hard=False, mode="opsd",
                    privileged=privileged, out_dir=str(tmp_path)))
    _, tok = load_model("tiny-0.6m")
    strip = lambda row: [t for t in row.tolist() if t != tok.pad_token_id]
    rollouts = [(p, ro) for kind, p, ro in events if kind == "rollout"]
    assert len(rollouts) >= 2
    for prompts in (p for p, _ in rollouts):  # training and evaluation rollouts: plain prompts only
        for ids in prompts:
            assert re.fullmatch(r"\d+\+\d+=", tok.decode(ids, skip_special_tokens=True)), tok.decode(ids)
    student = teacher = 0
    last = None
    for kind, x, y in events:
        if kind == "rollout":
            last = y
            continue
        if last is None or x.shape[0] != last.completion_ids.shape[0]:
            continue
        comps = [strip(c) for c in last.completion_ids]
        plain = [strip(r) for r in last.prompt_ids]
        examples = [task.make(*(int(v) for v in tok.decode(r, skip_special_tokens=True)[:-1].split("+")))
                    for r in plain]
        priv = common.encode_prompts(tok, [so.privileged_prompt(e, task, privileged) for e in examples])
        rows = [strip(r) for r in x]
        if y:  # gradient: the student
            assert rows == [p + c for p, c in zip(plain, comps)], "the student's forward is not x + completion"
            student += 1
        elif rows == [p + c for p, c in zip(priv, comps)]:
            teacher += 1
    assert student == 2 and teacher == 2, (student, teacher)  # one of each per training step


@pytest.fixture(scope="module")
def policy():
    return common.load_model("tiny-0.6m")


@pytest.mark.parametrize("mode", ["opsd", "pw-opsd", "trace", "grpo"])
def test_chunked_update_equals_the_full_tensor_computation(monkeypatch, policy, mode):
    """opd.py's update with self_opd_loss, chunk by chunk over positions (3 per chunk), gives the loss and
    gradient of the previous computation on whole [B, C, V] log-probs of both views (1e-5)."""
    from algos import grpo

    model, tok = policy
    task = llm.make_task("add")
    args = so.Args(mode=mode, prompts_per_step=4, group_size=2, kl_clip=0.5)
    torch.manual_seed(0)
    batch, = so.rollout(model, tok, task, args, np.random.default_rng(1), "cpu", step=1)
    if mode == "trace":
        assert batch["key"].sum() + batch["err"].sum() > 0
    stats, g_new = chunked_step(monkeypatch, so, model, model, [batch], so.self_opd_loss, args)

    tokens, mask = batch["completion_ids"], batch["completion_mask"].float()
    n_seqs, n_tokens = len(tokens), int(mask.sum())
    s = full_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], tokens, batch["completion_mask"])
    with torch.no_grad():
        t = full_logprobs(model, batch["privileged_ids"], batch["privileged_mask"], tokens, batch["completion_mask"])
    s_tok = s.gather(-1, tokens[..., None]).squeeze(-1)
    if mode in ("opsd", "pw-opsd"):
        tl = so.clipped_fkl(s, t, args.kl_clip) * (so.position_weights(mask) if mode == "pw-opsd" else 1.0)
        loss = common.masked_sum(tl, mask) / n_tokens
    elif mode == "grpo":
        loss = grpo.aggregate_loss(-(batch["adv"][:, None] * s_tok), mask, "seq-mean", n_seqs, n_tokens, 0)
    else:
        tl = so.trace_loss(s, t, s_tok, batch["adv"][:, None], mask, batch["key"], batch["err"], batch["kl_weight"],
                           args.error_rkl)
        loss = grpo.aggregate_loss(tl, mask, "seq-mean", n_seqs, n_tokens, 0)
    assert_close(stats["loss/total"], loss.item(), "loss")
    g_old = full_gradient(model, loss)
    assert g_old.abs().max() > 1e-3
    assert_close(g_new, g_old, "gradient")
    assert_close(stats["kl/forward"], common.masked_sum(so.forward_kl(s, t), mask).item() / n_tokens, "kl/forward")


def test_self_opd_learns(tmp_path):
    s = so.main(so.Args(steps=40, eval_every=40, eval_examples=300, eval_hard=False, out_dir=str(tmp_path)))
    # stated margin: +10 points in 40 steps (measured: 35.0% -> 53.0%; the privileged view is ~100% accurate)
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.10, s
    assert s["privileged_acc_start"] > 0.9


@pytest.mark.parametrize("mode", ["trace", "grpo", "pw-opsd"])
def test_modes_run(tmp_path, mode):
    s = so.main(so.Args(mode=mode, steps=2, prompts_per_step=4, eval_examples=10, eval_hard=False,
                        out_dir=str(tmp_path)))
    assert s["gen_tokens"] > 0 and s["entropy_first"] >= 0


def test_resume_is_exact(tmp_path):
    """2 steps, the final checkpoint, then --resume to 4 against 4 steps in one run: the same metrics."""
    cfg = so.Args(mode="trace", steps=4, eval_every=2, prompts_per_step=4, eval_examples=10, eval_hard=False,
                  exp_name="t", kl_warmup=2, kl_decay=2)
    straight = so.main(replace(cfg, out_dir=str(tmp_path / "a")))
    so.main(replace(cfg, steps=2, out_dir=str(tmp_path / "b")))
    resumed = so.main(replace(cfg, out_dir=str(tmp_path / "b"), resume=str(tmp_path / "b" / "t" / "checkpoint")))
    for key in ("eval_acc_end", "privileged_acc_start", "privileged_acc_end", "entropy_last"):
        assert straight[key] == resumed[key], key
    rows = lambda d: {r["step"]: r for r in map(json.loads, open(tmp_path / d / "t" / "metrics.jsonl"))}  # noqa: E731
    a, b = rows("a"), rows("b")
    for step in (3, 4):
        for key in ("rollout/reward", "loss/total", "trace/kl_weight", "loss/grad_norm", "kl/forward"):
            assert a[step][key] == b[step][key], (step, key)


@pytest.mark.parametrize("change,msg", [
    ({"mode": "trace", "group_size": 1}, "group-size"),
    ({"kl_clip": 0.0}, "kl-clip"),
    ({"mode": "trace", "task": "jsonl:/nonexistent.jsonl"}, "no such file"),
    ({"task": "mul"}, "unknown task"),
    ({"engine": "vllm"}, "engine vllm"),
])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        so.main(replace(so.Args(out_dir=str(tmp_path)), **change))


def test_modes_table_generator_reproduces_the_committed_table(tmp_path, monkeypatch):
    """benchmarks/self_opd_modes.py rebuilds benchmarks/results/self_opd.md from the committed CSV exactly (its
    caption says what the teacher sees: the worked scratchpad, not the answer)."""
    from benchmarks import self_opd_modes as bench

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.report()
    assert (tmp_path / "self_opd.md").read_text() == (bench.ROOT / "benchmarks/results/self_opd.md").read_text()
