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
                 seed: int = 0):
        try:
            from vllm import LLM  # lazy: GPU-only dependency
        except ImportError:
            raise SystemExit("--engine vllm needs vLLM on a CUDA machine: pip install -r requirements-gpu.txt")
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"),
                     ("MASTER_PORT", str(29500 + seed % 1000))):  # the external launcher reads torch's env vars
            os.environ.setdefault(k, v)
        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       seed=seed, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       distributed_executor_backend="external_launcher", max_num_batched_tokens=4096)
        try:  # the model's own EOS ids (chat models often have several): the trainer's mask ends on the same set
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            self.generation_config = None

    def generate(self, tok, prompts, group_size, max_new_tokens, temperature, top_p, greedy) -> common.Rollout:
        from vllm import SamplingParams

        sp = SamplingParams(n=group_size, max_tokens=max_new_tokens, logprobs=0, stop_token_ids=common.eos_ids(tok, self),
                            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
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
        """Load the trainer's current weights into vLLM's model (call after each optimiser step)."""
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        # a sharded model gathers each parameter in turn (every rank calls this after each optimiser step)
        runner_model.load_weights(weights=[(n, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach())
                                           for n, p in model.named_parameters()])
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
