"""Several processes through FSDP2 (common.shard), on CPU over gloo: the sharded step equals one process's on the
same global batch (full fine-tuning and LoRA), a sharded checkpoint resumes exactly and exports to a folder that
from_pretrained loads, and the logged statistics are those of the whole batch. Also the single-process pieces of
scaling up: gradient checkpointing and the sampler-trainer correction."""
import copy
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import common
from algos import _llm as llm
from algos import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
          "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def run(cmd: list, timeout: int = 400) -> str:
    """A subprocess in its own session: a hang (ranks out of step in a collective) kills the group and fails."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{cmd[-3:]} hung for {timeout}s")
    assert proc.returncode == 0, err[-3000:]
    return out


ONE_PROCESS = ["grpo", "ppo", "grpo-variant", "grpo-lora"]
TWO_RANKS = [*ONE_PROCESS, "grpo-variant-average", "reshard"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of tests/_sharded_update.py, once in one process (the whole batch) and once in one two-rank launch
    (each rank half of it): two process starts instead of ten. Returns a job's pair of output folders."""
    base = tmp_path_factory.mktemp("sharded")
    harness = os.path.join("tests", "_sharded_update.py")
    run([sys.executable, harness, str(base / "one"), *ONE_PROCESS])
    run([*LAUNCH, harness, str(base / "two"), *TWO_RANKS])
    return lambda job, ranks="two": (base / "one" / job, base / ranks / job)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_sharded_update_equals_one_process(tmp_path, runs, script):
    """3 optimiser steps on one global batch of 16 sequences (micro-batches of 3, a reference model; PPO: a critic
    and advantages whitened over the whole batch): two ranks of 8 each under FSDP2 against one process of 16.
    Plain SGD, no clipping (tests/_sharded_update.py): a parameter moves by lr x its gradient. Tolerance: fp32
    summation order only (measured: parameters equal to 1.5e-8 for GRPO, 1.2e-7 for PPO, after moving 2.5e-3 and
    4.3e-3; with the gradients averaged over ranks instead of summed they end 1.0e-3 and 1.7e-3 apart).
    The sharded checkpoint (torch.distributed.checkpoint; PPO's policy beside its critic) exports to a folder whose
    from_pretrained logits are the trained policy's (the command line `python common.py export`: the LoRA test)."""
    one, two = runs(script)
    assert_same_update(one, two)
    assert (two / "checkpoint" / ".metadata").exists()
    common.export_checkpoint(two / "checkpoint", tmp_path / "hf")
    assert_exported_logits(tmp_path / "hf", load_file(str(two / "params.safetensors")))


def test_sharded_update_equals_one_process_token_mean_epochs_checkpointing_and_fails_averaged(runs):
    """grpo.py's update with token-mean aggregation, two epochs of two mini-batches each (four optimiser steps per
    rollout batch, pi_old scored before the first) and gradient checkpointing: two ranks equal one process. With
    FSDP2's default of averaging the gradients over ranks (planted: the divide factor left alone) the same comparison
    fails on the parameters themselves: the harness steps with plain SGD and no clipping, so a halved gradient moves
    every parameter half as far (AdamW, or clipping to a norm, would hide a constant factor), and on the gradient norm.
    The mini-batches are the same global ones in both runs (tests/_sharded_update.py fixes their order)."""
    one, two = runs("grpo-variant")
    assert_same_update(one, two)
    averaged = runs("grpo-variant-average")[1]
    with pytest.raises(AssertionError, match="loss/"):  # the gradient norm, or a loss after the first of four steps
        assert_same_stats(one, averaged)
    with pytest.raises(AssertionError, match="parameters"):
        assert_same_params(one, averaged)


def test_sharded_reference_is_resharded_after_scoring(runs):
    """A bf16 run's sharded reference (algos/_shard.py: stored in bf16) scored under no_grad gives its gathered root
    weights back (each rank keeps its shard): FSDP2 reshards no root after a forward without backward, token_logprobs
    does (tests/_sharded_reshard.py). Planted on a scratch copy, the reshard() line removed: the test reports lm_head
    and the embeddings."""
    assert runs("reshard.txt")[1].read_text() == "sharded bf16"


def test_sharded_lora_update_equals_one_process(tmp_path, runs):
    """LoRA under FSDP2 (peft wraps the layers, then common.shard): the same 3 GRPO steps in two ranks and in one
    process, the reference being the policy with its adapters disabled (no second copy). Only the adapters move; the
    sharded checkpoint (the adapters' shards and their gathered peft file) exports with --merge-lora to a plain folder
    whose logits are the trained policy's (merged: W + alpha / r B A). Plain SGD: parameters equal to 1.5e-8 after
    moving 1.4e-3; 7e-4 apart with averaged gradients."""
    one, two = runs("grpo-lora")
    assert_same_update(one, two)
    params = load_file(str(two / "params.safetensors"))
    base = dict(common.load_model("tiny-0.6m")[0].named_parameters())
    for name, p in params.items():  # the frozen base weights are untouched
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace("base_model.model.", "").replace(".base_layer", "")]), name
    ckpt = two / "checkpoint"
    assert (ckpt / ".metadata").exists() and (ckpt / "adapter_model.safetensors").exists()
    with pytest.raises(SystemExit, match="--merge-lora"):
        common.export_checkpoint(ckpt, tmp_path / "x")
    run([sys.executable, "common.py", "export", str(ckpt), str(tmp_path / "hf"), "--merge-lora"])
    assert_exported_logits(tmp_path / "hf", params, lora=True)


def assert_exported_logits(folder, params: dict, lora: bool = False) -> None:
    """from_pretrained(folder) gives the logits of the tiny model holding `params` (the policy's, a critic's dropped;
    with LoRA, the peft model's, adapters active) on a few prompts; the folder has weights, tokenizer and generation
    config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder) is not None and (folder / "generation_config.json").exists()
    model = common.load_model("tiny-0.6m")[0]
    if lora:
        model = llm.add_lora(model, grpo.Args(lora_rank=4))
    missing, unexpected = model.load_state_dict({k: v for k, v in params.items() if not k.startswith("critic.")},
                                                strict=False)
    assert not unexpected and all(k.endswith("lm_head.weight") for k in missing)  # tied to the embedding
    ids = torch.tensor([[1, 12, 40, 13, 7], [1, 9, 9, 14, 30]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, model(ids).logits, atol=1e-5)


def assert_same_update(one, two) -> None:
    """Folders one and two logged the same statistics and hold the same parameters (fp32 tolerance)."""
    assert_same_stats(one, two)
    assert_same_params(one, two)


def assert_same_stats(one, two) -> None:
    """The logged statistics of every step agree (relative 1e-4: fp32 sums in another order)."""
    one, two = (json.loads((d / "stats.json").read_text()) for d in (one, two))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):  # the logged statistics of the whole batch, not rank 0's half
        for k in a:
            if k == "value/explained_var":  # a ratio of variances, logged from each rank's own half
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])


def assert_same_params(one, two) -> None:
    """The parameters after the steps agree to 1e-5, while SGD moved them at least 50 times as far from the start
    (one/init.safetensors; measured 1.4e-3 to 5e-3), so a step that did nothing, or half of one, cannot pass."""
    pa, pb = (load_file(str(d / "params.safetensors")) for d in (one, two))
    init = load_file(str(one / "init.safetensors"))
    assert set(pa) == set(pb)
    moved = max((pa[k] - init[k]).abs().max().item() for k in init)
    diff = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    assert moved > 5e-4, f"the policy's parameters moved only {moved:.2e}"
    assert diff < 1e-5, f"parameters differ by {diff:.2e} (moved {moved:.2e})"


@pytest.mark.slow
@pytest.mark.extended  # in the suite: the two-rank checkpoint written and exported above, and its one-process load
def test_sharded_checkpoint_resumes_exactly(tmp_path):  # (test_common's sharded round trips)
    """grpo.py in two processes: 3 steps in one run, against 2 steps, a sharded checkpoint
    (torch.distributed.checkpoint) and a resumed third step; the resumed run logs the same metrics."""
    flags = ["algos/grpo.py", "--device", "cpu", "--threads", "1", "--prompts-per-step", "4", "--group-size", "4",
             "--eval-examples", "20", "--eval-every", "3", "--pass-k", "0", "--no-eval-hard", "--lr", "1e-4"]
    run([*LAUNCH, *flags, "--steps", "3", "--out-dir", str(tmp_path / "whole")])
    run([*LAUNCH, *flags, "--steps", "2", "--out-dir", str(tmp_path / "half")])
    ckpt = tmp_path / "half" / "grpo" / "checkpoint"
    assert (ckpt / ".metadata").exists() and (ckpt / "trainer_state.json").exists()  # the shards, not HF weights
    run([*LAUNCH, *flags, "--steps", "3", "--out-dir", str(tmp_path / "half"), "--resume", str(ckpt)])
    rows = lambda d: {r["step"]: r for r in map(json.loads, open(tmp_path / d / "grpo" / "metrics.jsonl"))}  # noqa
    whole, resumed = rows("whole"), rows("half")
    for k, v in whole[3].items():
        if not k.startswith("perf/") and not k.endswith("per_s"):  # timings differ
            assert resumed[3][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (k, v, resumed[3][k])


# ---- one process ----
@pytest.fixture(scope="module")
def tiny_batch():
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m", "cpu")
    args = replace(grpo.Args(), prompts_per_step=4, group_size=4, max_new_tokens=8)
    batch = grpo.rollout(common.Sampler(model), tok, llm.make_task("add", 2), args, np.random.default_rng(0), "cpu")
    return model, batch


def test_grad_checkpointing_leaves_loss_and_gradients_unchanged(tiny_batch):
    model, batch = tiny_batch
    grads = []
    for ckpt in (False, True):
        m = copy.deepcopy(model).train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lp = common.token_logprobs(m, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], share_prompts=False)  # checkpointed layers take it anyway
        loss = -(lp * batch["adv"][:, None]).sum()
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


class _OneProcess:
    num_processes = 1


class _Engine:
    """A stand-in rollout engine: the sampler is another computation than the trainer's."""

    def sync_weights(self, model):
        pass


def test_sampler_trainer_correction(tiny_batch):
    """Same computation (CPU, the HF sampler): no weight, today's update. A sampler whose log-probs differ (a fake
    engine: --engine vllm with perturbed behaviour log-probs): each token's loss is weighted by
    min(pi_old / pi_sampler, C), checked against a naive loop over tokens, with its statistics logged."""
    model, batch = tiny_batch
    args = replace(grpo.Args(), prompts_per_step=4, group_size=4, max_new_tokens=8, lr=0.0)
    same = common.Sampler(model)
    assert same.is_trainer
    out = grpo.update(copy.deepcopy(model).train(), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                      grpo.grpo_loss, args, 1, _OneProcess(), same)
    assert "rollout/is_weight_mean" not in out

    torch.manual_seed(1)
    fake = dict(batch, logprobs=(batch["logprobs"] + 0.5 * torch.randn_like(batch["logprobs"])).clamp(max=0)
                * batch["completion_mask"])
    m = copy.deepcopy(model).train()
    out = grpo.update(m, torch.optim.SGD(m.parameters(), lr=0.0), fake, grpo.grpo_loss,
                      replace(args, sampler_is_cap=2.0), 1, _OneProcess(), common.Sampler(m, engine=_Engine()))
    with torch.no_grad():
        old = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                    batch["completion_mask"])
    mask, B, C = batch["completion_mask"], *batch["completion_ids"].shape
    ws, per_seq = [], []
    for i in range(B):  # on-policy: ratio 1, so each token's loss is -A_i * w_it
        toks = [t for t in range(C) if mask[i, t]]
        w = [min(float(torch.exp(old[i, t] - fake["logprobs"][i, t])), 2.0) for t in toks]
        ws += w
        per_seq.append(sum(-batch["adv"][i].item() * x for x in w) / len(toks))
    assert out["rollout/is_weight_mean"] == pytest.approx(np.mean(ws), rel=1e-4)
    assert out["rollout/is_truncated_frac"] == pytest.approx(np.mean([x >= 2.0 for x in ws]), abs=1e-9)
    assert out["loss/pg"] == pytest.approx(sum(per_seq) / B, rel=1e-4, abs=1e-7)
    assert 0 < out["rollout/is_truncated_frac"] < 1  # the case exercises the cap


@pytest.mark.parametrize("script", ["opd", "async_opd", "self_opd", "sft"])
def test_grad_checkpointing_flag_leaves_the_first_steps_unchanged(tmp_path, script):
    """--grad-checkpointing on the distillation scripts and SFT (the GRPO family: the test above): two optimiser
    steps from the shipped model log the same losses with and without it (fp32 recomputation: 1e-5)."""
    import importlib

    mod = importlib.import_module(f"algos.{script}")
    small = dict(steps=2, eval_examples=10, out_dir=str(tmp_path), threads=1)
    small.update(eval_every=10**6, pass_k=0) if script == "sft" else small.update(
        prompts_per_step=4, group_size=2, eval_every=10**6, eval_hard=False, pass_k=0)
    logs = []
    for on in (False, True):
        have = mod.Args.__dataclass_fields__
        mod.main(replace(mod.Args(), exp_name=f"ck{on}", grad_checkpointing=on,
                         **{k: v for k, v in small.items() if k in have}))
        rows = [json.loads(x) for x in open(tmp_path / f"ck{on}" / "metrics.jsonl")]
        logs.append({k: v for r in rows for k, v in r.items() if k.startswith("loss/") and r["step"] >= 1})
    assert logs[0] and logs[0].keys() == logs[1].keys()
    for k, v in logs[0].items():
        assert logs[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
