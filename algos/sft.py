"""Supervised fine-tuning (SFT): the baseline every RL script starts from, and the maker of the tiny models.

Parent: none.

Method: maximum likelihood on (prompt, response) pairs with the prompt masked out of the loss,

    L(theta) = - (1 / sum_i |y_i|) * sum_i sum_t log pi_theta(y_{i,t} | x_i, y_{i,<t})      (sft_loss)

where y_i is the target response followed by EOS. The normaliser is the number of response tokens in the
batch (token mean), as in most SFT trainers.

The shipped checkpoints in algos/models/ were made with this script (the exact commands are in each
model's README.md and below). `--model new-small` / `new-large` (Llama) and `new-moe` (a Qwen3-MoE mixture of
experts, whose load-balancing loss is added to the SFT loss) start from random weights with the project's
character-level tokenizer; any other name (tiny-*, smollm2-135m, a HF id or path) fine-tunes it.

Deviations: none in the objective. Training data is generated on the fly (a fresh batch every step from a
seeded generator), so there are no epochs; a short run is deliberately stopped early to leave the policy
only partly competent, which gives RL room to improve.

Commands:
    python algos/sft.py                     # the SFT baseline: tiny-0.6m, 200 more steps on add (about 1 min)
    python algos/sft.py --model new-small --tasks add addsteps --steps 1500 --save-to algos/models/tiny-0.6m
    python algos/sft.py --model new-moe --tasks add addsteps --seed 1 --steps 1500 --lr 3e-3 ...  # tiny-moe, see card
    python algos/sft.py --model smollm2-135m --tasks jsonl:data.jsonl --device cuda    # a real model
    python algos/sft.py --model new-small --tasks sums5 sums2 sums3 sums4 sums6 --digits 1 ...  # tiny-sums, see card
Expected: the shipped models' accuracies are in their model cards (algos/models/*/README.md);
benchmarks/results/grpo.md holds 3-seed runs of the default command next to GRPO.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from tqdm import tqdm

import common
from algos import _llm as llm
from algos._toolenv import TraceTask

# Architectures for the shipped tiny models (LlamaForCausalLM, character vocabulary of 99 tokens).
NEW_MODELS = {
    "new-small": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=384),
    "new-large": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, intermediate_size=768),
}
# A mixture-of-experts architecture from transformers' own classes (Qwen3MoeForCausalLM, same tokenizer): 4 experts,
# top-2, the Switch load-balancing loss (returned by the model as aux_loss and added to the SFT loss).
NEW_MOE_MODELS = {
    "new-moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=True, router_aux_loss_coef=0.01),
}


@dataclass
class Args:
    exp_name: str = "sft"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed (data order, initialisation)"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json and the curve go"""
    model: str = "tiny-0.6m"
    """tiny-*, new-small, new-large, new-moe, smollm2-135m, a Hugging Face id or a local path"""
    tasks: list[str] = field(default_factory=lambda: ["add"])
    """tasks to train on, mixed uniformly: add, addsteps, sums<N> (N operands), sumsmix, jsonl:PATH, gsm8k, toolenv
    (expert multi-turn traces of algos/_toolenv.py: actions trained on, the environment's observations masked)"""
    digits: int = 2
    """operand digits of the arithmetic tasks"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    steps: int = 200
    """optimiser steps"""
    batch_size: int = 64
    """sequences per step"""
    lr: float = 3e-4
    """peak learning rate (AdamW), linear warm-up then cosine decay to 10%"""
    grad_checkpointing: bool = False
    """recompute each decoder layer in the backward (HF, non-reentrant): activations of one layer instead of all;
    off by default (the tiny models need no memory for it); on for real models on a GPU"""
    warmup_steps: int = 20
    """linear warm-up steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_new_tokens: int = 40
    """generation budget at eval time (long tasks need more: a sums<N> response has about
    (N - 1) * (3 * digits + 5) + digits characters)"""
    eval_every: int = 50
    """steps between held-out evaluations"""
    eval_examples: int = 300
    """held-out prompts per task per evaluation"""
    pass_k: int = 0
    """if > 0, the final evaluation also reports pass@k (k samples at temperature 1) on each task"""
    save_to: str = ""
    """if set, save the final model there in HF format (how the shipped tiny models were made)"""
    stop_at_acc: float = 0.0
    """stop at the first evaluation where the first task's held-out accuracy reaches this (0 = never);
    this is how the shipped models were left only partly competent"""


def check_args(args: Args) -> None:
    if args.steps < 1 or args.batch_size < 1 or args.threads < 1 or args.eval_every < 1 or args.max_new_tokens < 1:
        raise SystemExit("--steps, --batch-size, --threads, --eval-every and --max-new-tokens must be positive")
    if args.lr < 0 or args.warmup_steps < 0 or args.eval_examples < 0 or args.pass_k < 0:
        raise SystemExit("--lr, --warmup-steps, --eval-examples and --pass-k must not be negative")
    if not args.tasks:
        raise SystemExit("--tasks needs at least one task")


# ---- the idea: masked next-token likelihood ----
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


def build_char_tokenizer():
    """Character-level tokenizer over printable ASCII that AutoTokenizer loads (BOS added on encode)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left")


def new_model(kind: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if kind in NEW_MOE_MODELS else \
        (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(vocab_size=len(tok), max_position_embeddings=128, tie_word_embeddings=True,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     **{**NEW_MODELS, **NEW_MOE_MODELS}[kind])
    return model_cls(cfg), tok


def lr_at(step: int, args: Args) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ---- eval ----
def eval_all(model, tok, tasks, eval_sets, args, pass_k: int = 0) -> dict:
    out = {}
    for t in tasks:
        if hasattr(t, "evaluate"):  # an environment evaluates itself (episode success, per-turn accuracy)
            res = t.evaluate(model, tok, eval_sets[t.name], args.max_new_tokens, pass_k=pass_k)
        else:
            res = common.evaluate(model, tok, t, eval_sets[t.name], args.max_new_tokens, pass_k=pass_k)
        out.update({f"eval/{t.name}_{k}": v for k, v in res.items()})  # acc (greedy) and pass@k
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device(args.device)
    tasks = [TraceTask() if name == "toolenv" else llm.make_task(name, args.digits) for name in args.tasks]
    if args.model in NEW_MODELS or args.model in NEW_MOE_MODELS:
        model, tok = new_model(args.model, args.seed)
        model.to(device)
    else:
        model, tok = common.load_model(args.model, device, args.dtype)
    if args.grad_checkpointing:  # Hugging Face checkpoints only in train mode
        model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    eval_rng = np.random.default_rng(12345)  # the same held-out prompts for every run and every script
    eval_sets = {t.name: t.sample("test", args.eval_examples, eval_rng) for t in tasks}
    tracker = common.Tracker(Path(args.out_dir) / args.exp_name, args, args.track, run_name=args.exp_name)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args))
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    start = eval_all(model, tok, tasks, eval_sets, args)
    tracker.log(start, 0)
    history = [(0, start)]
    bar = tqdm(range(1, args.steps + 1), desc="sft", dynamic_ncols=True)
    for step in bar:
        examples = [ex for t in tasks for ex in t.sample("train", args.batch_size // len(tasks), rng)]
        ids, attn, loss_mask = (x.to(device) for x in build_batch(tok, examples))
        h, aux_loss = decoder_forward(model, ids, attn)  # bf16 matmuls under --dtype bf16; sft_loss is fp32
        loss = sft_loss(model, h, ids, loss_mask)
        if aux_loss is not None:  # a mixture of experts: + coef * load-balancing loss
            loss = loss + model.config.router_aux_loss_coef * aux_loss.float()
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}: lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        metrics = {"loss/nll": loss.item(), "perf/lr": sched.get_last_lr()[0]}
        if step % args.eval_every == 0 or step == args.steps:
            metrics.update(eval_all(model, tok, tasks, eval_sets, args))
            history.append((step, metrics))
            bar.set_postfix({k.split("/")[1]: f"{v:.2f}" for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, float)})
        tracker.log(metrics, step)
        if args.stop_at_acc and metrics.get(f"eval/{tasks[0].name}_acc", 0.0) >= args.stop_at_acc:
            print(f"stopping at step {step}: {tasks[0].name} held-out accuracy reached {args.stop_at_acc}")
            break
    end = history[-1][1]
    if args.pass_k:  # greedy again (same numbers) plus pass@k, once, on the final model
        end = {**end, **eval_all(model, tok, tasks, eval_sets, args, args.pass_k)}
    main_key = f"eval/{tasks[0].name}_acc"
    summary = {"eval_acc_start": start[main_key], "eval_acc_end": end[main_key],
               "eval_acc_best": max(h[main_key] for _, h in history), "n_params": n_params,
               "wall_s": time.time() - t0, **{k.replace("eval/", "final_"): v for k, v in end.items()}}
    if args.save_to:
        model.save_pretrained(args.save_to)
        tok.save_pretrained(args.save_to)
    print(f"held-out accuracy ({tasks[0].name}): {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f} "
          f"in {summary['wall_s']:.0f}s ({n_params / 1e6:.2f}M params)")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
