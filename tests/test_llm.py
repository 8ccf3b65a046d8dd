"""algos/_llm.py: the LLM scripts' flags (LLMArgs), loading a policy with its sampler, the optimiser step, the
step-global counts. The tasks and verifiers it holds are tested in tests/test_common.py."""
import json
import math
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo

ROOT = Path(__file__).resolve().parent.parent


class _OneProcess:
    num_processes, process_index, device = 1, 0, torch.device("cpu")


def test_llm_args_name_the_run_after_the_script_and_list_every_task():
    assert llm.LLMArgs().exp_name == "_llm" and grpo.Args().exp_name == "grpo"  # the defining module's file name
    assert grpo.Args(exp_name="mine").exp_name == "mine"
    base = {f.name for f in fields(llm.LLMArgs)}
    assert base <= {f.name for f in fields(grpo.Args)} and "group_size" not in base  # method fields stay in scripts
    for name in ("add", "addsteps", "sums", "sumsmix", "words", "jsonl:PATH", "gsm8k"):
        assert name in llm.TASKS
    with pytest.raises(SystemExit, match="sumsmix, words, jsonl:PATH, gsm8k or rg:NAME"):
        llm.make_task("nope")


def test_help_lists_inherited_flags_and_every_task():
    out = subprocess.run([sys.executable, "algos/grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--lr", "--micro-batch-size", "--resume", "--group-size", "--clip-eps-high"):
        assert flag in out.stdout
    assert "sumsmix" in out.stdout and "words" in out.stdout  # the --task help comes from llm.TASKS


@pytest.mark.parametrize("kw, msg", [
    (dict(threads=0), "--threads 0"), (dict(eval_every=0), "--eval-every 0"), (dict(micro_batch_size=0), "--micro"),
    (dict(max_grad_norm=0.0), "clipping off"), (dict(temperature=0.0), "--temperature"), (dict(lr=-1e-4), "--lr"),
    (dict(pass_k=-1), "--pass-k"), (dict(save_every=-1), "--save-every"), (dict(warmup_steps=-1), "--warmup-steps"),
    (dict(top_p=0.0), "--top-p"), (dict(top_p=1.5), "--top-p"), (dict(vllm_gpu_memory=1.5), "--vllm-gpu-memory"),
    (dict(lora_rank=8, lora_alpha=0.0), "--lora-alpha"), (dict(device="tpu"), "--device 'tpu'"),
    (dict(digits=0), "--digits 0"), (dict(digits=9), "8 at most with --eval-hard"),
    (dict(task="sums", digits=10, eval_hard=False), "--digits 10"), (dict(sampler_is_cap=-1.0), "--sampler-is-cap"),
    (dict(agg_const=-1), "--agg-const")])
def test_check_plumbing_names_each_bad_flag(kw, msg):
    """A bad plumbing flag stops the run with a message naming it (before, several failed deep inside torch or
    transformers, and --max-grad-norm 0 silently zeroed every gradient)."""
    with pytest.raises(SystemExit, match=msg):
        llm.check_plumbing(grpo.Args(**kw))


def test_check_plumbing_passes_every_scripts_defaults_and_make_task_names_bad_sizes():
    import importlib

    for path in sorted((ROOT / "algos").glob("[a-z]*.py")):
        mod = importlib.import_module(f"algos.{path.stem}")
        if isinstance(getattr(mod, "Args", None), type) and issubclass(mod.Args, llm.LLMArgs):
            llm.check_plumbing(mod.Args())  # raises on a default the check would refuse
    llm.check_plumbing(grpo.Args(digits=9, eval_hard=False, task="sums", device="cuda:1", lr=0.0))
    with pytest.raises(SystemExit, match="--task sums20 .*operands in 2..16"):
        llm.make_task("sums20")


def test_lr_factor_warmup_then_cosine_to_ten_percent():
    args = SimpleNamespace(warmup_steps=4, lr_schedule="cosine")
    assert [llm.lr_factor(s, 20, args) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert llm.lr_factor(4, 20, args) == pytest.approx(1.0)
    assert llm.lr_factor(12, 20, args) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert llm.lr_factor(20, 20, args) == pytest.approx(0.1)
    assert llm.lr_factor(15, 20, SimpleNamespace(warmup_steps=0, lr_schedule="constant")) == 1.0


def test_optimizer_step_clips_schedules_refreshes_and_stops_on_nan():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    args = SimpleNamespace(lr=0.1, weight_decay=0.0, max_grad_norm=0.5, warmup_steps=2, lr_schedule="constant")
    opt = llm.make_optimizer(model.parameters(), args)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.0
    (model(torch.randn(5, 3)) * 100).sum().backward()
    refreshed = []
    sampler = SimpleNamespace(refresh=lambda: refreshed.append(1))
    norm = llm.optimizer_step(model, opt, args, 0, 10, sampler)
    total = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
    assert norm > 0.5 and total == pytest.approx(0.5, rel=1e-5)  # the pre-clip norm is returned, the grads clipped
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and refreshed == [1]  # warm-up step 1 of 2
    model.weight.grad.fill_(float("nan"))
    with pytest.raises(SystemExit, match="non-finite loss or gradient at optimiser step 3"):
        llm.optimizer_step(model, opt, args, 3, 10, sampler)


def test_all_ranks_sum_and_step_counts_in_one_process():
    assert llm.all_ranks_sum({"a": 1.5, "b": 2}, _OneProcess()) == {"a": 1.5, "b": 2}
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    assert llm.step_counts(mask, _OneProcess()) == (3, 6)


def test_all_ranks_sum_reduces_over_ranks():
    class TwoRanks:  # a reduce that adds a second rank holding the same values
        num_processes = 2

        @staticmethod
        def reduce(t, op):
            assert op == "sum"
            return t * 2

    assert llm.all_ranks_sum({"x": 1.0, "n": 3}, TwoRanks()) == {"n": 6.0, "x": 2.0}
    assert llm.step_counts(torch.ones(2, 4), TwoRanks()) == (4, 16)


def test_load_policy_gives_a_trainer_sampler_and_a_reference_only_when_asked():
    args = grpo.Args(grad_checkpointing=True)
    model, tok, ref, sampler = llm.load_policy(args, _OneProcess())
    assert ref is None and model.training and model.is_gradient_checkpointing
    assert isinstance(sampler, common.Sampler) and sampler.is_trainer and sampler.module() is model
    assert "_sampler" not in model.__dict__ and "_bf16_sampler" not in model.__dict__
    _, _, ref, _ = llm.load_policy(grpo.Args(), _OneProcess(), with_ref=True)
    assert ref is not None and not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_fp32_attention_feeds_the_attention_kernel_fp32_and_keeps_the_padding_mask(monkeypatch):
    """--attention-fp32 under bf16 autocast: the SDPA call receives fp32 queries, keys and values outside autocast
    (spied; under autocast the kernel would cast them to bf16, as it does for the bf16 model), and the
    token log-probs of a batch with a left-padded row stay within bf16 rounding of the fp32 model's. Tolerance 0.5
    nats on these low-probability tokens: measured 0.25 for all-bf16 and 0.33 with fp32 attention; the same function
    registered without its mask (Hugging Face gives an attention name it does not know no mask) was 1.9 off."""
    import transformers.integrations.sdpa_attention as sdpa

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(sdpa.torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, *a, **kw: seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled(
                            "cpu"))) or real(q, k, v, *a, **kw))
    scores = {}
    for name, args in {"fp32": grpo.Args(dtype="fp32"), "bf16": grpo.Args(dtype="bf16"),
                       "attention fp32": grpo.Args(dtype="bf16", attention_fp32=True)}.items():
        model, tok, _, _ = llm.load_policy(args, _OneProcess())
        prompt, pmask = common.left_pad(common.encode_prompts(tok, ["12+34=", "5+6="]), tok.pad_token_id)
        comp = torch.tensor([[5, 7, 9], [6, 8, 2]])
        seen.clear()
        with torch.no_grad():
            scores[name] = common.token_logprobs(model, prompt, pmask, comp, torch.ones_like(comp), share_prompts=False)
        fp32 = torch.float32
        assert set(seen) == ({(fp32, fp32, fp32, False)} if name != "bf16" else {(fp32, fp32, torch.bfloat16, True)})
    assert pmask[1, 0] == 0  # the second row is padded
    for name in ("bf16", "attention fp32"):
        assert (scores[name] - scores["fp32"]).abs().max() < 0.5, name
    with pytest.raises(SystemExit, match="--dtype bf16"):
        llm.load_policy(grpo.Args(dtype="fp32", attention_fp32=True), _OneProcess())


def test_inverse_cdf_draw_follows_the_distribution_and_never_draws_a_zero():
    """inverse_cdf_draw against the probabilities it is given: chi-square over 40,000 draws of a 6-token distribution
    with two tokens of probability 0 (after top-p they are -inf), per row (rows differ)."""
    from scipy.stats import chisquare

    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.15, 0.0, 0.15], [0.05, 0.05, 0.0, 0.6, 0.3, 0.0]])
    logprobs = probs.log()  # log 0 = -inf, as top-p leaves the scores
    draws = torch.cat([llm.inverse_cdf_draw(logprobs.repeat_interleave(1000, 0)).view(2, 1000) for _ in range(20)], 1)
    for row, p in zip(draws, probs):
        counts = torch.bincount(row, minlength=6)
        assert (counts[p == 0] == 0).all()
        assert chisquare(counts[p > 0].numpy(), (p[p > 0] * len(row)).numpy()).pvalue > 1e-3


def test_generate_with_the_inverse_cdf_draw_records_the_trainers_logprobs():
    """--inverse-cdf-sampling: generate draws through the recorder and takes its argmax; the recorded behaviour
    log-probs are the trainer's at temperature 0.7 (tolerance: fp32 rounding of two log-softmaxes, measured 1e-6),
    a seeded call repeats, and flags that take generation elsewhere are refused."""
    model, tok, _, sampler = llm.load_policy(grpo.Args(inverse_cdf_sampling=True), _OneProcess())
    assert sampler.draw is llm.inverse_cdf_draw
    prompts = common.encode_prompts(tok, ["12+34=", "5+6=", "70+8="])
    torch.manual_seed(1)
    ro = common.generate(sampler, tok, prompts, 4, 8, temperature=0.7)
    torch.manual_seed(1)
    again = common.generate(sampler, tok, prompts, 4, 8, temperature=0.7)
    assert torch.equal(ro.completion_ids, again.completion_ids) and ro.completion_mask.sum() > 12
    with torch.no_grad():
        lp = common.token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 0.7)
    assert torch.allclose(lp, ro.logprobs, atol=1e-4)
    assert len(set(ro.texts)) > 3  # sampled, not greedy
    for change in ({"engine": "vllm"}, {"dtype": "bf16", "attention_fp32": True, "engine": "vllm"}):
        with pytest.raises(SystemExit, match="one process with --engine hf"):
            llm.load_policy(grpo.Args(inverse_cdf_sampling=True, **change), _OneProcess())


def test_fused_adamw_takes_the_loop_adamws_step_up_to_rounding():
    """--fused-adamw: three AdamW steps from the same weights and gradients end within fp32 rounding of the default
    per-parameter loop (tolerance 1e-6 on parameters of order 0.1 that move by about 3e-3)."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32) * 0.1, torch.randn(32) * 0.1]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    ends = []
    for fused in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = llm.make_optimizer(params, grpo.Args(lr=1e-3, weight_decay=0.01, fused_adamw=fused))
        assert opt.defaults["fused"] is (True if fused else None)
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            opt.step()
        ends.append([p.detach() for p in params])
    for a, b, w in zip(*ends, weights):
        assert (a - w).abs().max() > 1e-3 and torch.allclose(a, b, rtol=0, atol=1e-6)


_FAULTS = """
import json, resource
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
import common
from algos import _llm as llm
torch.set_num_threads(1)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
class Tok:
    pad_token_id, eos_token_id = 0, 2
    def batch_decode(self, ids, **kw):
        return [""] * len(ids)
runs = {}
for mode in ("plain", "keep"):  # glibc's defaults first: the flag cannot be undone
    if mode == "keep":
        llm.load_policy(llm.LLMArgs(keep_freed_memory=True), Accelerator(cpu=True))  # the flag, as scripts apply it
    for _ in range(2):  # warm-up: the heap grows to what one call needs
        common.generate(model, Tok(), [[1, 5, 6]] * 4, 8, max_new_tokens=8, temperature=0.7)
    torch.manual_seed(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ro = common.generate(model, Tok(), [[1, 5, 6]] * 4, 8, max_new_tokens=8, temperature=0.7)
    runs[mode] = {"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "ids": ro.completion_ids.tolist(), "logprobs": ro.logprobs.tolist()}
print(json.dumps(runs))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_the_page_faults_of_a_real_vocabulary_and_changes_no_sample():
    """--keep-freed-memory (llm.keep_freed_memory, applied by load_policy): one sampled generate call of 32 sequences
    x 8 tokens over a 49,152-token vocabulary (SmolLM2's; a one-layer model), after two warm-up calls, in a fresh
    process, first with glibc's defaults, then with the flag. Without it the process faults its [batch x vocab]
    tensors' pages in again at every decoding step (measured 13,800 and 15,300 minor page faults in the call); with
    it at most a quarter of that (measured 3; 6 to 3,100 with 16 tokens). The same tokens and log-probs, exactly:
    only where memory comes from changes."""
    out = subprocess.run([sys.executable, "-c", _FAULTS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["plain"]["faults"] > 5000, runs["plain"]["faults"]  # the cost it removes exists
    assert runs["keep"]["faults"] < runs["plain"]["faults"] / 4, (runs["keep"]["faults"], runs["plain"]["faults"])
    assert runs["keep"]["ids"] == runs["plain"]["ids"] and runs["keep"]["logprobs"] == runs["plain"]["logprobs"]


def test_a_subclass_keeps_the_base_flags_and_adds_its_own():
    @dataclass
    class Args(llm.LLMArgs):
        extra: int = 3
        """a method's own flag"""

    a = Args(lr=2e-4)
    assert a.extra == 3 and a.lr == 2e-4 and a.exp_name == Path(__file__).stem


# ---- the final answer, the format reward, reward functions ----
GAMING = {  # response -> whether it earns the answer 4 (each check an exam grader would make)
    " ".join(str(i) for i in range(1, 121)): False,  # a list of numbers that contains the answer
    r"It is \boxed{4} or maybe \boxed{5}": False,  # two different boxed answers
    "2+2 is 4. Final answer: 5": False,  # the right number mid-way, a wrong final one
    "4 or 5": False,
    r"So the answer is \boxed{4}.": True,
    "Adding them gives 4.": True,
    r"\boxed{4}, as 1+3 = 4": True,  # one boxed answer is the answer, whatever follows
}


@pytest.mark.parametrize("task", [llm.WordProblemTask(), llm.DatasetTask("t", [], [])], ids=["words", "dataset"])
def test_the_answer_check_cannot_be_gamed(task):
    for response, right in GAMING.items():
        assert task.verify(response, "4")[0] == float(right), response


def test_final_answer_and_format():
    assert llm.final_answer(r"x \boxed{12} y") == "12" and llm.final_answer(r"\boxed{1} \boxed{2}") is None
    assert llm.final_answer("3 apples, then 7") == "7" and llm.final_answer("none") is None
    assert llm.final_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"  # one level of braces inside the box
    assert llm.answer_format(r"so \boxed{4}") == 1.0 and llm.answer_format(r"\boxed{4} \boxed{5}") == 0.0
    assert llm.answer_format("it is 4.") == 1.0 and llm.answer_format("4 is it") == 0.0  # the form: a number last
    assert llm.answer_format(r"\boxed{}") == 0.0


def test_rewards_combine_by_weight_and_log_each_term(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, answers, **kw):\n    return [None if '!' in c else 1.0 for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    rewards = llm.Rewards(["correct", "format:0.5", "length:0.1", "my_rewards:shout:2"])
    assert [n for n, _, _ in rewards.terms] == ["correct", "format", "length", "my_rewards:shout"]
    total, terms = rewards(["p", "q"], ["so 4", "7 apples!"], ["4", "4"], task=llm.WordProblemTask(),
                           completion_lengths=[3, 10], max_new_tokens=10)
    assert terms == {"correct": [1.0, 0.0], "format": [1.0, 0.0], "length": [-0.3, -1.0],
                     "my_rewards:shout": [1.0, None]}
    assert total == pytest.approx([1 + 0.5 - 0.03 + 2, 0 + 0 - 0.1 + 0])  # None: not applicable, adds nothing


@pytest.mark.parametrize("body,msg", [
    ("raise ValueError('boom')", "reward 'bad:f' raised ValueError: boom"),
    ("return [1.0]", "returned 1 values for 2 completions"),
    ("return [1.0, 'yes']", "returned 'yes' for completion 1"),
    ("return [float('nan'), 1.0]", "returned nan for completion 0"),
])
def test_a_bad_reward_function_is_named(tmp_path, monkeypatch, body, msg):
    (tmp_path / "bad.py").write_text(f"def f(prompts, completions, answers, **kw):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bad", raising=False)
    with pytest.raises(SystemExit, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        llm.Rewards(["bad:f"])(["p", "q"], ["a", "b"], ["1", "1"], task=llm.WordProblemTask(),
                               completion_lengths=[1, 1], max_new_tokens=4)
    with pytest.raises(SystemExit, match="not a built-in"):
        llm.Rewards(["nonsense"])
    with pytest.raises(SystemExit, match="cannot import it"):
        llm.Rewards(["no_such_module:f"])


def test_grpo_trains_on_a_weighted_sum_and_logs_each_term(tmp_path):
    args = grpo.Args(steps=2, prompts_per_step=4, group_size=4, eval_every=100, eval_examples=8, pass_k=0,
                     eval_hard=False, out_dir=str(tmp_path), threads=1, reward=("correct", "length:0.5"))
    grpo.main(args)
    rows = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")][1:]
    for r in rows:  # the trained reward is correct + 0.5 * length, each term logged on its own
        assert r["rollout/reward"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/length"], abs=1e-6)
        assert -1 <= r["reward/length"] < 0


@pytest.fixture(scope="module")
def rg_task():
    pytest.importorskip("reasoning_gym")
    return llm.make_task("rg:basic_arithmetic,gsm_symbolic")


def test_reasoning_gym_split_answers_and_errors(rg_task):
    """A fixed held-out split (its own seed; no question in both), the generator's scorer on the one boxed answer,
    the format instruction in every prompt, and unknown names listed."""
    assert isinstance(rg_task, llm.ReasoningGymTask)
    assert not {e.prompt for e in rg_task.train} & {e.prompt for e in rg_task.test}
    assert len(rg_task.test) == 1000 and len(rg_task.train) > 2000
    again = llm.make_task("rg:basic_arithmetic,gsm_symbolic")  # the same split every time
    assert [e.prompt for e in again.test[:5]] == [e.prompt for e in rg_task.test[:5]]
    ex = rg_task.sample("test", 20, np.random.default_rng(0))
    assert all(e.prompt.endswith(r"Put the final answer in \boxed{}.") for e in ex)
    for e in ex:
        assert rg_task.verify(rf"so \boxed{{{e.answer}}}", e.answer)[0] == 1.0
        assert rg_task.verify(rf"\boxed{{{e.answer}}} or \boxed{{{e.answer}1}}", e.answer)[0] == 0.0  # hedging
        assert rg_task.verify(f"{e.answer}", e.answer)[1]["format"] == 0.0  # the form asked for is a box
    with pytest.raises(SystemExit, match="unknown reasoning-gym task.*available: .*basic_arithmetic"):
        llm.make_task("rg:no_such_task")


def test_reasoning_gym_settings_reach_the_generator():
    """`rg:NAME:FIELD=VALUE...` sets the generator's config (here at most 2 kinds of animal, at most 4 of each), and
    a misspelt field or a field without a value is an error that names the generator's fields."""
    pytest.importorskip("reasoning_gym")
    task = llm.make_task("rg:leg_counting:min_animals=1:max_animals=2:max_instances=4")
    counts = [e.answer.entry["metadata"]["animals"] for e in task.test]
    assert all(1 <= len(c) <= 2 and all(1 <= n <= 4 for n in c.values()) for c in counts)
    default = llm.make_task("rg:leg_counting")
    assert max(len(e.answer.entry["metadata"]["animals"]) for e in default.test) > 2  # the default is wider
    assert llm.ReasoningGymTask.parse_spec("x:a=2:b=0.5:c=hi") == ("x", {"a": 2, "b": 0.5, "c": "hi"})
    with pytest.raises(SystemExit, match="unknown setting.*max_animals, max_instances, min_animals"):
        llm.make_task("rg:leg_counting:max_animal=2")
    with pytest.raises(SystemExit, match="NAME:FIELD=VALUE"):
        llm.make_task("rg:leg_counting:max_animals")


def test_reasoning_gym_answer_check_cannot_be_gamed(rg_task):
    e = next(x for x in rg_task.test if x.answer.lstrip("-").isdigit())
    wrong = str(int(e.answer) + 1)
    assert rg_task.verify(" ".join(str(i) for i in range(int(e.answer) - 5, int(e.answer) + 5)), e.answer)[0] == 0
    assert rg_task.verify(rf"{e.answer} first, but finally \boxed{{{wrong}}}", e.answer)[0] == 0
    assert rg_task.verify(rf"it is \boxed{{{e.answer}}}.", e.answer)[0] == 1


# ---- LoRA (peft) ----
LORA = grpo.Args(lora_rank=4, lora_alpha=8.0)


def lora_policy(seed: int = 0, **over):
    """The tiny policy with LoRA adapters whose B is non-zero (B = 0 at the start would make the policy the base);
    peft draws A from torch's global generator: seeded here."""
    torch.manual_seed(seed)
    model, tok, ref, sampler = llm.load_policy(replace(LORA, **over), _OneProcess(), with_ref=True)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, tok, ref, sampler


def some_batch(tok):
    prompts = common.encode_prompts(tok, ["12+34=", "5+77=", "40+8="])
    ids, mask = common.left_pad(prompts, tok.pad_token_id)
    torch.manual_seed(0)
    comp = torch.randint(3, 20, (3, 5))
    return ids, mask, comp, torch.ones_like(comp)


def test_lora_trains_only_the_adapters_and_the_reference_is_the_base_with_adapters_off():
    """--lora-rank wraps the policy with peft in load_policy (every attention and MLP projection by default); the KL
    reference is the same model under disable_adapter (common.AdaptersOff), not a copy, and gives the base model's
    log-probs; the sampler decodes with the trainer itself on CPU; gradient checkpointing changes no gradient."""
    model, tok, ref, sampler = lora_policy()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == set(llm.LLMArgs().lora_targets)
    assert isinstance(ref, common.AdaptersOff) and ref.model is model  # the policy itself: no second copy
    assert isinstance(sampler, llm.LoRASampler) and sampler.is_trainer and sampler.module() is model
    batch = some_batch(tok)
    base = common.load_model("tiny-0.6m")[0]
    with torch.no_grad():
        want = common.token_logprobs(base, *batch)
        assert torch.allclose(common.token_logprobs(ref, *batch), want, atol=1e-6)
        assert (common.token_logprobs(model, *batch) - want).abs().max() > 1e-3  # the adapters matter
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable  # still trainable after ref
    grads = []
    for ckpt in (False, True):
        m = lora_policy(grad_checkpointing=ckpt)[0]
        common.token_logprobs(m, *batch).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == set(trainable)
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in trainable)


def test_lora_flags_are_checked():
    model = common.load_model("tiny-0.6m")[0]
    with pytest.raises(SystemExit, match="--lora-targets nope: .*linear layers: .*q_proj"):
        llm.add_lora(model, replace(LORA, lora_targets=("nope",)))
    with pytest.raises(SystemExit, match="--lora-rank must be 0"):
        llm.add_lora(model, replace(LORA, lora_rank=-1))


class _RecordingEngine:
    """A stand-in vLLM engine: records what sync_weights reads (named_parameters of what it is given)."""

    def sync_weights(self, model):
        self.weights = {n: p.clone() for n, p in model.named_parameters()}


def test_lora_sampler_decodes_copies_with_merged_weights():
    """merged_weights gives the plain model's names and W + alpha / r B A (peft's own merge, to fp32 rounding); the
    gathered copy of a sharded run and the one-GPU bf16 copy (forced here on CPU) are plain models holding those
    weights after each refresh, and a vLLM engine receives them under the same names."""
    model, tok, _, _ = lora_policy()
    merged = dict(llm.copy.deepcopy(model).merge_and_unload().named_parameters())
    weights = dict(llm.merged_weights(model))
    assert weights.keys() == merged.keys()
    assert all(torch.allclose(weights[n], merged[n], atol=1e-6) for n in merged)

    gathered = llm.LoRASampler(model, sharded=True)  # on CPU without a process group: the copy alone
    assert type(gathered.full).__name__ == "LlamaForCausalLM" and gathered.module() is gathered.full
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
    gathered.refresh()
    new = dict(llm.merged_weights(model))
    assert all(torch.equal(p, new[n]) for n, p in gathered.full.named_parameters())
    assert gathered.is_trainer  # fp32 on CPU: the same computation, to rounding

    bf16 = llm.LoRASampler(model, fast=True)
    bf16.half, model.amp_dtype = True, torch.bfloat16  # what a CUDA device with --dtype bf16 sets
    try:
        m = bf16.module()
        assert type(m).__name__ == "LlamaForCausalLM" and not bf16.is_trainer
        assert all(p.dtype == torch.bfloat16 and torch.equal(p, new[n].to(torch.bfloat16)) for n, p in
                   m.named_parameters())
    finally:
        del model.amp_dtype

    engine = _RecordingEngine()
    llm.LoRASampler(model, engine=engine).refresh()
    assert engine.weights.keys() == new.keys() and all(torch.equal(engine.weights[n], new[n]) for n in new)


def test_lora_grpo_resume_is_exact(tmp_path):
    """A LoRA run of grpo.py (with a KL term: the adapters-off reference; two PPO epochs of two mini-batches) resumed
    from its checkpoint (the adapters in peft's safetensors, AdamW's state of the adapters) logs what an uninterrupted
    one does, as tests/test_grpo.py::test_resume_is_exact checks for full fine-tuning."""
    cfg = grpo.Args(steps=4, prompts_per_step=16, group_size=4, eval_every=2, eval_examples=50, pass_k=0,
                    eval_hard=False, ppo_epochs=2, minibatches=2, micro_batch_size=32, lora_rank=8, lr=1e-3,
                    kl_coef=0.05, threads=1, exp_name="t")
    grpo.main(replace(cfg, out_dir=str(tmp_path / "a")))
    grpo.main(replace(cfg, steps=2, out_dir=str(tmp_path / "b")))
    ckpt = tmp_path / "b" / "t" / "checkpoint"
    assert (ckpt / "adapter_model.safetensors").exists() and not list(ckpt.glob("model*.safetensors"))
    grpo.main(replace(cfg, out_dir=str(tmp_path / "b"), resume=str(ckpt)))
    rows = lambda d: {r["step"]: r for r in map(json.loads, open(tmp_path / d / "t" / "metrics.jsonl"))}  # noqa
    a, b = rows("a"), rows("b")
    assert a[4]["loss/kl"] > 0  # the reference differs from the policy: the adapters moved
    for step in (3, 4):
        for key in ("rollout/reward", "loss/pg", "loss/kl", "loss/clipfrac", "loss/grad_norm"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[4]["eval/acc"] == b[4]["eval/acc"]


def test_memory_plan_lora_terms_match_a_real_peft_model():
    """benchmarks/memory_plan.py's LoRA terms on a small Llama (GQA, biases) wrapped by peft as add_lora does: the
    adapters' shapes in peft's order, AdamW's state after a step (adapters only), and the bytes autograd saves in the
    decoder, to the byte (fp32 and autocast, SDPA and eager)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_memory_plan import saved_bytes, tiny_model

    from benchmarks import memory_plan as mp

    for attn, bf16 in (("sdpa", False), ("sdpa", True), ("eager", True)):
        model, shape = tiny_model("llama", attn)
        model = llm.add_lora(model, replace(LORA, lora_rank=8))
        adapters = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        assert adapters == mp.lora_param_shapes(shape, 8)
        M, L = 6, 40
        ids, mask = torch.randint(0, 512, (M, L)), torch.ones(M, L, dtype=torch.long)
        mask[:3, :7] = 0
        act, _ = saved_bytes(model.get_base_model(), ids, mask, bf16)
        want = (shape.layers * mp.layer_saved_bytes(shape, L, bf16, attn, lora=8) +
                mp.model_saved_bytes(shape, bf16, lora=8)) * M * L
        assert act == want, (attn, bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    assert mp.adamw_state_bytes(shape, lora=8) == sum(t.numel() * t.element_size() for t in state)
    plan = mp.plan(shape, mp.Setup(lora=8, kl=True))
    assert plan["ref_model"] == 0 and plan["grads"] == 4 * sum(map(mp.numel, adapters))


def test_lora_grpo_learns(tmp_path):
    """grpo.py with --lora-rank 8 (every attention and MLP projection, alpha 16, the default lr 1e-4) on the default
    task. Stated margin: +8 points of held-out greedy accuracy in 30 rollout batches (measured: 35.3% -> 50.3%, +15.0;
    full fine-tuning in the same 30 batches: +7.0)."""
    s = grpo.main(grpo.Args(steps=30, prompts_per_step=32, group_size=8, eval_every=30, eval_examples=300, pass_k=0,
                            eval_hard=False, out_dir=str(tmp_path), exp_name="t", lora_rank=8, threads=1))
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.08, s
    assert s["logprob_mismatch"] < 1e-3  # on CPU the sampler is the trainer: it decodes through the adapters


def test_builtin_rewards_and_number_comparison():
    task = llm.WordProblemTask()
    done = dict(task=task, completion_lengths=[2, 8], max_new_tokens=8)
    assert llm.reward_correct(["p", "q"], ["so 4", "5"], ["4", "4"], **done) == [1.0, 0.0]
    assert llm.reward_format(["p", "q"], ["so 4", "four"], ["4", "4"], **done) == [1.0, 0.0]
    assert llm.reward_length(["p", "q"], ["a", "b"], ["4", "4"], **done) == [-0.25, -1.0]
    assert llm._same_number("4.0", "4") and llm._same_number("1,000", "1000") and not llm._same_number("x", "4")


def test_run_seeds_each_step_and_saves_its_counters(tmp_path):
    """llm.Run: the task and held-out sets, the step-0 evaluation, per-step draws that depend on (seed, step, rank)
    only (a second Run draws the same), and a script's counters saved in the checkpoint."""
    args = grpo.Args(steps=2, eval_examples=4, pass_k=0, eval_hard=False, threads=1, out_dir=str(tmp_path))
    run = llm.Run(args)
    assert run.task.name == "add2" and len(run.eval_sets["main"]) == 4 and run.hard_task is None
    model, tok, _, sampler = llm.load_policy(args, run.accel)
    run.start(model, tok, llm.make_optimizer(model.parameters(), args), sampler, counters={"seen": 0})
    assert run.history[0]["step"] == 0 and "eval/acc" in run.history[0] and run.counters == {"seen": 0}
    draws = [(step, int(rng.integers(1000)), torch.rand(1).item()) for step, rng in run.steps()]
    again = [(step, int(rng.integers(1000)), torch.rand(1).item()) for step, rng in llm.Run(args).steps()]
    assert draws == again and [d[0] for d in draws] == [1, 2]
    run.counters["seen"] = 5
    run.save(2)
    state = json.loads((tmp_path / "grpo" / "checkpoint" / "trainer_state.json").read_text())
    assert state["seen"] == 5 and state["step"] == 2


def test_drop_long_prompts_counts_what_it_removes_and_refuses_an_empty_pool():
    """A dataset's over-long prompts leave its pools when the run starts (with the count), generated tasks are
    untouched, and a pool left empty is a clear error instead of a failure half-way through a run."""
    _, tok = common.load_model("tiny-0.6m")
    short, long_ = llm.Example("1+2=", "3"), llm.Example("1+2=" * 40, "3")
    task = llm.DatasetTask("mine", [short, long_, short], [long_, short])
    limit = len(common.encode_prompts(tok, [short.prompt])[0])
    assert llm.drop_long_prompts(task, tok, limit) == {"train": 1, "test": 1}
    assert task.train == [short, short] and task.test == [short]
    assert llm.drop_long_prompts(llm.make_task("add"), tok, 3) == {}
    with pytest.raises(SystemExit, match="every train prompt of task 'mine' is longer than 2 tokens"):
        llm.drop_long_prompts(task, tok, 2)
