"""Speculative sampling: a cheap drafter proposes gamma tokens, the target verifies them in one forward pass.

Parent: none. The sampler, its drafters and KV cache are algos/_speculative.py, shared with algos/spec_rl.py;
this script runs them on a task and measures acceptance, calls and speed.
Papers: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192;
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling", arXiv:2302.01318.
The baseline of the speculative-rollout papers: "Accelerating RL Post-Training Rollouts via System-Integrated
Speculative Decoding", arXiv:2604.26779 (speculative decoding inside RL rollouts); "SPEC-RL: Accelerating
On-Policy Reinforcement Learning via Speculative Rollouts", arXiv:2509.23232; "EfficientRollout: System-Aware
Self-Speculative Decoding for RL Rollouts", arXiv:2606.18967 (acceptance-aware draft length); "Seer: Online
Context Learning for Fast Synchronous LLM Reinforcement Learning", arXiv:2511.14617 (drafts from sibling
responses).

Equations (each implemented by the function of algos/_speculative.py named on the right):
  processed distributions  p = topp(softmax(z_target / T)), q = topp(softmax(z_draft / T))      process_logits
                           (greedy: p and q are one-hot on the argmax, which makes the rule below exact greedy)
  accept draft x_j         u_j < min(1, p_j(x_j) / q_j(x_j))                                       accept_prob
  first rejection at j     emit y ~ norm(max(0, p_j - q_j)) and stop the round                      verify
  all gamma accepted       emit a bonus y ~ p_gamma                                                 verify
  Every emitted token is then distributed exactly as the target's p. tests/test_spec_decode.py checks one- and
  two-token distributions and, by a chi-square test, whole 5-token sequences with 3- and 4-token drafts
  (accepted chains, a target whose distribution depends on the whole context, rows of different draft
  lengths, EOS), and that the wrong rule min(1, q/p) fails the same check.
  expected acceptance      alpha = E_x[ sum_v min(p(v), q(v)) ]  (per tested position)
                                                                          expected_acceptance, spec_generate
  tokens per target call   E[n] = (1 - alpha^(gamma+1)) / (1 - alpha)                          tokens_per_call_theory
  speedup with cost c      S = E[n] / (gamma c + 1),  c = cost(draft call) / cost(target call)    speedup_theory
  acceptance-aware gamma   gamma* = argmax_gamma S(alpha_hat, gamma, c)  (EfficientRollout)        best_gamma

Drafters (all give the same output distribution; they differ in acceptance and cost):
  model   a smaller model with the same tokenizer (tiny-0.6m for the tiny-5m target), q = its processed probs
          (ModelDrafter)
  ngram   a suffix / n-gram drafter over text already generated: the prompt and the sibling responses of the
          same group (Seer); deterministic, so q is one-hot and a draft x is accepted with probability p(x).
          With --waves 2 the first rows of each group are generated first and the rest draft from them
          (Seer's staggered "divided rollout"; in lock-step nothing is ever ahead to copy from) (NgramDrafter).
  none    plain autoregressive sampling through the same loop (gamma = 0), the reference for call counts.

Deviations:
- KV cache with rollback by masking (CachedLM, described in algos/_speculative.py): the target, and the draft
  model, each keep one HF KV cache over all rows; a round's target forward covers at most gamma + 1 new
  positions per row after the prompt. Rejected drafts are never recomputed and never removed: their cache
  columns are masked out, so they become holes. The cache is never compacted: fine for short rollouts; a
  serving engine (vLLM's paged cache) frees those slots.
- Batched in lock-step: all live rows of a batch do one round together, so the batch needs as many target
  calls as its slowest row. We report both the batched calls and the per-sequence forwards (what a
  continuous-batching engine such as vLLM would save).
- The drafted positions use one-hot q for deterministic drafters; a real vocabulary would keep q sparse.
- kernels/spec_rejection.py implements the same rule for fixed-length drafts (Triton); `verify` mirrors its
  reference draw for draw and adds per-row draft lengths (tests compare them); on CPU the torch path runs.

Commands:
  python algos/spec_decode.py                                   # tiny-5m target, tiny-0.6m draft, addsteps
  python algos/spec_decode.py --drafter ngram --waves 2 --gamma 6
  python algos/spec_decode.py --drafter model --adaptive-gamma --temperature 0.7 --top-p 0.9
  python algos/spec_decode.py --model Qwen/Qwen2.5-1.5B-Instruct --draft-model Qwen/Qwen2.5-0.5B-Instruct \
      --task gsm8k --device cuda --max-new-tokens 256 --prompts 64              # one GPU
Expected: greedy output identical to the target's; with the tiny-0.6m draft on addsteps acceptance is high
and tokens per target call follow (1 - alpha^(gamma+1)) / (1 - alpha); see benchmarks/results/spec_rollout.md.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._speculative import ModelDrafter, NgramDrafter, spec_generate, to_rollout, tokens_per_call_theory


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "spec_decode"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed"""
    out_dir: str = "runs"
    """where summary.json goes"""
    # models and task
    model: str = "tiny-5m"
    """the target: tiny-5m, tiny-0.6m, a Hugging Face id or a local path"""
    draft_model: str = "tiny-0.6m"
    """the draft model of --drafter model (same tokenizer as the target)"""
    task: str = "addsteps"
    """add, addsteps, jsonl:PATH or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    # sampling
    prompts: int = 32
    """distinct prompts"""
    group_size: int = 8
    """samples per prompt (rows of one prompt are siblings for the n-gram drafter)"""
    max_new_tokens: int = 24
    """generation budget per sequence"""
    temperature: float = 1.0
    """sampling temperature (applied to target and draft alike)"""
    top_p: float = 1.0
    """nucleus threshold (applied to target and draft alike)"""
    greedy: bool = False
    """greedy decoding (the output must equal the target's own greedy output)"""
    # speculation
    drafter: Literal["model", "ngram", "none"] = "model"
    """where drafts come from (none = plain sampling through the same loop)"""
    gamma: int = 4
    """draft tokens per round (the maximum when --adaptive-gamma)"""
    adaptive_gamma: bool = False
    """pick gamma each round to maximise the expected speedup at the running acceptance estimate (EfficientRollout)"""
    draft_cost: float = -1.0
    """c = draft call cost / target call cost for --adaptive-gamma (-1 = measure it as we go)"""
    ngram_max: int = 4
    """longest suffix the n-gram drafter matches"""
    waves: int = 1
    """generate each group in this many waves, later waves drafting from earlier ones (n-gram drafter)"""
    compare_plain: bool = True
    """also time HF generate on the same prompts and report the speedup"""


def check_args(args: Args) -> None:
    if args.gamma < 0 or args.prompts < 1 or args.group_size < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise SystemExit("--gamma must be >= 0 and --prompts, --group-size, --max-new-tokens, --threads positive")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (use --greedy for greedy decoding)")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 1 <= args.waves <= args.group_size:
        raise SystemExit(f"--waves must be in 1..group_size ({args.group_size}), got {args.waves}")
    if args.ngram_max < 1:
        raise SystemExit("--ngram-max must be at least 1")


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device(args.device)
    task = llm.make_task(args.task, args.digits)
    target, tok = common.load_model(args.model, device, args.dtype)
    target.eval()
    drafter = None
    if args.drafter == "model":
        draft, dtok = common.load_model(args.draft_model, device, args.dtype)
        if dtok.get_vocab() != tok.get_vocab():
            raise SystemExit(f"--draft-model {args.draft_model} has a different tokenizer from --model {args.model}")
        drafter = ModelDrafter(draft.eval(), tok.pad_token_id, args.temperature, args.top_p, args.greedy)
    elif args.drafter == "ngram":
        drafter = NgramDrafter(args.group_size, target.config.vocab_size, args.ngram_max)
    examples = task.sample("test", args.prompts, np.random.default_rng(args.seed))
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])

    t0 = time.perf_counter()
    comp, lps, st, _ = spec_generate(target, prompts, args.group_size, args.max_new_tokens, tok.pad_token_id,
                                  tok.eos_token_id, drafter, args.gamma, args.temperature, args.top_p, args.greedy,
                                  args.adaptive_gamma, args.draft_cost, args.waves)
    spec_s = time.perf_counter() - t0
    ro = to_rollout(tok, prompts, args.group_size, comp, lps, tok.eos_token_id)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    acc = float(np.mean([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)]))
    summary = {"spec_s": spec_s, "spec_acc": acc, **st.summary(),
               "tokens_per_call_theory": tokens_per_call_theory(st.summary()["alpha"], args.gamma)}
    if args.compare_plain:
        t0 = time.perf_counter()
        plain = common.generate(target, tok, prompts, args.group_size, args.max_new_tokens, args.temperature,
                                args.top_p, greedy=args.greedy)
        summary["plain_s"] = time.perf_counter() - t0
        summary["plain_calls"] = plain.completion_ids.shape[1]  # HF generate: one cached forward per step
        summary["plain_row_calls"] = int(plain.completion_mask.sum())
        summary["plain_acc"] = float(np.mean([task.verify(t, a)[0] for t, a in zip(plain.texts, answers)]))
        summary["speedup_wall"] = summary["plain_s"] / spec_s
        summary["call_reduction"] = summary["plain_calls"] / max(st.target_calls, 1)
        if args.greedy:
            summary["greedy_identical"] = float(plain.texts == ro.texts)
    out = Path(args.out_dir) / args.exp_name
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
