"""The vLLM seam (algos/_vllm.py) against a fake vLLM: token-id prompts in, a common.Rollout out, and the
trainer's weights pushed into the engine's model after every optimiser step. The real engine needs a GPU and
vLLM, which no test machine has; this checks our side of the contract (the calls TRL's colocate mode makes)."""
import sys
import types

import pytest
import torch

import common
from algos import _llm as llm
from algos import _vllm


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class FakeLLM:
    """Answers like vLLM's LLM: per prompt, n completions with token ids, per-token {token: Logprob} dicts."""
    instances = []

    def __init__(self, **kw):
        self.kw, self.loaded, self.resets, self.calls = kw, [], 0, []
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)))
        FakeLLM.instances.append(self)

    def _load(self, weights):
        self.loaded.append({n: p.clone() for n, p in weights})

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, prompts, sp, use_tqdm=False):
        self.calls.append((prompts, sp))
        outs = []
        for j, p in enumerate(prompts):
            comps = []
            for i in range(sp.n):
                length = 1 + (i + j) % sp.max_tokens  # ragged lengths
                ids = [(7 * i + 3 * j + t) % 20 + 5 for t in range(length)]
                stop = length < sp.max_tokens
                comps.append(types.SimpleNamespace(token_ids=ids, finish_reason="stop" if stop else "length",
                                                   logprobs=[{t: _Logprob(-0.1 * (k + 1))} for k, t in enumerate(ids)]))
            outs.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=comps))
        return outs


class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.instances.clear()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    return FakeLLM


def test_engine_arguments_follow_the_colocate_recipe(fake_vllm):
    _vllm.VLLMEngine("some/model", 0.4, max_model_len=512, seed=3)
    kw = fake_vllm.instances[0].kw
    assert kw["distributed_executor_backend"] == "external_launcher"  # in-process: weights load without RPC
    assert kw["logprobs_mode"] == "processed_logprobs"  # after temperature / top-p
    assert (kw["model"], kw["gpu_memory_utilization"], kw["max_model_len"], kw["seed"]) == ("some/model", 0.4, 512, 3)


def test_generate_returns_a_rollout(fake_vllm):
    _, tok = common.load_model("tiny-0.6m")
    eng = _vllm.VLLMEngine("tiny")
    prompts = [[1, 2, 3], [4, 5]]
    model, _ = common.load_model("tiny-0.6m")
    ro = common.generate(common.Sampler(model, engine=eng), tok, prompts, group_size=3, max_new_tokens=4,
                         temperature=0.7)
    prompts_sent, sp = fake_vllm.instances[0].calls[0]
    assert [p["prompt_token_ids"] for p in prompts_sent] == prompts  # token ids, not text
    assert (sp.n, sp.max_tokens, sp.temperature, sp.logprobs) == (3, 4, 0.7, 0)
    assert sp.stop_token_ids == common.eos_ids(tok)  # the ids the trainer's mask ends on
    assert ro.completion_ids.shape == ro.logprobs.shape == ro.completion_mask.shape == (6, 4)
    assert ro.prompt_ids.shape == (6, 3) and ro.prompt_mask[3:].sum(1).tolist() == [2, 2, 2]  # left-padded, group-major
    lengths = ro.completion_mask.sum(1).tolist()
    assert lengths == [1, 2, 3, 2, 3, 4]
    assert ro.finish_reasons == ["stop", "stop", "stop", "stop", "stop", "length"]
    assert ro.logprobs[0, 0].item() == pytest.approx(-0.1) and ro.logprobs[0, 1:].abs().sum() == 0  # 0 on padding
    assert (ro.completion_ids[ro.completion_mask == 0] == tok.pad_token_id).all()
    _, sp = (eng.generate(tok, prompts, 2, 4, 0.7, 0.9, greedy=True), fake_vllm.instances[0].calls[-1])[1]
    assert sp.temperature == 0.0 and sp.top_p == 1.0


def test_grpo_pushes_weights_after_every_step(fake_vllm, monkeypatch, tmp_path):
    """grpo.main with --engine vllm: the engine samples every batch and receives the weights after each step."""
    from algos import grpo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # check_args wants a GPU for vLLM
    # the fake's completions are never right: reward their length parity instead, so the update moves the weights
    monkeypatch.setattr(llm.ArithmeticTask, "verify", lambda self, text, answer: (float(len(text) % 2), {}))
    args = grpo.Args(engine="vllm", device="cpu", steps=2, prompts_per_step=4, group_size=2, eval_every=100,
                     eval_examples=8, pass_k=0, eval_hard=False, out_dir=str(tmp_path), threads=1,
                     vllm_max_model_len=96)
    grpo.main(args)
    fake = fake_vllm.instances[0]
    assert fake.kw["max_model_len"] == 96  # --vllm-max-model-len reaches the engine
    assert len(fake.loaded) == 2 and fake.resets == 2  # one push per step
    model, _ = common.load_model("tiny-0.6m")
    names = {n for n, _ in model.named_parameters()}
    assert set(fake.loaded[-1]) == names
    first, last = fake.loaded
    assert any(not torch.equal(first[n], last[n]) for n in names)  # the second push carries the updated weights
    common.load_checkpoint(tmp_path / "grpo" / "checkpoint", model)  # the trainer's final weights
    assert all(torch.equal(last[n], p) for n, p in model.named_parameters())
