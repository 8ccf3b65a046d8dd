"""The vLLM rollout engine of the LLM scripts (`--engine vllm`): one engine per trainer process, on its GPU.

It has the same seam as common.generate (token-id prompts in, a common.Rollout out, behaviour log-probs of the
distribution sampled from) plus `sync_weights(model)`, which a script calls after every optimiser step.
The recipe is TRL's colocate mode (trl/generation/vllm_generation.py, TRL 1.16, vLLM 0.22-0.31; we pin 0.31.0).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402


class VLLMEngine:
    """vLLM rollouts inside the trainer's process (`--engine vllm`, one GPU per process), as TRL's colocate mode.

    Unverified here: no test machine has vLLM; CI checks the seam against a fake engine (tests/test_vllm_seam.py).
    The engine runs in-process (distributed_executor_backend='external_launcher'), so weights go straight into
    the worker's model with its own load_weights after every optimiser step; log-probs are vLLM's
    'processed_logprobs' (after temperature / top-p: the distribution actually sampled from).
    """

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.3, max_model_len: int = 2048,
                 seed: int = 0, sleep: bool = False):
        try:
            from vllm import LLM  # lazy: GPU-only dependency
        except ImportError:
            raise SystemExit("--engine vllm needs vLLM on a CUDA machine: pip install -r requirements-gpu.txt")
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"),
                     ("MASTER_PORT", str(29500 + seed % 1000))):  # the external launcher reads torch's env vars
            os.environ.setdefault(k, v)
        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       seed=seed, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
                       **({"enable_sleep_mode": True} if sleep else {}))
        self.max_model_len, self.sleep, self.asleep = max_model_len, sleep, set()  # asleep: the parts now freed
        try:  # the model's own EOS ids (chat models often have several): the trainer's mask ends on the same set
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            self.generation_config = None

    def wake(self, *tags: str) -> None:
        """Give back what sleep freed (vLLM's wake_up): "weights" before a weight sync, both before sampling."""
        tags = [t for t in tags if t in self.asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def generate(self, tok, prompts, group_size, max_new_tokens, temperature, top_p, greedy) -> common.Rollout:
        """Sample (see common.generate); with sleep mode the engine wakes first and sleeps again after (level 1: weights
        to host memory, KV cache dropped), so the trainer's forward and backward have the GPU memory."""
        from vllm import SamplingParams

        if max(map(len, prompts)) + max_new_tokens > self.max_model_len:
            raise SystemExit(f"a prompt of {max(map(len, prompts))} tokens + {max_new_tokens} new tokens exceeds "
                             f"vLLM's context of {self.max_model_len}: raise --vllm-max-model-len or lower --max-new-tokens")
        self.wake("weights", "kv_cache")
        sp = SamplingParams(n=group_size, max_tokens=max_new_tokens, logprobs=0, stop_token_ids=common.eos_ids(tok, self),
                            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if self.sleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
        comps = [list(c.token_ids) for o in outs for c in o.outputs]
        lps = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for o in outs for c in o.outputs]
        finish = ["stop" if c.finish_reason == "stop" else "length" for o in outs for c in o.outputs]
        width = max(1, max(len(c) for c in comps))
        comp = torch.full((len(comps), width), tok.pad_token_id, dtype=torch.long)
        lp, cmask = torch.zeros(len(comps), width), torch.zeros(len(comps), width, dtype=torch.long)
        for i, (c, l) in enumerate(zip(comps, lps)):
            comp[i, :len(c)], lp[i, :len(c)], cmask[i, :len(c)] = torch.tensor(c), torch.tensor(l), 1
        ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
        return common.Rollout(ids, mask, comp, cmask, lp, finish, tok.batch_decode(comp, skip_special_tokens=True))

    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into vLLM's model (call after each optimiser step), streamed: load_weights
        pulls one parameter at a time from a generator, cast to the engine's dtype (bf16 for a bf16 checkpoint) before
        a sharded one is gathered (every rank calls this), so at most one full parameter, in bf16, exists at once."""
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        own = next(runner_model.parameters()).dtype if hasattr(runner_model, "parameters") else None
        cast = lambda p: p.detach().to(own) if own is not None else p.detach()  # noqa: E731
        self.wake("weights")
        runner_model.load_weights(weights=((n, cast(p).full_tensor() if hasattr(p, "full_tensor") else cast(p))
                                           for n, p in model.named_parameters()))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
