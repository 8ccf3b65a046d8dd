"""Step-GRPO: GRPO whose reward penalises redundant reasoning steps relative to the group's correct responses.

Paper: Chen et al., "Step-GRPO: Internalizing Dynamic Early Exit for Efficient Reasoning", arXiv:2604.16890. Reasoning
is split into semantic steps at linguistic markers; a Step-Aware Relative Reward penalises redundancy against a
group-level baseline, so that the model learns when to stop checking (the paper also exposes it to truncated concise
trajectories during exploration; see Deviations). The claim: fewer tokens than the vanilla model without the accuracy
drop of a plain length penalty (Qwen3-8B: 32.0% fewer tokens).

Equations (each implemented by the function named on the right; the abstract gives no formulas, these are ours):
  semantic steps    o_i -> (u_i1, ..., u_iS_i): o_i cut at each separator (--step-seps) and before each marker word
                    (--step-markers, case-insensitive); S_i = the number of non-empty pieces            split_steps
  group baseline    b_g = mean of S_j over the correct responses j of the prompt's group (c_j = 1)
  step-aware reward R_i = r_i - w * c_i * min((S_i - b_g) / b_g, 1),  w = --step-reward          step_aware_reward
                    (groups with no correct response keep r_i; w = 0 or equal step counts give R_i = r_i, tested)
  group advantage   A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)                       group_advantages
  clipped surrogate l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)   clipped_pg_loss
  sampler != trainer l_it <- w_it l_it,  w_it = min(pi_old / pi_sampler, C)         truncated_is_weight

Parent: algos/grpo.py; changed: Args, Args.model, Args.task, Args.digits, Args.max_new_tokens, Args.steps, Args.lr,
  Args.prompts_per_step, check_args, rollout, main.

The task (--task checksums<N>, CheckSumsTask): the long-response task sums<N> whose reference writes, after each running
total and with probability --check-prob, a redundant check step that restates it ('2+7+9:' -> '2+7=9;check 2+7=9;
9+9=18;=18'). A check never changes the answer: it is the tiny world's stand-in for a reasoning model's re-verification
("wait, let me check..."). The shipped tiny-sums model never writes one, so --warm-start-steps first fine-tunes the
policy on these references (next-token likelihood, warm_start) until it checks about as often as they do; RL then
starts from a policy that over-checks. The verifier grades the final answer and the format (checks allowed anywhere,
at least one running-total step), never the checks themselves.

Deviations from the paper (its code was not released when this was written; each rule below is ours):
- The baseline is the mean step count of the group's correct responses, the penalty is relative to it (a fraction of
  b_g, capped at 1 above) and applies to correct responses only: a wrong response's extra steps are not known to be
  redundant, and R_i >= 1 - w > 0 keeps every correct response above every wrong one (w <= 1 is enforced). Among the
  correct responses of a group the shaping sums to zero (unless the cap binds), so it moves credit from the
  over-checkers to the concise ones without changing how much the group's successes are worth. The paper's exact
  functional form is not in its abstract.
- Markers: 'check', 'wait', 'alternatively', 'verify' by default and separators ';' and a blank line; the paper's own
  marker list (for Qwen3's thinking) is not in the abstract. On the arithmetic tasks every running total is a step
  too, which the relative baseline cancels (all responses to a prompt need the same ones).
- Not implemented: the Dynamic Truncated Rollout (cutting rollouts at a step boundary and forcing an answer, so that
  the group holds concise high-confidence trajectories). algos/rollout_pruning.py cuts partial rollouts for another
  purpose; here every rollout runs to its end.
- The plain length penalty the paper compares against is grpo.py's --reward correct length:COEF (-COEF x tokens /
  max_new_tokens for every response, correct or not); no separate flag.
- --warm-start-steps is not part of the method: it makes the policy that over-checks (see above). Held-out tokens per
  response (eval/length) are counted from the greedy completions' text re-encoded without special tokens (exact for
  the character-level tiny models).
- --step-reward 0 --warm-start-steps 0 on a task grpo.py knows is grpo.py, metric for metric (tested).

Commands:
  python algos/step_grpo.py                                   # tiny-sums, checksums4, warm start then Step-GRPO
  python algos/step_grpo.py --step-reward 0                   # GRPO from the same warm-started policy
  python algos/step_grpo.py --model tiny-checksums --warm-start-steps 0   # from the shipped warm start (seconds)
  python algos/step_grpo.py --step-reward 0 --reward correct length:0.5     # the plain length penalty
  python algos/step_grpo.py --model Qwen/Qwen3-0.6B --task gsm8k --warm-start-steps 0 --device cuda \
      --max-new-tokens 1024 --prompts-per-step 32 --lr 1e-6 --step-markers Wait Alternatively Hmm  # one GPU
Expected (benchmarks/results/step_grpo.md, rows in benchmarks/results/step_grpo.csv; 3 seeds per arm, one thread,
each arm from the same policy warm-started as the default does, 30 rollout batches of 16 prompts x 8): the warm start
takes tiny-sums to 77.3% held-out greedy accuracy on checksums4 at 41.6 tokens and 5.28 steps per response (4 without
checks). Every arm drops the checks within about 10 rollout batches and ends at 24.5 tokens and 4.0 steps: Step-GRPO
78.8 +- 5.6%, GRPO 76.0 +- 4.5%, GRPO with the plain length penalty (length:0.5) 76.8 +- 2.9%. The checks are not
redundant for this policy: sampled at temperature 1 from the warm start, responses with 0, 1, 2 and 3 checks are right
48%, 50%, 42% and 33% of the time (a check can restate a total wrongly, and the next step copies it), so the verifier's
reward alone removes them and the step reward has nothing left to do at this scale. A task whose checks carry
nothing to copy would isolate the step reward.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """GRPO's flags and Step-GRPO's own: the step reward's weight, markers and separators, the check task and its warm
    start; the plumbing flags are LLMArgs' (here with the check task's defaults)."""
    model: str = "tiny-sums"
    """tiny-sums, tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task: checksums<N> (sums<N> with optional "
                                            f"redundant check steps, CheckSumsTask) or any of {llm.TASKS}")] = \
        "checksums4"
    digits: int = 1
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    max_new_tokens: int = 80
    """generation budget per completion (a checksums4 reference with a check after each step has about 61 tokens)"""
    steps: int = 30
    """rollout batches"""
    lr: float = 2e-4
    """peak learning rate (AdamW); 1e-3 collapses the tiny policy, real LLMs want about 1e-6"""
    # rollout
    prompts_per_step: int = 16
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
    # objective
    adv_std_norm: bool = True
    """divide the group-centred reward by the group std (GRPO); off = Dr. GRPO"""
    clip_eps_low: float = 0.2
    """lower clip range: ratio >= 1 - eps_low"""
    clip_eps_high: float = 0.2
    """upper clip range: ratio <= 1 + eps_high (DAPO's clip-higher uses 0.28)"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the frozen initial policy (0 = no reference model)"""
    loss_agg: Literal["seq-mean", "token-mean", "const"] = "seq-mean"
    """seq-mean (GRPO), token-mean (DAPO), const (Dr. GRPO / AsyncWebRL: divide by --agg-const per sequence)"""
    agg_const: int = 0
    """the constant k of --loss-agg const (0 = max_new_tokens)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # optimisation
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""
    # Step-GRPO
    step_reward: float = 0.5
    """weight w of the step-aware relative reward, in [0, 1]: a correct response loses w x its excess of steps over
    its group's correct responses' mean, as a fraction of that mean (0 = off: grpo.py's reward)"""
    step_markers: tuple[str, ...] = ("check", "wait", "alternatively", "verify")
    """marker words that open a new semantic step (case-insensitive, at a word start)"""
    step_seps: tuple[str, ...] = (";", "\n\n")
    """separators between semantic steps"""
    check_prob: float = 0.5
    """checksums<N> only: probability that a reference step is followed by its redundant check (warm-start data)"""
    warm_start_steps: int = 250
    """next-token-likelihood steps on the task's reference responses before RL (0 = none): on checksums<N>, teaches the
    shipped tiny-sums model to write redundant checks; not part of the method"""
    warm_start_lr: float = 1e-3
    """AdamW learning rate of the warm start"""
    warm_start_batch: int = 64
    """reference responses per warm-start step"""
    save_warm_start: str = ""
    """write the warm-started policy (model and tokenizer) to this folder before RL; how algos/models/tiny-checksums
    was made, so a run can start from it with --model tiny-checksums --warm-start-steps 0"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --steps and --max-new-tokens must be positive")
    if args.minibatches < 1 or args.ppo_epochs < 1:  # before the modulo below (llm.check_plumbing: --kl-coef)
        raise SystemExit("--minibatches and --ppo-epochs must be positive")
    batch = args.prompts_per_step * args.group_size
    if batch % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide the rollout batch "
                         f"(prompts_per_step * group_size = {batch})")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if not (0 <= args.clip_eps_low < 1 and args.clip_eps_high >= 0):
        raise SystemExit("clip ranges need 0 <= eps_low < 1 and eps_high >= 0")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (greedy decoding is used for eval only)")
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")
    if not 0 <= args.step_reward <= 1:
        raise SystemExit(f"--step-reward must be in [0, 1] (above 1 a correct response could score below a wrong one), "
                         f"got {args.step_reward}")
    if not args.step_seps and not args.step_markers:
        raise SystemExit("--step-seps and --step-markers cannot both be empty: nothing would split a response")
    if not 0 <= args.check_prob <= 1:
        raise SystemExit(f"--check-prob must be in [0, 1], got {args.check_prob}")
    if args.warm_start_steps < 0 or args.warm_start_batch < 1 or args.warm_start_lr <= 0:
        raise SystemExit("--warm-start-steps must be >= 0, --warm-start-batch >= 1 and --warm-start-lr > 0")
    if args.warm_start_steps and args.lora_rank:
        raise SystemExit("--warm-start-steps fine-tunes every weight: run it without --lora-rank")
    if args.save_warm_start and not args.warm_start_steps:
        raise SystemExit("--save-warm-start needs --warm-start-steps > 0")


# ---- the idea: semantic steps and the step-aware relative reward ----
def split_steps(text: str, seps=(";", "\n\n"), markers=("check", "wait", "alternatively", "verify")) -> list[str]:
    """The semantic steps of a response: cut at every separator and before every marker word (case-insensitive, at a
    word start), pieces stripped, empty ones dropped. '2+7=9;check 2+7=9;=9' -> ['2+7=9', 'check 2+7=9', '=9']."""
    cuts = [re.escape(s) for s in seps if s]
    if markers:
        cuts.append(r"(?=\b(?:" + "|".join(re.escape(m) for m in markers) + r")\b)")
    pieces = re.split("|".join(cuts), text, flags=re.IGNORECASE) if cuts else [text]
    return [p.strip() for p in pieces if p.strip()]


def step_aware_reward(rewards, correct, steps, group_size: int, weight: float, eps: float = 1e-6):
    """R_i = r_i - w c_i min((S_i - b_g) / b_g, 1), b_g the mean S over the correct responses of i's group (no
    correct response: R = r). rewards, correct (0/1), steps: [B] group-major -> (R [B], b_g per group [B / G])."""
    r, c, s = (x.view(-1, group_size).float() for x in (rewards, correct, steps))
    n_correct = c.sum(1, keepdim=True)
    base = (c * s).sum(1, keepdim=True) / n_correct.clamp(min=1)
    excess = ((s - base) / base.clamp(min=eps)).clamp(max=1.0)
    return (r - weight * c * excess).view(-1), base.view(-1)


class CheckSumsTask:
    """sums<N> (llm.SumsTask) whose reference writes a redundant check after each running total with probability
    check_prob: '2+7+9:' -> '2+7=9;check 2+7=9;9+9=18;=18'. Held out as sums<N> (a hash of the operands). Reward: 1
    for the exact final answer in the format (checks allowed anywhere, never graded); components 'format',
    'correct' and 'checks' (the number of check steps)."""

    MARKER = "check "

    def __init__(self, operands: int, digits: int, check_prob: float):
        self.sums = llm.SumsTask(operands, digits)
        self.kind, self.operands, self.digits, self.check_prob = "sums", operands, digits, check_prob
        self.name = f"checksums{operands}d{digits}"

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[llm.Example]:
        out = []
        for e in self.sums.sample(split, n, rng):
            *steps, final = e.solution.split(";")
            body = [x for s in steps for x in ([s, self.MARKER + s] if rng.random() < self.check_prob else [s])]
            out.append(llm.Example(e.prompt, e.answer, ";".join(body + [final])))
        return out

    parse = staticmethod(llm.ArithmeticTask.parse)

    def verify(self, response: str, answer: str) -> tuple[float, dict]:
        r = response.strip()
        fmt = re.fullmatch(r"((check )?\d+\+\d+=\d+;)+=\d+", r) is not None and re.match(r"(.*;)?\d", r) is not None
        correct = fmt and r.rsplit("=", 1)[-1] == answer
        return float(correct), {"format": float(fmt), "correct": float(correct), "checks": float(r.count("check"))}


def make_check_task(name: str, digits: int, check_prob: float) -> CheckSumsTask | None:
    """The task for --task checksums<N> (N operands, 2..16); None for any other name (llm.make_task's)."""
    m = re.fullmatch(r"checksums(\d+)", name)
    return CheckSumsTask(int(m.group(1)), digits, check_prob) if m else None


# ---- GRPO's advantage, clipped surrogate, KL, aggregation ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def clipped_pg_loss(logp, old_logp, adv, eps_low: float, eps_high: float):
    """Per-token PPO-clip loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); logp [B, C], adv [B].

    Returns (loss [B, C], clipped [B, C] as float: where the clipped branch was the active one).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(1)
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def aggregate_loss(token_loss, mask, mode: str, n_seqs: int, n_tokens: int, const: int):
    """This micro-batch's share of the step loss; summing the shares over micro-batches gives J.

    token_loss, mask: [b, C]; n_seqs, n_tokens: counted over the whole optimiser step (all ranks).
    """
    per_seq_sum = (token_loss * mask).sum(1)
    if mode == "seq-mean":
        return (per_seq_sum / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if mode == "token-mean":
        return per_seq_sum.sum() / max(n_tokens, 1)
    if mode == "const":
        return per_seq_sum.sum() / (n_seqs * const)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def agg_const(args: Args) -> int:
    """The constant k of --loss-agg const (default: the generation budget, as Dr. GRPO)."""
    return args.agg_const or args.max_new_tokens


def grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: clipped surrogate + kl_coef * k3 KL, aggregated over the step.

    logp [b, C] (with grad); mb holds old, ref (or None), adv [b], mask [b, C]. Returns (loss, per-token stats).
    """
    tok_loss, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    stats = {"clipfrac": clipped}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


def truncated_is_weight(old_logp, sampler_logp, cap: float):
    """w_t = min(pi_old(o_t) / pi_sampler(o_t), C): corrects the update for samples drawn by another computation
    than the trainer's (truncated importance sampling, as verl's rollout correction); no gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


def kernel_grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss from the fused Triton kernel (--kernels on a GPU): the same value and gradient.

    The kernel normalises inside the micro-batch (token or sequence mean); rescaling by this micro-batch's
    share of the step's sequences or tokens gives aggregate_loss's step-level normaliser.
    """
    from kernels.clipped_pg_loss import clipped_pg_loss as fused

    if mb.get("is_weight") is not None:  # the kernel has no per-token weight: the reference path takes it
        return grpo_loss(logp, mb, n_seqs, n_tokens, args)
    mask = mb["mask"]
    loss, kst = fused(logp, mb["old"], mb["adv"], mask, args.clip_eps_low, args.clip_eps_high, ref_logp=mb["ref"],
                      beta=args.kl_coef, reduction="seq_mean" if args.loss_agg == "seq-mean" else "token_mean")
    mb_tokens = float(mask.sum())
    scale = {"seq-mean": mask.shape[0] / n_seqs, "token-mean": mb_tokens / max(n_tokens, 1),
             "const": mb_tokens / (n_seqs * agg_const(args))}[args.loss_agg]
    return loss * scale, {"clipfrac": torch.full_like(mask, float(kst["clip_frac"]))}  # micro-batch mean


# ---- warm start (not the method: makes the policy that over-checks) ----
def warm_start(model, tok, task, args: Args, device) -> float:
    """--warm-start-steps AdamW steps of token-mean next-token likelihood on the task's reference responses (+ EOS),
    training split, drawn with a generator seeded by --seed. Returns the last step's loss."""
    rng, loss = np.random.default_rng([args.seed, 10**6]), torch.zeros(())
    opt = torch.optim.AdamW(model.parameters(), lr=args.warm_start_lr)
    for _ in range(args.warm_start_steps):
        examples = task.sample("train", args.warm_start_batch, rng)
        prompt_ids, prompt_mask = common.left_pad(common.encode_prompts(tok, [e.prompt for e in examples]),
                                                  tok.pad_token_id)
        targets = [tok(e.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for e in examples]
        width = max(len(t) for t in targets)
        ids = torch.tensor([t + [tok.pad_token_id] * (width - len(t)) for t in targets])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in targets])
        logp = common.token_logprobs(model, prompt_ids.to(device), prompt_mask.to(device), ids.to(device),
                                     mask.to(device))
        loss = -logp.sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss)


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them; with --step-reward > 0 shape
    the rewards by each response's semantic steps against its group's correct responses (step_aware_reward); A_i per
    group. The batch also carries each response's step count and correctness."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    per_row = lambda xs: [x for x in xs for _ in range(args.group_size)]  # noqa: E731
    total, terms = llm.Rewards(args.reward)(per_row([e.prompt for e in examples]), ro.texts,
                                            per_row([e.answer for e in examples]), task=task,
                                            completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    rewards = torch.tensor(total, device=device)
    steps = torch.tensor([len(split_steps(t, args.step_seps, args.step_markers)) for t in ro.texts], device=device)
    correct = torch.tensor([float(task.verify(t, a)[0] >= 1) for t, a in
                            zip(ro.texts, per_row([e.answer for e in examples]))], device=device)
    shaping = {}
    if args.step_reward > 0:
        shaped, base = step_aware_reward(rewards, correct, steps, args.group_size, args.step_reward)
        shaping = {"reward/step_shaping": float((shaped - rewards).abs().mean()),
                   "rollout/step_baseline": float(base[base > 0].mean()) if (base > 0).any() else 0.0}
        rewards = shaped
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=ro.finish_reasons, steps=steps, correct=correct, reward_terms={
                     **{f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0]))
                        for k, vs in terms.items()}, "rollout/steps": float(steps.float().mean()), **shaping})
    return batch


def sampler_gap(old_logp, sampler_logp, is_weight, mask, cap: float) -> dict:
    """This micro-batch's sums for rollout/logprob_mismatch (|log pi_old - log pi_sampler| per token, on the sampler's
    weights) and, when the correction is on, the mean importance weight and the fraction truncated at C."""
    out = {"gap/sum": common.masked_sum((old_logp - sampler_logp).abs(), mask).item(), "gap/tokens": mask.sum().item()}
    if is_weight is not None:
        out.update({"gap/is_w": common.masked_sum(is_weight, mask).item(),
                    "gap/is_cut": common.masked_sum((is_weight >= cap).float(), mask).item()})
    return out


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           fused_logprob=None) -> dict:
    """ppo_epochs x minibatches optimiser steps on one rollout batch (micro-batches accumulate gradients).

    pi_old (and pi_ref) are scored before any update; the loss of each micro-batch is normalised by counts
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged. The logged
    statistics are sums over all ranks divided by global counts: every rank returns the same values.
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx], mask[idx],
        args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], batch["logprobs"][idx], mb["is_weight"], mb["mask"],
                                            args.sampler_is_cap).items():
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    out = {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith("gap/")},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap/is_w"] / max(tot["gap/tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap/is_cut"] / max(tot["gap/tokens"], 1)})
    return out


# ---- eval ----
def evaluate_steps(sampler, tok, task, sets: dict, args: Args, hard_task=None) -> dict:
    """common.run_eval's metrics (greedy eval/acc, eval/pass@k, eval/acc_hard, eval/samples) plus the greedy held-out
    responses' mean tokens (eval/length: the text re-encoded without special tokens) and semantic steps (eval/steps)."""
    res = common.evaluate(sampler, tok, task, sets["main"], args.max_new_tokens, n_samples=len(sets["main"]))
    texts = [s["completion"] for s in res["samples"]]
    out = {"eval/acc": res["acc"], "eval/samples": res["samples"][:common.SAMPLES_LOGGED],
           "eval/length": float(np.mean([len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts])),
           "eval/steps": float(np.mean([len(split_steps(t, args.step_seps, args.step_markers)) for t in texts]))}
    if args.pass_k:
        out[f"eval/pass@{args.pass_k}"] = common.evaluate(sampler, tok, task, sets["main"][:100], args.max_new_tokens,
                                                          pass_k=args.pass_k, temperature=args.temperature)[
            f"pass@{args.pass_k}"]
    if hard_task is not None and "hard" in sets:
        out["eval/acc_hard"] = common.evaluate(sampler, tok, hard_task, sets["hard"], args.max_new_tokens + 2)["acc"]
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    check_task = make_check_task(args.task, args.digits, args.check_prob)
    run = llm.Run(args, tasks=check_task is None)  # accelerator, threads, seed, the task and its held-out sets
    if check_task is not None:  # checksums<N>: the same held-out prompts as sums<N>, one digit harder for acc_hard
        run.task, run.hard_task = check_task, CheckSumsTask(check_task.operands, args.digits + 1, args.check_prob) \
            if args.eval_hard else None
        run.eval_sets = common.held_out_sets(run.task, args.eval_examples, run.hard_task)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    if args.save_warm_start and run.accel.num_processes > 1:  # a sharded model would save its own shard only
        raise SystemExit("--save-warm-start runs in one process")
    if args.warm_start_steps and not args.resume:  # the policy that over-checks (a resumed run has its weights)
        warm_loss = warm_start(model, tok, run.task, args, run.accel.device)
        if args.save_warm_start:
            model.save_pretrained(args.save_warm_start)
            tok.save_pretrained(args.save_warm_start)
        sampler.refresh()
        if ref_model is not None:  # the KL reference is the warm-started policy
            ref_model.load_state_dict(model.state_dict())
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler, evaluate=lambda: evaluate_steps(sampler, tok, run.task, run.eval_sets, args,
                                                                        run.hard_task))
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):  # rollouts, rewards, steps and the step-aware shaping
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
    hist = [h for h in run.history if "rollout/steps" in h]
    return run.finish("Step-GRPO" if args.step_reward > 0 else "GRPO", {
        "train_steps_first": hist[0]["rollout/steps"] if hist else float("nan"),
        "train_steps_last": hist[-1]["rollout/steps"] if hist else float("nan"),
        "warm_start_loss": warm_loss if args.warm_start_steps and not args.resume else float("nan")})


if __name__ == "__main__":
    main(tyro.cli(Args))
