"""algos/_vllm.py's memory-bound paths against a fake vLLM (no test machine has vLLM or a GPU): weights streamed to
load_weights one parameter at a time in the engine's dtype, sleep mode around every generate call and weight sync,
the context limit refused with a clear message, and no full sampler copy when vLLM samples with several processes."""
import sys
import types

import pytest
import torch

import common
from algos import _vllm


class FakeLLM:
    """The parts of vLLM's LLM the engine calls, recording them; its model holds bf16 weights as a bf16 checkpoint's."""

    def __init__(self, **kw):
        self.kw, self.events, self.pulled = kw, [], []
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        model.load_weights = self._load
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))))

    def _load(self, weights):
        self.events.append("load")
        assert not isinstance(weights, (list, tuple)), "load_weights got every tensor at once"
        for name, w in weights:  # pulled one at a time
            self.pulled.append((name, w.dtype, len(self.pulled)))

    def reset_prefix_cache(self):
        self.events.append("reset")

    def sleep(self, level):
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.events.append("wake:" + ",".join(tags))

    def generate(self, prompts, sp, use_tqdm=False):
        self.events.append("generate")
        comp = types.SimpleNamespace(token_ids=[5, 6], finish_reason="length",
                                     logprobs=[{5: types.SimpleNamespace(logprob=-0.5)},
                                               {6: types.SimpleNamespace(logprob=-0.25)}])
        return [types.SimpleNamespace(outputs=[comp] * sp.n) for _ in prompts]


@pytest.fixture
def engine(monkeypatch):
    sp = lambda **kw: types.SimpleNamespace(**kw)  # noqa: E731
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=sp))
    return lambda **kw: _vllm.VLLMEngine("tiny-model", **kw)


def test_weights_stream_one_parameter_at_a_time_in_the_engines_dtype(engine):
    eng = engine()
    trainer = torch.nn.Linear(4, 3)  # fp32 master weights
    eng.sync_weights(trainer)
    assert eng.llm.events == ["load", "reset"]
    assert eng.llm.pulled == [("weight", torch.bfloat16, 0), ("bias", torch.bfloat16, 1)]


def test_sleep_mode_frees_the_engine_between_calls_and_wakes_it_for_each_use(engine):
    """--vllm-sleep: sleep (level 1) after each generate; a weight sync wakes the weights only, sampling wakes both."""
    eng = engine(sleep=True)
    assert eng.llm.kw["enable_sleep_mode"] is True
    _, tok = common.load_model("tiny-0.6m")
    eng.generate(tok, [[1, 5, 6]], 2, 4, 1.0, 1.0, False)
    eng.sync_weights(torch.nn.Linear(4, 3))
    eng.generate(tok, [[1, 5, 6]], 2, 4, 1.0, 1.0, False)
    assert eng.llm.events == ["generate", "sleep1", "wake:weights", "load", "reset", "wake:kv_cache", "generate",
                              "sleep1"]
    plain = engine()
    plain.generate(tok, [[1, 5, 6]], 2, 4, 1.0, 1.0, False)
    assert "enable_sleep_mode" not in plain.llm.kw and plain.llm.events == ["generate"]


def test_a_prompt_beyond_vllms_context_is_a_clear_error(engine):
    eng = engine(max_model_len=16)
    _, tok = common.load_model("tiny-0.6m")
    with pytest.raises(SystemExit, match="exceeds vLLM's context of 16: raise --vllm-max-model-len"):
        eng.generate(tok, [[1] * 10], 1, 8, 1.0, 1.0, False)


def test_no_full_sampler_copy_when_vllm_samples():
    """Several processes with --engine vllm: the Sampler keeps no gathered copy of the policy (the engine samples)."""
    model = common.load_model("tiny-0.6m")[0]
    assert common.Sampler(model, engine=object(), sharded=True).full is None
    assert common.Sampler(model, sharded=True).full is not None
