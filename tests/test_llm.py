"""algos/_llm.py: the LLM scripts' flags (LLMArgs), loading a policy with its sampler, the optimiser step, the
step-global counts. The tasks and verifiers it holds are tested in tests/test_common.py."""
import math
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

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
    with pytest.raises(SystemExit, match="sumsmix, words, jsonl:PATH or gsm8k"):
        llm.make_task("nope")


def test_help_lists_inherited_flags_and_every_task():
    out = subprocess.run([sys.executable, "algos/grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--lr", "--micro-batch-size", "--resume", "--group-size", "--clip-eps-high"):
        assert flag in out.stdout
    assert "sumsmix" in out.stdout and "words" in out.stdout  # the --task help comes from llm.TASKS


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


def test_a_subclass_keeps_the_base_flags_and_adds_its_own():
    @dataclass
    class Args(llm.LLMArgs):
        extra: int = 3
        """a method's own flag"""

    a = Args(lr=2e-4)
    assert a.extra == 3 and a.lr == 2e-4 and a.exp_name == Path(__file__).stem
