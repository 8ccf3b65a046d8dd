"""OTR: one-token rollouts, supervised fine-tuning guided by the policy gradient.

Paper: Ming et al., "One-Token Rollout: Guiding Supervised Fine-Tuning of LLMs with Policy Gradient",
arXiv:2509.26313.

Each position of a supervised target is a one-step RL episode: given the prompt and the ground-truth prefix, K
candidate next tokens are sampled from the current policy, a candidate is rewarded when it equals the ground-truth
token, and a policy-gradient step with the candidates' own group baseline follows. The static supervised data becomes
an on-policy signal at the token level, with no sequence generation: the decoder runs once per batch, and the
candidates are drawn from the same forward's next-token distribution.

Equations (each implemented by the function named on the right), per response position t of target y after prompt x:
  candidates   c_t,k ~ pi_theta(. | x, y_<t) at temperature T, k = 1..K (inverse CDF on uniforms u)   sample_candidates
  reward       r_t,k = 1[c_t,k = y_t]                                                     candidate_advantages
  advantage    A_t,k = r_t,k - 1/K sum_j r_t,j   (--adv-std-norm: / (std_k r_t + eps))     candidate_advantages
  loss         J = -1/sum_i |y_i|  sum_i sum_t 1/K sum_k A_t,k log pi_theta(c_t,k | x, y_<t)          otr_loss
  in expectation over the candidates (no std normalisation), per position:
               E[grad J_t] = (1 - 1/K) pi_theta(y_t) * grad(-log pi_theta(y_t))
               (the SFT gradient, weighted by the probability the policy already gives the target)
  SFT control  L = -1/sum_i |y_i|  sum_i sum_t log pi_theta(y_t | x, y_<t)   (--objective sft)      sft_loss
  accumulation each micro-batch's token mean is weighted by its share of the step's target tokens (all ranks)  update

Parent: none. The file is the SFT loop of algos/sft.py rewritten on the LLM scripts' plumbing (LLMArgs, the Sampler
for evaluation, the optimiser step, checkpoints), with the one-token rollout as a second objective beside SFT's.
Borrows: algos/sft.py (build_batch, decoder_forward, sft_loss)

Why `Args(LLMArgs)` (algos/sft.py keeps its own Args): the claim is measured against SFT on the held-out sets every
RL script uses, in distribution and one digit harder (--eval-hard), with the same optimiser, schedule, checkpoints and
several-process support as the RL scripts; LLMArgs brings all of it, and the SFT control runs in this file
(--objective sft) so the two arms differ in the objective only. Inherited flags that cannot apply are refused:
--engine vllm (the candidates are drawn inside the trainer's forward; an engine would only serve evaluation) and
--top-p below 1 (the candidates come from the full distribution at --temperature).

Deviations from the paper (the abstract fixes none of these):
- Reward 1 for the ground-truth token and 0 otherwise; the baseline is the mean reward of the K candidates at the
  same position (a group baseline, as GRPO's over completions), with no division by the std unless
  --adv-std-norm. Read from the abstract alone; the paper's full objective may shape the wrong candidates' signal
  differently.
- K = 8 candidates per position, drawn with replacement at --temperature 1 (the distribution the policy would
  sample from), by the inverse CDF on uniforms drawn before the forward, so that the chunk recomputed in the
  backward draws the same candidates.
- The loss is a token mean over the step's target tokens (as algos/sft.py's), the same for both objectives. No
  clipping and no ratio: the candidates come from the weights being updated (one optimiser step per batch), so the
  update is on-policy by construction; there is no sampler correction to apply.
- Data: a fresh batch of --batch-size training examples every step (Example.solution as the target, EOS appended),
  as algos/sft.py; "equal training tokens" between the arms means the same batches and steps.
- Positions whose target is masked (the prompt, padding) take no candidates: only target positions go through the
  lm_head, chunk by chunk (no [B, T, V] logits).
- Several processes (torchrun) follow the RL scripts' recipe (FSDP2, step-global token counts, per-rank data and
  uniforms), unverified here: the tests run one process.

Commands:
  python algos/otr.py                                  # tiny-0.6m on 2-digit addition, 2-core CPU, about 1 minute
  python algos/otr.py --objective sft                  # the SFT control: same batches, steps and optimiser
  python algos/otr.py --candidates 2 --adv-std-norm    # fewer candidates, GRPO's std normalisation
  python algos/otr.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda --max-new-tokens 512 \
      --batch-size 32 --micro-batch-size 8 --lr 1e-6 --pass-k 0                   # one GPU
  torchrun --nproc_per_node 8 algos/otr.py --model ... --task gsm8k --device cuda   # several GPUs (unverified)
Expected: the default raises tiny-0.6m's held-out greedy accuracy on 2-digit addition from 38.8% to 68.7 ± 0.6% in
300 steps (3 seeds, one thread, 64 ± 29 s each on the busy shared 2-core machine of the table); the SFT control on
the same batches reaches 77.0 ± 1.1%. Trained on 1-digit addition, both keep little of the 2-digit skill the shipped
model had (40.3%): OTR 10.3 ± 1.2%, SFT 9.1 ± 0.7%. benchmarks/results/otr.md (rows in benchmarks/results/otr.csv,
`python benchmarks/otr_table.py`).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from tqdm import tqdm

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """OTR's own flags and the defaults it changes; the plumbing flags (run, model, task, optimiser, eval) are
    LLMArgs'."""
    # objective
    objective: Literal["otr", "sft"] = "otr"
    """otr: one-token rollouts with a group baseline; sft: the supervised control on the same batches"""
    candidates: int = 8
    """K: candidate next tokens sampled per target position"""
    adv_std_norm: bool = False
    """divide the candidates' centred rewards by their std (GRPO's normalisation); off = the mean baseline only"""
    # data and optimisation
    batch_size: int = 64
    """supervised examples per optimiser step (per process)"""
    steps: int = 300
    """optimiser steps (one supervised batch each)"""
    eval_every: int = 50
    """optimiser steps between held-out evaluations"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    llm.check_plumbing(args)  # the plumbing flags (llm.Run checks them in the scripts that use it)
    if args.candidates < 2:
        raise SystemExit(f"--candidates must be at least 2 for a group baseline, got {args.candidates}")
    if args.batch_size < 1 or args.steps < 1 or args.micro_batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--batch-size, --steps, --micro-batch-size and --max-new-tokens must be positive")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (the candidates are sampled at it)")
    if args.top_p < 1.0:
        raise SystemExit("--top-p must be 1: the candidates are drawn from the full distribution at --temperature")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: OTR samples its candidates inside the trainer's forward and generates no "
                         "training sequences; use --engine hf")


# ---- the idea: one-token rollouts ----
def sample_candidates(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """K candidates per row from the categorical distribution exp(logp) [n, V], by the inverse CDF on uniforms u [n, K]
    in [0, 1): candidate v is drawn with probability p_v (a zero-probability token never). Returns ids [n, K]."""
    cdf = logp.detach().exp().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True)
    return idx.clamp(max=logp.shape[-1] - 1)


def candidate_advantages(cands: torch.Tensor, targets: torch.Tensor, std_norm: bool = False, eps: float = 1e-6):
    """r_k = 1[c_k = y] and A_k = r_k - mean_k r (/ (std_k r + eps) with std_norm); cands [n, K], targets [n].
    Returns (advantages [n, K], rewards [n, K])."""
    r = (cands == targets[:, None]).float()
    adv = r - r.mean(-1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv, r


def otr_loss(model, h: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor, u: torch.Tensor,
             temperature: float = 1.0, std_norm: bool = False):
    """Token mean of -1/K sum_k A_k log pi(c_k) over the target positions, from the decoder's last hidden states
    h [B, T, H] (position t predicts ids[:, t + 1]); u [n, K] uniforms, one row per target position in row-major
    order (n = loss_mask[:, 1:].sum()). Only target positions reach the lm_head, chunk by chunk (each chunk recomputed
    in the backward, drawing the same candidates from u), so no [B, T, V] logits exist.
    Returns (loss, stats): sums over the target positions of the candidates' mean reward ('hit'), of positions whose
    K rewards are all equal ('zero_var', no gradient), and of -log pi(y_t) at temperature 1 ('nll', SFT's loss), all
    without gradient."""
    head, H = model.get_output_embeddings(), h.shape[-1]
    sel = loss_mask[:, 1:].reshape(-1) > 0
    h, targets = h[:, :-1].reshape(-1, H)[sel], ids[:, 1:].reshape(-1)[sel]
    if u.shape[0] != targets.shape[0]:
        raise ValueError(f"u has {u.shape[0]} rows for {targets.shape[0]} target positions")

    def chunk(hc, tc, uc):
        with common.autocast(model):
            logits = head(hc)
        logp = torch.log_softmax(logits.float() / temperature, -1)
        cands = sample_candidates(logp, uc)
        adv, r = candidate_advantages(cands, tc, std_norm)
        loss = -(adv * logp.gather(-1, cands)).mean(-1).sum()
        plain = logp.detach() if temperature == 1.0 else torch.log_softmax(logits.detach().float(), -1)
        nll = -plain.gather(-1, tc[:, None]).sum()  # at temperature 1, as SFT's loss
        return loss, r.mean(-1).sum(), (r.std(-1) == 0).float().sum() if r.shape[1] > 1 else r.new_zeros(()), nll

    step = common.chunk_positions(head.weight.shape[0])
    grad = torch.is_grad_enabled() and h.requires_grad
    parts = [torch.utils.checkpoint.checkpoint(chunk, h[s:s + step], targets[s:s + step], u[s:s + step],
                                               use_reentrant=False) if grad else
             chunk(h[s:s + step], targets[s:s + step], u[s:s + step]) for s in range(0, len(targets), step)]
    n = max(len(targets), 1)
    loss = sum(p[0] for p in parts) / n if parts else h.sum() * 0.0
    stats = {k: float(sum(p[i].detach() for p in parts)) if parts else 0.0
             for i, k in ((1, "hit"), (2, "zero_var"), (3, "nll"))}
    return loss, stats


# ---- borrowed from algos/sft.py: the batch and the SFT loss ----
def build_batch(tok, examples: list[llm.Example]):
    """Right-padded [B, T] ids with a loss mask that is 1 only on response tokens (and the final EOS)."""
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    responses = [tok(e.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for e in examples]
    weights = [[1] * len(r) for r in responses]
    for i, e in enumerate(examples):
        if getattr(e, "turns", None):  # multi-turn trace: each action + EOS trained on, each observation masked
            enc = lambda s: tok(s, add_special_tokens=False)["input_ids"] if s else []  # noqa: E731
            parts = [(enc(a) + [tok.eos_token_id], enc(o)) for a, o in e.turns]
            responses[i] = [t for a, o in parts for t in a + o]
            weights[i] = [w for a, o in parts for w in [1] * len(a) + [0] * len(o)]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((len(examples), width), tok.pad_token_id, dtype=torch.long)
    attn, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        loss_mask[i, len(p):len(p) + len(r)] = torch.tensor(weights[i])
    return ids, attn, loss_mask


def decoder_forward(model, ids: torch.Tensor, attn: torch.Tensor):
    """The decoder's last hidden states [B, T, H] and, for a mixture of experts, its load-balancing loss (else None),
    without the [B, T, V] logits: the model's own forward keeps one logit (logits_to_keep=1) and a hook reads the
    decoder's output. Under the model's autocast (bf16 matmuls under --dtype bf16)."""
    out = {}
    hook = model.get_decoder().register_forward_hook(lambda m, a, o: out.__setitem__("h", o.last_hidden_state))
    moe = {"output_router_logits": True} if hasattr(model.config, "router_aux_loss_coef") else {}
    try:
        with common.autocast(model):
            res = model(input_ids=ids, attention_mask=attn, logits_to_keep=1, **moe)
    finally:
        hook.remove()
    return out["h"], getattr(res, "aux_loss", None)


def sft_loss(model, h: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of the response tokens from the decoder's last hidden states h [B, T, H]
    (position t predicts ids[:, t + 1]). The lm_head and the fp32 log-softmax run chunk by chunk over positions
    (about common.LOGPROB_CHUNK_MB MiB of logits each), each chunk recomputed in the backward (activation
    checkpointing), so the [B, T, V] logits never exist."""
    head, H = model.get_output_embeddings(), h.shape[-1]
    h, targets, mask = h[:, :-1].reshape(-1, H), ids[:, 1:].reshape(-1), loss_mask[:, 1:].reshape(-1).float()

    def chunk_nll(hc, tc, mc):
        with common.autocast(model):
            logits = head(hc)
        return (torch.log_softmax(logits.float(), -1).gather(-1, tc[:, None]).squeeze(-1) * mc).sum()

    step = common.chunk_positions(head.weight.shape[0])
    grad = torch.is_grad_enabled() and h.requires_grad
    total = sum(torch.utils.checkpoint.checkpoint(chunk_nll, h[s:s + step], targets[s:s + step], mask[s:s + step],
                                                  use_reentrant=False) if grad else
                chunk_nll(h[s:s + step], targets[s:s + step], mask[s:s + step]) for s in range(0, len(targets), step))
    return -(total / mask.sum().clamp(min=1))


# ---- the update ----
def update(model, opt, tok, examples: list, args: Args, step: int, accel, sampler) -> dict:
    """One optimiser step on one supervised batch. The uniforms of every target position are drawn once for the
    whole batch (row-major), so micro-batching does not change the candidates; each micro-batch's token mean is
    weighted by its share of the step's target tokens on all ranks, so accumulation and data parallelism leave J
    unchanged. Both objectives share the forward, the weighting and the optimiser step."""
    ids, attn, loss_mask = (x.to(accel.device) for x in build_batch(tok, examples))
    per_row = loss_mask[:, 1:].sum(1)
    _, n_tokens = llm.step_counts(loss_mask[:, 1:], accel)
    u = torch.rand(int(per_row.sum()), args.candidates, device=accel.device)
    offsets = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)]).tolist()
    opt.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "hit": 0.0, "zero_var": 0.0, "nll": 0.0}
    for idx in torch.arange(len(examples)).split(args.micro_batch_size):
        h, aux_loss = decoder_forward(model, ids[idx], attn[idx])
        mb_tokens = float(per_row[idx].sum())
        if args.objective == "otr":
            loss, st = otr_loss(model, h, ids[idx], loss_mask[idx], u[offsets[idx[0]]:offsets[idx[-1] + 1]],
                                args.temperature, args.adv_std_norm)
        else:
            loss = sft_loss(model, h, ids[idx], loss_mask[idx])
            st = {"nll": loss.item() * mb_tokens}
        if aux_loss is not None:  # a mixture of experts: + coef * load-balancing loss, as algos/sft.py
            loss = loss + model.config.router_aux_loss_coef * aux_loss.float()
        (loss * mb_tokens / max(n_tokens, 1)).backward()
        sums["loss"] += loss.item() * mb_tokens
        for k, v in st.items():
            sums[k] += v
    grad_norm = llm.optimizer_step(model, opt, args, step - 1, args.steps, sampler)
    tot = llm.all_ranks_sum(sums, accel, accel.device)
    out = {f"loss/{args.objective}": tot["loss"] / max(n_tokens, 1), "loss/nll": tot["nll"] / max(n_tokens, 1),
           "loss/grad_norm": grad_norm, "train/target_tokens": n_tokens}
    if args.objective == "otr":  # the one-token rollouts' reward: how often a candidate is the target
        out.update({"rollout/reward": tot["hit"] / max(n_tokens, 1),
                    "rollout/zero_var_frac": tot["zero_var"] / max(n_tokens, 1)})
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    rank, is_main = accel.process_index, accel.is_main_process
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    task = llm.make_task(args.task, args.digits)
    if not all(e.solution for e in task.sample("train", 4, np.random.default_rng(0))):
        raise SystemExit(f"--task {args.task} has no target responses (Example.solution) to train on; OTR and SFT "
                         "need supervised data: add, addsteps, sums<N>, gsm8k or jsonl with a 'solution' field")
    hard_task = llm.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    eval_sets = common.held_out_sets(task, args.eval_examples, hard_task)
    model, tok, _, sampler = llm.load_policy(args, accel)
    opt = llm.make_optimizer(model.parameters(), args)

    run_dir = Path(args.out_dir) / args.exp_name
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    if args.resume:
        sampler.refresh()
    start_step, history, tokens = state.get("step", 0), state.get("history", []), state.get("target_tokens", 0)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name) if is_main else None
    t_start = time.time() - state.get("wall_s", 0.0)
    evaluate = lambda: common.run_eval(sampler, tok, task, eval_sets, args.max_new_tokens, args.pass_k,  # noqa: E731
                                       args.temperature, hard_task)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    if start_step == 0 and is_main:
        log(evaluate(), 0)
    bar = tqdm(range(start_step + 1, args.steps + 1), desc=args.objective, dynamic_ncols=True, disable=not is_main,
               initial=start_step, total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        examples = task.sample("train", args.batch_size, np.random.default_rng([args.seed, step, rank]))
        t0 = time.time()
        metrics = update(model, opt, tok, examples, args, step, accel, sampler)
        tokens += metrics["train/target_tokens"]
        metrics.update({"perf/train_s": time.time() - t0, "perf/lr": opt.param_groups[0]["lr"]})
        if is_main and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate())
        log(metrics, step)
        if is_main:
            bar.set_postfix(nll=f"{metrics['loss/nll']:.3f}",
                            acc=f"{next(h['eval/acc'] for h in reversed(history) if 'eval/acc' in h):.2f}")
        if args.save_every and step % args.save_every == 0 or step == args.steps:  # every rank: shards
            common.save_checkpoint(run_dir / "checkpoint", accel.unwrap_model(model), tok, opt,
                                   {"step": step, "history": history, "wall_s": time.time() - t_start,
                                    "target_tokens": tokens})
    if not is_main:
        return {}
    summary = {**common.summarize(history, 0, 0.0, time.time() - t_start), "target_tokens": tokens,
               "candidate_tokens": tokens * args.candidates if args.objective == "otr" else 0}
    common.save_curve(history, run_dir / "curve.png", f"{args.objective.upper()} on {task.name} ({args.model})")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
