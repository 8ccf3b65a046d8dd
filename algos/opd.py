"""OPD: on-policy distillation, and the "dense bridge" from a teacher to a student.

Bridge paper: "Beyond GRPO and On-Policy Distillation: An Empirical Sparse-to-Dense Reward Principle for
Language-Model Post-Training", arXiv:2605.12483.

The student samples; a frozen teacher scores every generated token; the student minimises a per-token
divergence to the teacher at its own prefixes. At each completion position t with student log-probs s(.)
and teacher log-probs q(.) over the vocabulary (both at the student's prefix x, y_<t):

  exact reverse KL     KL(pi_s || pi_t)_t = sum_v p_s(v) (s(v) - q(v))                  reverse_kl
  sampled reverse KL   r_t = -(s(y_t) - q(y_t)) (a per-token reward, no grad),           sampled_rkl_advantage
                       loss_t = -r_t * s(y_t)  (REINFORCE on one token)                  sampled_rkl_loss
                       E_{y_t ~ pi_s}[s(y_t) - q(y_t)] = KL_t, and the expected gradient is grad KL_t.
  forward KL           KL(pi_t || pi_s)_t = sum_v p_t(v) (q(v) - s(v))                   forward_kl
                       (--loss fkl: at student prefixes; --loss fkl-teacher: on teacher rollouts, i.e. KD)
  GKD                  JSD_beta = beta KL(p_t || m) + (1-beta) KL(p_s || m), m = beta p_t + (1-beta) p_s,
                       on a mix of student (fraction --gkd-student-frac) and teacher rollouts   gen_jsd
  aggregation          token mean over all completion tokens of the step.

--schedule bridge (the bridge paper's "reward-density principle"): stage 1, --bridge-warmup steps of forward
KL on teacher rollouts; stage 2, --steps of OPD (--loss) on student rollouts; stage 3, optional --grpo-steps
of GRPO on the student with the verifier reward (the only stage that uses labels). benchmarks/opd_bridge.py
compares, at a fixed budget of labelled prompts, GRPO on the student vs GRPO on the teacher followed by the
bridge.

StableOPD ("Demystifying OPD: Length Inflation and Stabilization Strategies for Large Language Models",
arXiv:2604.08527; truncation collapse): every step logs rollout/length, rollout/truncated_frac and
rollout/repeat_frac (completions with a repeated character 3-gram). The two fixes are flags:
--ref-coef (k3 KL of the student to its initial self on the sampled tokens, the reference-based divergence
constraint) and --mix-teacher-frac (that fraction of each batch's prompts is rolled out by the teacher and
distilled with forward KL: rollout mixture distillation).

Deviations:
- The KL is "local": the per-position divergence at the sampled prefix, with no gradient through the
  choice of future tokens (the sequence-level reverse KL would add a return over later positions). This is
  what Thinking Machines' OPD and AsyncOPD (arXiv:2606.24143) use; the sampled estimator uses per-token
  rewards with discount 0.
- Full-vocabulary log-probs of both models are materialised for the completion tokens ([B, C, V]). Fine for
  the 99-token tiny vocabulary; a large vocabulary wants a top-k teacher cache (algos/async_opd.py).
- StableOPD's abstract names its two fixes but not their exact form; the k3 penalty and the forward-KL
  treatment of mixed-in teacher rollouts are our choices.
- The bridge's GRPO stage is on-policy (one update per batch, ratio 1), the same gradient as algos/grpo.py
  with its defaults.
- The teacher may be any model with the student's tokenizer (vocabularies are checked to be identical).

Commands:
  python algos/opd.py                                     # tiny-5m teacher -> tiny-0.6m student, ~2 min
  python algos/opd.py --loss rkl                          # exact full-vocabulary reverse KL
  python algos/opd.py --loss gkd --gkd-student-frac 0.5   # GKD-style mixture
  python algos/opd.py --schedule bridge --bridge-warmup 30 --grpo-steps 50    # the dense bridge (+ student GRPO)
  python algos/opd.py --teacher runs/grpo/checkpoint      # any teacher sharing the tokenizer
Expected: held-out greedy accuracy of tiny-0.6m on 2-digit addition rises from 35.8% by 10+ points toward
the teacher's ~71% (measured: 35.8% -> 53.8% in 129 s on 2 shared cores); benchmarks/results/opd_bridge.md
has the bridge comparison.
"""
from __future__ import annotations

import copy
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


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "opd"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json and the curve go"""
    save: bool = False
    """save the final student as a checkpoint in out_dir/exp_name/checkpoint"""
    # models and task
    model: str = "tiny-0.6m"
    """the student: tiny-*, a Hugging Face id or a local path"""
    teacher: str = "tiny-5m"
    """the teacher: any model with the student's tokenizer (a checkpoint folder of algos/grpo.py works)"""
    task: str = "add"
    """add, addsteps, jsonl:PATH or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
    # objective and schedule
    loss: Literal["rkl", "rkl-sampled", "fkl", "fkl-teacher", "gkd"] = "rkl"
    """per-token divergence of the OPD stage (see the header)"""
    schedule: Literal["opd", "bridge"] = "opd"
    """opd: --steps of --loss; bridge: forward-KL warm-up on teacher rollouts, OPD, then optional GRPO"""
    bridge_warmup: int = 30
    """bridge stage 1: steps of forward KL on teacher rollouts"""
    grpo_steps: int = 0
    """bridge stage 3: steps of GRPO on the student (labelled prompts)"""
    gkd_student_frac: float = 0.5
    """GKD: fraction of each batch's prompts rolled out by the student (the rest by the teacher)"""
    gkd_beta: float = 0.5
    """GKD: the generalised JSD's interpolation beta, in (0, 1)"""
    ref_coef: float = 0.0
    """StableOPD fix 1: weight of the k3 KL to the initial student (0 = off)"""
    mix_teacher_frac: float = 0.0
    """StableOPD fix 2: fraction of prompts rolled out by the teacher and distilled with forward KL"""
    # rollout and optimisation
    steps: int = 150
    """OPD steps (rollout batch + one optimiser step each)"""
    prompts_per_step: int = 32
    """distinct prompts per batch"""
    group_size: int = 4
    """completions per prompt (GRPO needs >= 2)"""
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature of both rollouts and scoring"""
    lr: float = 1e-4
    """AdamW learning rate of the distillation stages (5e-4 overshoots on the tiny student)"""
    grpo_lr: float = 1e-4
    """AdamW learning rate of the bridge's GRPO stage"""
    warmup_steps: int = 10
    """linear learning-rate warm-up (Adam's first steps are sign-like and overshoot at full lr); after it
    the distillation lr decays linearly to 10% at the last step"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    # eval
    eval_every: int = 25
    """steps between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts for greedy accuracy"""
    eval_hard: bool = True
    """also evaluate one digit harder than training (out of distribution)"""


def check_args(args: Args) -> None:
    if args.steps < 0 or args.bridge_warmup < 0 or args.grpo_steps < 0:
        raise SystemExit("--steps, --bridge-warmup and --grpo-steps must be >= 0")
    total = args.steps + (args.bridge_warmup + args.grpo_steps if args.schedule == "bridge" else 0)
    if total < 1:
        raise SystemExit("nothing to train: --steps (and the bridge stages) add up to 0")
    if args.prompts_per_step < 1 or args.group_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --group-size and --max-new-tokens must be positive")
    if args.schedule == "bridge" and args.grpo_steps and args.group_size < 2:
        raise SystemExit(f"--grpo-steps needs --group-size >= 2 for a group baseline, got {args.group_size}")
    if args.schedule == "opd" and args.grpo_steps:
        raise SystemExit("--grpo-steps only applies with --schedule bridge")
    if not 0 < args.gkd_beta < 1:
        raise SystemExit(f"--gkd-beta must be in (0, 1), got {args.gkd_beta}")
    if not 0 <= args.gkd_student_frac <= 1 or not 0 <= args.mix_teacher_frac < 1:
        raise SystemExit("--gkd-student-frac must be in [0, 1] and --mix-teacher-frac in [0, 1)")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    if args.ref_coef < 0:
        raise SystemExit("--ref-coef must be >= 0")


def check_teacher(tok_s, tok_t, student, teacher, name: str) -> None:
    """The teacher must share the student's tokenizer: same vocabulary and same output size."""
    vs, vt = tok_s.get_vocab(), tok_t.get_vocab()
    if vs != vt:
        diff = len(set(vs.items()) ^ set(vt.items()))
        raise SystemExit(f"--teacher {name}: its tokenizer differs from the student's ({len(vt)} vs {len(vs)} "
                         f"tokens, {diff} mismatched entries); OPD needs one shared vocabulary")
    ns, nt = student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
    if ns != nt:
        raise SystemExit(f"--teacher {name}: output layer has {nt} logits, the student's has {ns}")


# ---- the idea: per-token divergences ----
def reverse_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) per position: sum_v p_s (s - q); inputs [..., V] log-probs -> [...]."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def forward_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || pi_s) per position: sum_v p_t (q - s)."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def gen_jsd(s_logp: torch.Tensor, t_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD: beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s."""
    m = torch.logsumexp(torch.stack([t_logp + np.log(beta), s_logp + np.log(1 - beta)]), 0)
    return beta * (t_logp.exp() * (t_logp - m)).sum(-1) + (1 - beta) * (s_logp.exp() * (s_logp - m)).sum(-1)


def sampled_rkl_advantage(s_tok: torch.Tensor, t_tok: torch.Tensor) -> torch.Tensor:
    """Per-token reward r_t = -(log pi_s(y_t) - log pi_t(y_t)) at the sampled tokens (no gradient)."""
    return -(s_tok - t_tok).detach()


def sampled_rkl_loss(s_tok: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """REINFORCE on each token with its own reward: -r_t log pi_s(y_t); expected gradient = grad KL_t."""
    return -adv * s_tok


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) on sampled tokens (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), rewards [B] group-major."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Full-vocabulary log-probs at every completion position, [B, C, V] (the decoder runs once)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, prompt_ids.shape[1] - 1:-1]).float() / temperature
    return torch.log_softmax(logits, -1)


def token_divergence(kind: str, s_logp, t_logp, tokens, beta: float = 0.5):
    """Per-token loss [B, C] for one divergence kind, given [B, C, V] log-probs and the sampled tokens [B, C]."""
    if kind == "rkl":
        return reverse_kl(s_logp, t_logp)
    if kind in ("fkl", "fkl-teacher"):
        return forward_kl(s_logp, t_logp)
    if kind == "gkd":
        return gen_jsd(s_logp, t_logp, beta)
    if kind == "rkl-sampled":
        s_tok = s_logp.gather(-1, tokens[..., None]).squeeze(-1)
        t_tok = t_logp.gather(-1, tokens[..., None]).squeeze(-1)
        return sampled_rkl_loss(s_tok, sampled_rkl_advantage(s_tok, t_tok))
    raise ValueError(f"unknown divergence {kind!r}")


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (B-93's repetition)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


# ---- helpers of the loop ----
def stage_of(step: int, args: Args) -> str:
    """'warmup' (FKL on teacher rollouts), 'opd' or 'grpo' for a 1-based step."""
    if args.schedule == "opd":
        return "opd"
    if step <= args.bridge_warmup:
        return "warmup"
    return "opd" if step <= args.bridge_warmup + args.steps else "grpo"


def run_eval(model, tok, task, hard_task, eval_sets, args) -> dict:
    out = {"eval/acc": common.evaluate(model, tok, task, eval_sets["main"], args.max_new_tokens)["acc"]}
    if hard_task is not None:
        out["eval/acc_hard"] = common.evaluate(model, tok, hard_task, eval_sets["hard"], args.max_new_tokens + 2)["acc"]
    return out


def save_curve(history: list[dict], path: Path, title: str, teacher_acc: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    tr = [h for h in history if "rollout/reward" in h]
    ax.plot([h["step"] for h in tr], [h["rollout/reward"] for h in tr], alpha=0.4, label="rollout reward")
    ev = [h for h in history if "eval/acc" in h]
    ax.plot([h["step"] for h in ev], [h["eval/acc"] for h in ev], "o-", label="held-out greedy acc")
    if ev and "eval/acc_hard" in ev[0]:
        ax.plot([h["step"] for h in ev], [h["eval/acc_hard"] for h in ev], "s--", label="harder (OOD) acc")
    ax.axhline(teacher_acc, color="gray", ls=":", label="teacher acc")
    ax.set(xlabel="step", ylabel="accuracy / reward", ylim=(0, 1), title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def batch_of(ro, device) -> dict:
    return {k: getattr(ro, k).to(device) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device(args.device)
    task = common.make_task(args.task, args.digits)
    hard_task = common.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    model, tok = common.load_model(args.model, device)
    teacher, tok_t = common.load_model(args.teacher, device)
    check_teacher(tok, tok_t, model, teacher, args.teacher)
    teacher.eval().requires_grad_(False)
    model.train()
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.ref_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    run_dir = Path(args.out_dir) / args.exp_name
    eval_rng = np.random.default_rng(12345)  # the same held-out prompts in every script
    eval_sets = {"main": task.sample("test", args.eval_examples, eval_rng)}
    if hard_task is not None:
        eval_sets["hard"] = hard_task.sample("test", min(args.eval_examples, 300), eval_rng)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name)
    timer = common.Timer()
    t_start, gen_tokens, gen_time, history = time.time(), 0, 0.0, []
    labelled_prompts = 0

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        tracker.log(metrics, step)

    teacher_eval = run_eval(teacher, tok, task, hard_task, eval_sets, args)
    log({**run_eval(model, tok, task, hard_task, eval_sets, args),
         "eval/teacher_acc": teacher_eval["eval/acc"]}, 0)
    total = args.steps + (args.bridge_warmup + args.grpo_steps if args.schedule == "bridge" else 0)
    G = args.group_size
    for step in tqdm(range(1, total + 1), desc=f"opd[{args.loss},{args.schedule}]", dynamic_ncols=True):
        torch.manual_seed(hash((args.seed, step)) % 2**31)
        rng = np.random.default_rng([args.seed, step])
        stage = stage_of(step, args)
        if stage == "grpo" and step == args.bridge_warmup + args.steps + 1:
            for g in opt.param_groups:
                g["lr"] = args.grpo_lr
        examples = task.sample("train", args.prompts_per_step, rng)
        prompts = common.encode_prompts(tok, [e.prompt for e in examples])
        # which prompts the student rolls out (the rest: the teacher), and the loss on each part
        if stage == "warmup" or (stage == "opd" and args.loss == "fkl-teacher"):
            n_student, s_kind, t_kind = 0, None, "fkl-teacher"
        elif stage == "opd" and args.loss == "gkd":
            n_student, s_kind, t_kind = round(args.gkd_student_frac * len(prompts)), "gkd", "gkd"
        elif stage == "opd":
            n_student = len(prompts) - round(args.mix_teacher_frac * len(prompts))
            s_kind, t_kind = args.loss, "fkl-teacher"
        else:
            n_student, s_kind, t_kind = len(prompts), "grpo", None
        with timer("gen"):
            ro_s = common.generate(model, tok, prompts[:n_student], G, args.max_new_tokens, args.temperature) \
                if n_student else None
            ro_t = common.generate(teacher, tok, prompts[n_student:], G, args.max_new_tokens, args.temperature) \
                if n_student < len(prompts) else None
        parts = [(ro, kind) for ro, kind in ((ro_s, s_kind), (ro_t, t_kind)) if ro is not None]
        n_tokens = sum(int(ro.completion_mask.sum()) for ro, _ in parts)
        gen_tokens += n_tokens
        gen_time += timer.totals.get("gen", 0.0)

        stats = {"loss": 0.0, "rkl": 0.0, "fkl": 0.0, "entropy": 0.0, "ref_kl": 0.0}
        opt.zero_grad(set_to_none=True)
        with timer("train"):
            for ro, kind in parts:
                b = batch_of(ro, device)
                m = b["completion_mask"].float()
                s_logp = completion_logprobs(model, **b, temperature=args.temperature)
                s_tok = s_logp.gather(-1, b["completion_ids"][..., None]).squeeze(-1)
                with torch.no_grad():
                    t_logp = completion_logprobs(teacher, **b, temperature=args.temperature)
                if kind == "grpo":
                    answers = [e.answer for e in examples for _ in range(G)]
                    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
                    adv = group_advantages(rewards, G)
                    # seq-mean of -A log pi (ratio 1), rescaled to share the token-mean denominator
                    per_seq = (-(adv[:, None] * s_tok) * m).sum(1) / m.sum(1).clamp(min=1)
                    tok_loss_sum = per_seq.sum() * n_tokens / len(per_seq)
                    labelled_prompts += len(examples)
                else:
                    tok_loss = token_divergence(kind, s_logp, t_logp, b["completion_ids"], args.gkd_beta)
                    if ref_model is not None and ro is ro_s:
                        with torch.no_grad():
                            ref_tok = completion_logprobs(ref_model, **b, temperature=args.temperature).gather(
                                -1, b["completion_ids"][..., None]).squeeze(-1)
                        rk = k3_kl(s_tok, ref_tok)
                        tok_loss = tok_loss + args.ref_coef * rk
                        stats["ref_kl"] += common.masked_sum(rk.detach(), m).item() / n_tokens
                    tok_loss_sum = common.masked_sum(tok_loss, m)
                loss = tok_loss_sum / n_tokens
                if not torch.isfinite(loss):
                    raise SystemExit(f"non-finite loss at step {step}; lower --lr")
                loss.backward()
                with torch.no_grad():
                    stats["loss"] += loss.item()
                    stats["rkl"] += common.masked_sum(reverse_kl(s_logp, t_logp), m).item() / n_tokens
                    stats["fkl"] += common.masked_sum(forward_kl(s_logp, t_logp), m).item() / n_tokens
                    ent = -(s_logp.exp() * s_logp).sum(-1)
                    stats["entropy"] += common.masked_sum(ent, m).item() / n_tokens
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            if stage != "grpo":
                for g in opt.param_groups:
                    g["lr"] = args.lr * min(1.0, step / max(args.warmup_steps, 1)) * (1 - 0.9 * (step - 1) / total)
            opt.step()
        t = timer.pop()
        own = ro_s if ro_s is not None else ro_t  # the rollouts of the trained-on policy this step
        answers = [e.answer for e in examples[:n_student] for _ in range(G)] if ro_s is not None else \
            [e.answer for e in examples[n_student:] for _ in range(G)]
        reward = float(np.mean([task.verify(tx, a)[0] for tx, a in zip(own.texts, answers)]))
        metrics = {
            "stage": {"warmup": 0, "opd": 1, "grpo": 2}[stage],
            "rollout/reward": reward, "rollout/source_student": float(ro_s is not None),
            "rollout/length": own.completion_mask.sum(1).float().mean().item(),
            "rollout/truncated_frac": float(np.mean([f == "length" for f in own.finish_reasons])),
            "rollout/repeat_frac": repeat_frac(own.texts),
            "loss/total": stats["loss"], "kl/reverse": stats["rkl"], "kl/forward": stats["fkl"],
            "kl/ref": stats["ref_kl"], "loss/entropy": stats["entropy"], "loss/grad_norm": grad_norm,
            "perf/gen_s": t.get("gen", 0.0), "perf/train_s": t.get("train", 0.0),
        }
        if step % args.eval_every == 0 or step == total:
            metrics.update(run_eval(model, tok, task, hard_task, eval_sets, args))
        log(metrics, step)

    evals = [h for h in history if "eval/acc" in h]
    train = [h for h in history if "rollout/reward" in h]
    student_rows = [h for h in train if h["rollout/source_student"]] or train
    summary = {
        "eval_acc_start": evals[0]["eval/acc"], "eval_acc_end": evals[-1]["eval/acc"],
        "eval_acc_best": max(h["eval/acc"] for h in evals), "teacher_acc": teacher_eval["eval/acc"],
        "train_reward_first": train[0]["rollout/reward"], "train_reward_last": train[-1]["rollout/reward"],
        "gen_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(gen_time, 1e-9), "wall_s": time.time() - t_start,
        "kl_reverse_end": train[-1]["kl/reverse"], "kl_forward_end": train[-1]["kl/forward"],
        "truncated_frac_max": max(h["rollout/truncated_frac"] for h in student_rows),
        "length_mean": float(np.mean([h["rollout/length"] for h in student_rows])),
        "labelled_prompts": labelled_prompts,
    }
    if "eval/acc_hard" in evals[-1]:
        summary["eval_acc_hard_start"], summary["eval_acc_hard_end"] = evals[0]["eval/acc_hard"], evals[-1]["eval/acc_hard"]
        summary["teacher_acc_hard"] = teacher_eval["eval/acc_hard"]
    save_curve(history, run_dir / "curve.png", f"OPD {args.loss}/{args.schedule} on {task.name}", summary["teacher_acc"])
    if args.save:
        common.save_checkpoint(run_dir / "checkpoint", model, tok, None, {"step": total})
    print(f"student held-out greedy accuracy {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f} "
          f"(teacher {summary['teacher_acc']:.3f}) in {summary['wall_s']:.0f}s")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
