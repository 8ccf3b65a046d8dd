"""HGPO and LoGo: stepwise advantages for multi-turn agents, against flat stepwise groups.

Papers: He et al., "Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks", arXiv:2602.22817 (HGPO;
its published code is verl-agent's recipe/hgpo, whose grouping this file follows), and Yan et al., "Memory-R2: Fair
Credit Assignment for Long-Horizon Memory-Augmented LLM Agents", arXiv:2605.21768 (LoGo-GRPO, local and global
group-relative optimisation). In stepwise group-based RL every step (turn) of a rollout is trained with its own
group-relative advantage. Steps of one flat group (same episode, same turn) can have different histories, which biases
their advantages; HGPO puts each step into several groups by how much recent history it shares with other steps and
combines the group-relative advantages with weights; LoGo adds local re-rollouts from one shared intermediate state
(a depth-1 tree), a fair group for those steps.

Equations (step (i, t): episode i of a seed group, turn t; its anchor x_it is what the environment showed before
action t: the prompt for t = 0, the previous action and its answer (a_i,t-1, o_i,t-1) after that; R_i the episode's
final reward, T_i its number of turns):
  step return        G_it = gamma^(T_i - 1 - t) R_i  (the discounted return; the reward comes at the end)
                                                                      discounted_step_returns
  HGPO               G_k(i, t) = steps of the seed group, at any turn and in any episode, whose last k anchors
                     equal (x_i,t-k+1, ..., x_it), k = 1 .. min(t + 1, H + 1) (H = --hgpo-history);
                     A_k = (G_it - mean_{G_k} G) / (std_{G_k} G + eps) (population std) where |G_k| >= 2;
                     A_it = sum_k w_k A_k / (sum_k w_k + eps) over the levels with A_k != 0, w_k = (k + 1)^alpha;
                     --hgpo-base-group adds the episode-level group advantage as level k = 0 (weight 1)
                                                                      hgpo_advantages
  turn-keyed levels  (ablation --advantage hgpo-turn) level k = 0 .. t: the steps of the same turn t whose last k
                     (action, observation) pairs equal h_it's; A_k on R_i, sample std; w_k = (k + 1)^alpha over
                     levels with |G_k| >= 2                           hgpo_step_advantages(levels="all")
  flat stepwise      (ablation --advantage flat) A_it = (R_i - mean_{G_0} R) / std_{G_0} R, G_0 = the steps of
                     the seed group at turn t                         hgpo_step_advantages(levels="flat")
  LoGo               global: multi-turn GRPO's A_i on every step; local: K re-rollouts from the state at the start
                     of turn --logo-turn of one episode per seed group; A_local = group-relative advantage among
                     the K re-rollouts and their source; a step's signal = global + local (its source's steps),
                     local only (the re-rolled turns)                 local_rerollouts, logo_step_advantages
  per-token          the step's advantage on the action tokens of its turn     token_advantages
  loss               multi-turn GRPO's clipped surrogate with a per-token advantage [B, C]    clipped_pg_loss
  exact reference    A*(s_t, a_t) = V(s_t+1) - V(s_t) (the environment is deterministic, so Q(s, a) = V of the
                     next state; V(terminal) = its reward), each V a Monte Carlo mean of --mse-rollouts episodes
                     from the exact state, with its own variance reported   true_step_advantages, advantage_mse

Parent: algos/multiturn_grpo.py; changed: Args, check_args, clipped_pg_loss, rollout, main.

Deviations:
- HGPO follows the published code's grouping (history windows of anchors across turns and episodes of one seed
  group, (k + 1)^alpha weights normalised over the levels whose advantage is not 0, discounted step returns, mean-std
  normalisation with the population std) and its published runs' settings (alpha = 1, H = 2, gamma = 0.95, no base
  group). The anchor of a step joins the previous action to the environment's answer (`#b` + `=4;`), because this
  environment's answers do not name the key read (ALFWorld's observations describe the state the action reached).
  The base group, when on, is multi-turn GRPO's group advantage with each episode counted once (the published code
  counts an episode once per step, weighting long episodes more).
- --advantage hgpo-turn keeps this file's earlier grouping (levels keyed by the turn number, the flat group as level
  0, undiscounted rewards) as an ablation, and --advantage flat the flat stepwise groups (the hgpo-turn grouping
  restricted to level 0); both are ablations of this file, not the published method or its baselines.
- LoGo re-rolls one state per seed group (turn --logo-turn of the first episode still running there), not every
  memory operation; its extra sampled turns are counted, and --turn-budget stops a run at a number of sampled turns
  so that arms compare at equal sampled turns. For the advantage error LoGo's estimate of a step is its local
  advantage where it has one, the global one elsewhere.
- The "exact" stepwise values are Monte Carlo estimates from the exact state (the environment is small and
  deterministic; the policy is a language model whose action distribution cannot be enumerated); their own
  variance is reported beside every error and is common to all arms. They are undiscounted, so advantage_mse scores
  HGPO's estimate with gamma = 1.
- The environment is algos/_toolenv.py's key-value lookup (three turns), not ALFWorld or WebShop.
- Everything else as algos/multiturn_grpo.py (the prompt-task flags refused, grpo.py's sampler correction on
  action tokens).

Commands:
  python algos/hgpo.py                                   # HGPO, tiny default, 2-core CPU, 1-4 minutes
  python algos/hgpo.py --advantage hgpo-turn             # the turn-keyed levels (ablation)
  python algos/hgpo.py --advantage flat                  # flat stepwise groups
  python algos/hgpo.py --advantage logo --logo-k 4       # Memory-R2's LoGo (local re-rollouts)
  python algos/hgpo.py --advantage trajectory            # multi-turn GRPO's trajectory-level advantage
Expected (3 seeds, benchmarks/results/multiturn.md): mean squared error of stepwise advantages against the exact
values on the initial policy's rollouts: HGPO (history levels, the default) 0.109 ± 0.019, the turn-keyed levels
(--advantage hgpo-turn) 0.108 ± 0.021, flat groups 0.121 ± 0.015, LoGo 0.122 ± 0.011, trajectory-level 0.124 ± 0.013
(the seed-level intervals include 0). At 8,000 sampled turns (about 16 rollout batches) no stepwise arm raises held-out
success from 53.3%: flat 50.3 ± 9.4, HGPO 45.6 ± 6.7, turn-keyed 48.4 ± 8.8, LoGo 49.6 ± 8.4 (multi-turn GRPO's
trajectory advantage reaches 60.0 after 20 batches, seed 0). The default run (90 rollout batches, about 47,000
sampled turns) reaches 66.3 ± 0.9% (+13.3, +12.0, +13.7 points; turn-keyed 67.7 ± 0.6, flat 68.0 ± 6.5, multi-turn
GRPO 68.3 ± 6.0). Seed 0 shortened to 20 rollout batches: 52.0% -> 56.5% of 200 held-out episodes (56.5 / 57.0
under the avx2 / default CPU paths; tests/test_hgpo.py's learning test).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos import _toolenv
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """HGPO's flags: multi-turn GRPO's and the stepwise advantage's; the plumbing flags are LLMArgs'.
    The environment is the task: --task, --digits, --top-p, --pass-k and --eval-hard are refused (check_args)."""
    # plumbing defaults for the tool environment
    model: str = "tiny-toolenv"
    """tiny-toolenv (SFT'd on the environment's traces), a Hugging Face id or a local path"""
    max_new_tokens: int = 6
    """generation budget per action (turn)"""
    temperature: float = 0.7
    """sampling temperature (the trainer scores with the same temperature); below 1 so that more sampled episodes
    get their lookups right and reach the answer turn (at 1.0 the tiny policy solves about 20% of them)"""
    steps: int = 90
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    eval_every: int = 30
    """rollout batches between held-out evaluations"""
    eval_examples: int = 300
    """held-out episodes for greedy success and per-turn accuracy"""
    pass_k: int = 0
    """no pass@k here: the held-out evaluation is greedy episode success (must stay 0)"""
    eval_hard: bool = False
    """no harder held-out split here: the held-out set is episodes that training never plays (must stay off)"""
    # environment
    env: Literal["lookup", "calc"] = "lookup"
    """the environment: 'lookup' (algos/_toolenv.py's key-value store, what tiny-toolenv was trained on) or 'calc'
    (reasoning-gym's basic_arithmetic problems with a calculator tool and an answer tool, for chat models: the shipped
    tiny-toolenv was never trained on it); --n-keys, --n-query and --value-digits set the lookup only"""
    n_keys: int = 4
    """keys in each episode's hidden store"""
    n_query: int = 3
    """keys whose values the answer sums (each needs a lookup turn)"""
    value_digits: int = 1
    """digits of the stored values (the answer is the sum of two of them)"""
    max_turns: int = 5
    """turn limit: an episode with this many actions and no answer ends with reward 0"""
    max_context: int = 40
    """context limit in characters of the transcript (prompt, actions, observations); passing it ends with reward 0"""
    max_context_tokens: int = 0
    """context budget in tokens (prompt, actions, observations): a turn that would pass it ends the episode with
    reward 0, as the other limits (0 = none; --max-context counts the environment's characters)"""
    max_obs_tokens: int = 0
    """budget of one observation (tool response) in tokens: a longer one is cut, counted in rollout/obs_truncated
    (0 = none)"""
    env_ce_examples: int = 64
    """held-out episodes (sampled once from the initial policy) whose observation tokens give eval/env_ce"""
    env_split: Literal["episode", "prompt"] = "episode"
    """the environment's held-out split: 'episode' (a hash of an episode's store and query, the split tiny-toolenv was
    trained with; a held-out episode's visible prompt also occurs in training with other values) or 'prompt' (a hash
    of the visible prompt: held-out and validation prompts never occur in training)"""
    eval_split: Literal["test", "val"] = "test"
    """episodes of the eval/ metrics (and of eval/env_ce): 'test', the reported held-out set, or 'val', the
    validation split of --env-split prompt, for choosing hyperparameters without touching the reported set"""
    # rollout
    prompts_per_step: int = 16
    """distinct episodes (seeds) per rollout batch (per process)"""
    group_size: int = 8
    """episodes per seed (G)"""
    # objective
    advantage: Literal["hgpo", "hgpo-turn", "flat", "logo", "trajectory"] = "hgpo"
    """stepwise advantage: HGPO's hierarchy of history groups (as its published code), the turn-keyed levels of
    this file's earlier version (ablation), flat stepwise groups, LoGo's local re-rollouts plus the global group, or
    multi-turn GRPO's trajectory-level advantage"""
    hgpo_alpha: float = 1.0
    """HGPO's level weights w_k = (k + 1)^alpha (0 = equal weights)"""
    hgpo_history: int = 2
    """HGPO: H, the most earlier anchors a level matches besides the current one (levels k = 1 .. H + 1)"""
    hgpo_gamma: float = 0.95
    """HGPO: discount of the step returns G_t = gamma^(T - 1 - t) R"""
    hgpo_base_group: bool = False
    """HGPO: add the episode-level group advantage as level 0 (the published code's option, off in its runs)"""
    logo_turn: int = 1
    """LoGo: re-roll from the state at the start of this turn (0-based; 1 = after the first action and observation)"""
    logo_k: int = 4
    """LoGo: re-rollouts per seed group"""
    turn_budget: int = 0
    """stop once this many turns have been sampled (all arms at equal sampled turns; 0 = run --steps)"""
    mse_rollouts: int = 32
    """Monte Carlo episodes per state for the exact stepwise values of advantage_mse (benchmarks)"""
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
    if args.max_turns < 1 or args.max_context < 8 or not 1 <= args.value_digits <= 4 or \
            not 2 <= args.n_query <= args.n_keys <= 26:
        raise SystemExit("--max-turns >= 1, --max-context >= 8, --value-digits in 1..4, 2 <= --n-query <= --n-keys <= 26")
    if args.env_ce_examples < 1:
        raise SystemExit(f"--env-ce-examples must be >= 1 (the held-out episodes of eval/env_ce), "
                         f"got {args.env_ce_examples}")
    if args.task != "add" or args.digits != 2:
        raise SystemExit("--task, --digits: the task is algos/_toolenv.py's lookup environment; set it with --n-keys, "
                         "--n-query, --value-digits, --max-turns and --max-context")
    if args.top_p != 1.0:
        raise SystemExit("--top-p: multi-turn rollouts sample the full distribution (the trainer scores it)")
    if args.pass_k or args.eval_hard:
        raise SystemExit("--pass-k, --eval-hard: the multi-turn evaluation is greedy success on held-out episodes, "
                         "without pass@k or a harder split")
    if args.eval_split == "val" and args.env_split != "prompt":
        raise SystemExit("--eval-split val needs --env-split prompt (the episode split has no validation set)")
    if args.max_context_tokens < 0 or args.max_obs_tokens < 0:
        raise SystemExit("--max-context-tokens and --max-obs-tokens must be >= 0 (0 = no budget)")
    if args.env == "calc" and (args.n_keys, args.n_query, args.value_digits) != (4, 3, 1):
        raise SystemExit("--n-keys, --n-query, --value-digits set the lookup environment; --env calc plays "
                         "reasoning-gym's basic_arithmetic (2 to 4 terms of 1 to 2 digits)")
    if args.logo_k < 1 or not 0 <= args.logo_turn < args.max_turns:
        raise SystemExit("--logo-k must be >= 1 and --logo-turn in 0 .. max_turns - 1")
    if args.hgpo_history < 0 or not 0 < args.hgpo_gamma <= 1 or args.turn_budget < 0:
        raise SystemExit("--hgpo-history and --turn-budget must be >= 0 (0 = no budget), --hgpo-gamma in (0, 1]")


# ---- the idea: advantage, clipped surrogate, KL, aggregation ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def clipped_pg_loss(logp, old_logp, adv, eps_low: float, eps_high: float):
    """Per-token PPO-clip loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); logp [B, C], adv [B] or [B, C].

    Returns (loss [B, C], clipped [B, C] as float: where the clipped branch was the active one).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv  # per-token [B, C] stepwise advantages
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


def env_token_ce(model, batch: dict, args: Args) -> float:
    """CE_env = -mean log pi(o_t | context) over the observation tokens of a packed batch (no gradient), under the
    model's own distribution (temperature 1, whatever the sampling temperature)."""
    with torch.no_grad():
        logp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                     batch["completion_mask"], 1.0)
    return -common.masked_mean(logp, batch["obs_mask"].float()).item()


# ---- the idea: stepwise advantages (flat groups, hierarchy of groups, local re-rollouts) ----
def steps_of(eps: list) -> list[tuple[int, int, tuple]]:
    """Every step (episode i, turn t, history) of a rollout; history = ((a_1, o_1), ..., (a_{t-1}, o_{t-1}))."""
    return [(i, t, tuple(zip(e.actions[:t], e.observations[:t]))) for i, e in enumerate(eps) for t in range(len(e.actions))]


def _centred(r: torch.Tensor, std_norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean r) / (std r + eps) over one group (r - mean r without the std; a group of one gives 0)."""
    if len(r) < 2:
        return torch.zeros_like(r)
    a = r - r.mean()
    return a / (r.std() + eps) if std_norm else a


def hgpo_step_advantages(rewards, groups: list[int], steps: list, std_norm: bool, alpha: float, levels: str):
    """Stepwise advantages of the turn-keyed levels (levels='all', the ablation --advantage hgpo-turn) or of flat
    stepwise groups (levels='flat'), one per step.

    A step (i, t, h) belongs, for each k = 0..t, to the group G_k of steps of the same episode seed (groups[i]) at
    the same turn t whose last k (action, observation) pairs equal its own: G_0 is the flat group, G_t holds the
    steps that share the whole history (the same state). A_k = (R_i - mean_{G_k} R) / std_{G_k} R; the levels combine
    as A = sum_k w_k A_k / sum_k w_k over the levels with |G_k| >= 2, w_k = (k + 1)^alpha. rewards [B] -> [n_steps].
    """
    out = torch.zeros(len(steps))
    index: dict = {}
    for s, (i, t, h) in enumerate(steps):
        for k in range(t + 1 if levels == "all" else 1):
            index.setdefault((groups[i], t, k, h[t - k:]), []).append(s)
    for s, (i, t, h) in enumerate(steps):
        num = den = 0.0
        for k in range(t + 1 if levels == "all" else 1):
            members = index[(groups[i], t, k, h[t - k:])]
            if len(members) < 2:
                continue
            r = rewards[[steps[m][0] for m in members]]
            w = (k + 1) ** alpha
            num += w * _centred(r, std_norm)[members.index(s)].item()
            den += w
        out[s] = num / den if den else 0.0
    return out


def discounted_step_returns(rewards, steps: list, n_turns: list[int], gamma: float) -> torch.Tensor:
    """G_it = gamma^(T_i - 1 - t) R_i for every step (i, t, h): the discounted return of a reward paid at the last
    turn. rewards [B], n_turns [B] (T_i) -> [n_steps]."""
    return torch.tensor([gamma ** (n_turns[i] - 1 - t) * float(rewards[i]) for i, t, _ in steps])


def hgpo_advantages(returns, groups: list[int], steps: list, std_norm: bool, alpha: float, history: int,
                    base=None, eps: float = 1e-6) -> torch.Tensor:
    """HGPO's stepwise advantages as its published code groups them, one per step.

    The anchors of step (i, t, h) are x_0 = the start (the seed's prompt) and x_u = (a_u-1, o_u-1) = h[u - 1]; for
    k = 1 .. min(t + 1, history + 1) the step joins the group keyed by (seed group, k, its last k anchors), whatever
    the turn or the episode of the other members. In each group of two or more steps A_k = G - mean G, divided by
    (population std + eps) when std_norm; each step then averages its nonzero A_k with weights (k + 1)^alpha,
    normalised by their sum + eps (a step whose every A_k is 0 gets 0). base [n_steps] (optional): the episode-level
    advantage, added as level k = 0. returns [n_steps] (discounted_step_returns) -> [n_steps].
    """
    clusters: dict = {}
    for s, (i, t, h) in enumerate(steps):
        anchors = ("start",) + tuple(h)  # anchors[u] = x_u, u = 0 .. t
        for k in range(1, min(t + 1, history + 1) + 1):
            clusters.setdefault((groups[i], k, anchors[t + 1 - k:]), []).append(s)
    items: list[list] = [[(0, float(base[s]))] if base is not None else [] for s in range(len(steps))]
    for (_, k, _), members in clusters.items():
        if len(members) < 2:
            continue
        g = returns[members].double()
        a = g - g.mean() if g.max() > g.min() else torch.zeros_like(g)  # equal returns: exactly 0
        if std_norm:
            a = a / (g.std(unbiased=False) + eps)
        for m, v in zip(members, a.tolist()):
            items[m].append((k, v))
    out = torch.zeros(len(steps))
    for s, its in enumerate(items):
        valid = [(k, v) for k, v in its if v != 0]  # zero-advantage levels are skipped
        w = [(k + 1) ** alpha for k, _ in valid]
        out[s] = sum(wk * v for wk, (_, v) in zip(w, valid)) / (sum(w) + eps) if valid else 0.0
    return out


def rollout_hgpo_advantages(rewards, groups: list[int], steps: list, n_turns: list[int], args: Args,
                            std_norm: bool, gamma: float) -> torch.Tensor:
    """HGPO's advantages of a rollout at the --hgpo-* settings: discounted step returns, the history levels, and,
    with --hgpo-base-group, multi-turn GRPO's group advantage of R_i as level 0. rewards [B] -> [n_steps]."""
    returns = discounted_step_returns(rewards, steps, n_turns, gamma)
    base = None
    if args.hgpo_base_group:
        traj = group_advantages(rewards, args.group_size, std_norm)
        base = torch.tensor([traj[i].item() for i, _, _ in steps])
    return hgpo_advantages(returns, groups, steps, std_norm, args.hgpo_alpha, args.hgpo_history, base)


def token_advantages(batch: dict, steps: list, step_adv: torch.Tensor) -> torch.Tensor:
    """Per-token advantages [B, C]: the advantage of step (i, t) on the action tokens of turn t of row i."""
    adv = torch.zeros_like(batch["logprobs"])
    for (i, t, _), a in zip(steps, step_adv.tolist()):
        adv[i][batch["turn"][i] == t] = a
    return adv * batch["action_mask"]


def local_rerollouts(policy, tok, env, eps: list, prompts: list, seeds: list, args: Args):
    """LoGo's local groups: for each seed group, the state at the start of turn --logo-turn of its first episode
    still running there, re-rolled --logo-k times (a depth-1 tree). Returns (episodes, prompts, group id, branch
    turn): each re-rolled episode carries the branch's prefix, so its transcript is complete."""
    branches = []
    for g in range(len(seeds)):
        rows = [g * args.group_size + j for j in range(args.group_size)]
        src = next((i for i in rows if len(eps[i].actions) > args.logo_turn), None)
        if src is not None:
            branches.append((g, src))
    envs, ctx, meta = [], [], []
    for g, src in branches:
        e, cut = eps[src], [j for j, t in enumerate(eps[src].turn) if t < args.logo_turn]
        n = len(cut)
        for _ in range(args.logo_k):
            env_copy = env.clone()
            env_copy.reset(seeds[g])
            for a in e.actions[:args.logo_turn]:  # replay the prefix: the environment is deterministic
                env_copy.step(a)
            envs.append(env_copy)
            ctx.append(prompts[src] + e.ids[:n])
            meta.append((g, src, n))
    new = _toolenv.play(policy, tok, envs, ctx, args.max_new_tokens, args.temperature,
                        first_turn=args.logo_turn) if envs else []
    out = []
    for ep, (g, src, n) in zip(new, meta):
        e = eps[src]
        for name in ("ids", "kind", "logprobs", "turn"):
            setattr(ep, name, getattr(e, name)[:n] + getattr(ep, name))
        ep.actions, ep.observations = e.actions[:args.logo_turn] + ep.actions, e.observations[:args.logo_turn] + \
            ep.observations
        ep.replies = e.replies[:args.logo_turn] + ep.replies
        out.append(ep)
    return out, [prompts[src] for _, src, _ in meta], [g for g, _, _ in meta], [src for _, src, _ in meta]


def logo_step_advantages(rewards, groups: list[int], steps: list, sources: dict, std_norm: bool, logo_turn: int,
                         group_size: int):
    """LoGo: global A_i = trajectory-level group advantage on every step of the G original episodes, plus the local
    advantage (R - mean over the re-rolled episodes and their source, sharing one state) on turns >= logo_turn of
    those episodes; re-rolled episodes are trained on their own turns only. sources: row -> source row (the
    re-rolled rows and the source itself); rewards [B'] over all rows, the first n_orig rows being the originals."""
    n_orig = len(groups) - sum(1 for r, s in sources.items() if r != s)
    glob = torch.cat([_centred(rewards[g:g + group_size], std_norm) for g in range(0, n_orig, group_size)])
    local_groups: dict = {}
    for r, s in sources.items():
        local_groups.setdefault(s, []).append(r)
    local = torch.zeros(len(rewards))
    for s, rows in local_groups.items():
        local[rows] = _centred(rewards[rows], std_norm)
    out = torch.zeros(len(steps))
    for k, (i, t, _) in enumerate(steps):
        if i < n_orig:
            out[k] = glob[i] + (local[i] if i in local_groups and t >= logo_turn else 0.0)
        elif t >= logo_turn:
            out[k] = local[i]
    return out


# ---- rollout and update ----
def make_env(args: Args) -> _toolenv.LookupEnv | _toolenv.CalculatorEnv:
    """The environment of --env: the key-value lookup, or reasoning-gym arithmetic with a calculator (for chat models;
    its --max-context counts the characters after the question)."""
    if args.env == "calc":
        return _toolenv.CalculatorEnv("basic_arithmetic", args.max_turns, args.max_context, args.env_split,
                                      args.max_context_tokens, args.max_obs_tokens)
    return _toolenv.LookupEnv(args.n_keys, args.value_digits, args.max_turns, args.max_context, args.n_query,
                              args.env_split, args.max_context_tokens, args.max_obs_tokens)


def pack_episodes(eps: list, prompts: list[list[int]], tok, device) -> dict:
    """Finished episodes -> tensors: prompt [B, P] left-padded; completion [B, C] right-padded (actions and
    observations); completion_mask (attention: every real token), action_mask (the policy loss), obs_mask, turn
    (the turn of each token, -1 on padding) and behaviour log-probs (0 off actions)."""
    prompt_ids, prompt_mask = common.left_pad(prompts, tok.pad_token_id)
    C = max(1, max(len(e.ids) for e in eps))
    pad = lambda rows, v: torch.tensor([r + [v] * (C - len(r)) for r in rows])  # noqa: E731
    kind = pad([e.kind for e in eps], 0)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "completion_ids": pad([e.ids for e in eps], tok.pad_token_id), "completion_mask": (kind > 0).long(),
             "action_mask": (kind == 1).long(), "obs_mask": (kind == 2).long(), "turn": pad([e.turn for e in eps], -1),
             "logprobs": pad([e.logprobs for e in eps], 0.0).float(),
             "rewards": torch.tensor([e.reward for e in eps], dtype=torch.float32)}
    return {k: v.to(device) for k, v in batch.items()}


def rollout(sampler, tok, env, args: Args, rng, device) -> dict:
    """G episodes of each of prompts_per_step training seeds (plus LoGo's re-rollouts), played turn by turn;
    per-token stepwise advantages of --advantage."""
    seeds = env.seeds("train", args.prompts_per_step, rng)
    envs = [env.clone() for _ in seeds for _ in range(args.group_size)]
    prompts = _toolenv.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, np.repeat(seeds, args.group_size))],
                                      env.system_prompt)
    eps = _toolenv.play(sampler, tok, envs, prompts, args.max_new_tokens, args.temperature)
    groups, n_orig, sources = [g for g in range(len(seeds)) for _ in range(args.group_size)], len(eps), {}
    if args.advantage == "logo":
        extra, extra_prompts, extra_groups, extra_src = local_rerollouts(sampler, tok, env, eps, prompts, seeds, args)
        sources = {**{s: s for s in extra_src}, **{n_orig + j: s for j, s in enumerate(extra_src)}}
        eps, prompts, groups = eps + extra, prompts + extra_prompts, groups + extra_groups
    batch = pack_episodes(eps, prompts, tok, device)
    steps, rewards = steps_of(eps), batch["rewards"].cpu()
    if args.advantage == "logo":
        step_adv = logo_step_advantages(rewards, groups, steps, sources, args.adv_std_norm, args.logo_turn,
                                        args.group_size)
        batch["action_mask"][n_orig:] *= (batch["turn"][n_orig:] >= args.logo_turn).long()  # own turns only
    elif args.advantage == "trajectory":
        traj = group_advantages(rewards, args.group_size, args.adv_std_norm)
        step_adv = torch.tensor([traj[i].item() for i, _, _ in steps])
    elif args.advantage == "hgpo":
        step_adv = rollout_hgpo_advantages(rewards, groups, steps, [len(e.actions) for e in eps], args,
                                           args.adv_std_norm, args.hgpo_gamma)
    else:  # the turn-keyed levels (ablation) or their level 0 alone (flat stepwise groups)
        step_adv = hgpo_step_advantages(rewards, groups, steps, args.adv_std_norm, args.hgpo_alpha,
                                        "all" if args.advantage == "hgpo-turn" else "flat")
    batch.update(adv=token_advantages(batch, steps, step_adv.to(device)), episodes=eps, n_orig=n_orig,
                 sampled_turns=sum(len(e.actions) for e in eps[:n_orig]) +
                 sum(len(e.actions) - args.logo_turn for e in eps[n_orig:]),
                 finish_reasons=["stop" if e.env.reward or e.observations[-1] == "" else "length" for e in eps])
    return batch


def episode_metrics(eps: list) -> dict:
    """rollout/turns (actions per episode), rollout/truncated (actions of the batch that hit the per-turn token budget
    --max-new-tokens without EOS; each is still sent to the environment), rollout/truncated_action_frac, and the
    token budgets' counts: rollout/obs_truncated (observations cut to --max-obs-tokens), rollout/context_limited
    (episodes ended by --max-context-tokens)."""
    n = sum(len(e.actions) for e in eps)
    cut = sum(e.truncated for e in eps)
    return {"rollout/turns": n / len(eps), "rollout/truncated": float(cut),
            "rollout/truncated_action_frac": cut / max(n, 1),
            "rollout/obs_truncated": float(sum(e.obs_truncated for e in eps)),
            "rollout/context_limited": float(sum(e.context_limited for e in eps))}


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

    As grpo.py's update, with the policy loss on action tokens only (mb["mask"] = action_mask, and the token counts
    are action tokens; the observation tokens are attended to through completion_mask); mb also carries the
    observation mask and the step's count of observation tokens (n_obs) for losses on them (algos/echo.py), and the
    training batch's environment-token cross-entropy is logged (loss/env_ce, at the sampling temperature: the
    quantity ECHO's term trains; eval/env_ce is at temperature 1). The sampler correction is grpo.py's, on action
    tokens.
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    act, obs = batch["action_mask"], batch["obs_mask"]
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
            c = llm.all_ranks_sum({"seqs": len(mb_idx), "tokens": float(act[mb_idx].sum()),
                                   "obs": float(obs[mb_idx].sum())}, accel, mask.device)  # step-global counts
            n_seqs, n_tokens, n_obs = int(c["seqs"]), int(c["tokens"]), int(c["obs"])
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": act[idx].float(), "obs_mask": obs[idx].float(), "n_obs": n_obs,
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                env_ce = -common.masked_sum(logp.detach(), mb["obs_mask"]).item() / max(n_obs, 1)
                for k, v in {"pg": loss.item(), "env_ce": env_ce, **{k: common.masked_sum(v.detach(), mb["mask"]).item(
                        ) / max(n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every action token once, on the sampler's weights (pi_old)
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
def held_out_ce_batch(sampler, tok, env, args: Args, device) -> dict:
    """A fixed set of rollouts of the initial policy on --eval-split episodes (sampled at --temperature): their
    observation tokens are where eval/env_ce is measured (at temperature 1), on trajectories the trained policy did
    not generate."""
    seeds = env.seeds(args.eval_split, args.env_ce_examples, np.random.default_rng(54321))
    envs = [env.clone() for _ in seeds]
    prompts = _toolenv.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)], env.system_prompt)
    with torch.random.fork_rng():
        torch.manual_seed(54321)
        eps = _toolenv.play(sampler, tok, envs, prompts, args.max_new_tokens, args.temperature)
    return pack_episodes(eps, prompts, tok, device)


def evaluate(sampler, tok, env, seeds: list[int], ce_batch: dict, args: Args) -> dict:
    """eval/acc (greedy held-out success, decoded by the sampler), eval/tool_use, eval/turn<k>_acc (teacher-forced),
    eval/env_ce (scored by the trainer)."""
    res = _toolenv.evaluate(sampler, tok, env, seeds, args.max_new_tokens)
    out = {"eval/acc": res.pop("success"), **{f"eval/{k}": v for k, v in res.items()}}
    return {**out, "eval/env_ce": env_token_ce(sampler.model, ce_batch, args)}


# ---- the error of stepwise advantages against exact values ----
def true_step_advantages(model, tok, env, eps: list, prompts: list, seed_of_row: list, steps: list, args: Args):
    """A*(s_t, a_t) = V(s_t+1) - V(s_t) for every step: each non-terminal V(s) a Monte Carlo mean of --mse-rollouts
    episodes played from the exact state s, V of a terminal state its reward. Returns (A* [n_steps], the variance of
    each A* from the Monte Carlo error)."""
    key = lambda i, t: (seed_of_row[i], tuple(zip(eps[i].actions[:t], eps[i].observations[:t])))  # noqa: E731
    states: dict = {}
    for i, t, _ in steps:
        states.setdefault(key(i, t), (i, t))
    envs, ctx, owner = [], [], []
    for k, (i, t) in states.items():
        e, n = eps[i], sum(1 for u in eps[i].turn if u < t)
        for _ in range(args.mse_rollouts):
            replay = env.clone()
            replay.reset(seed_of_row[i])
            for a in e.actions[:t]:
                replay.step(a)
            envs.append(replay)
            ctx.append(prompts[i] + e.ids[:n])
            owner.append(k)
    returns: dict = {}
    for s in range(0, len(envs), 1024):
        for k, ep in zip(owner[s:s + 1024], _toolenv.play(model, tok, envs[s:s + 1024], ctx[s:s + 1024],
                                                           args.max_new_tokens, args.temperature)):
            returns.setdefault(k, []).append(ep.reward)
    value = {k: (float(np.mean(r)), float(np.var(r, ddof=1) / len(r))) for k, r in returns.items()}
    truth, var = torch.zeros(len(steps)), torch.zeros(len(steps))
    for j, (i, t, _) in enumerate(steps):
        v_next = (eps[i].reward, 0.0) if t + 1 == len(eps[i].actions) else value[key(i, t + 1)]
        truth[j], var[j] = v_next[0] - value[key(i, t)][0], v_next[1] + value[key(i, t)][1]
    return truth, var


@torch.no_grad()
def advantage_mse(model, tok, env, args: Args, rng) -> dict:
    """On one rollout batch of the current policy: the mean squared error against the exact values of the stepwise
    advantages of flat groups, HGPO (its history levels with gamma = 1, as the exact values are undiscounted), the
    turn-keyed levels, LoGo (local where a step has a local group, global elsewhere) and the trajectory-level
    advantage, all without the std division (the exact values are on the reward's scale), and the Monte Carlo
    variance of the reference (a floor common to every arm)."""
    seeds = env.seeds("train", args.prompts_per_step, rng)
    envs = [env.clone() for _ in seeds for _ in range(args.group_size)]
    prompts = _toolenv.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, np.repeat(seeds, args.group_size))],
                                      env.system_prompt)
    eps = _toolenv.play(model, tok, envs, prompts, args.max_new_tokens, args.temperature)
    groups = [g for g in range(len(seeds)) for _ in range(args.group_size)]
    steps, rewards = steps_of(eps), torch.tensor([e.reward for e in eps])
    truth, var = true_step_advantages(model, tok, env, eps, prompts, [seeds[g] for g in groups], steps, args)
    est = {"flat": hgpo_step_advantages(rewards, groups, steps, False, args.hgpo_alpha, "flat"),
           "hgpo": rollout_hgpo_advantages(rewards, groups, steps, [len(e.actions) for e in eps], args, False, 1.0),
           "hgpo_turn": hgpo_step_advantages(rewards, groups, steps, False, args.hgpo_alpha, "all")}
    traj = group_advantages(rewards, args.group_size, False)
    est["trajectory"] = torch.tensor([traj[i].item() for i, _, _ in steps])
    extra, _, _, sources = local_rerollouts(model, tok, env, eps, prompts, seeds, args)
    local = {}
    for s in sorted(set(sources)):
        r = torch.tensor([eps[s].reward] + [x.reward for x, src in zip(extra, sources) if src == s])
        local[s] = _centred(r, False)[0].item()
    est["logo"] = torch.tensor([local[i] if i in local and t >= args.logo_turn else traj[i].item()
                                for i, t, _ in steps])
    out = {f"mse_{k}": float(((v - truth) ** 2).mean()) for k, v in est.items()}
    return {**out, "mse_reference_var": float(var.mean()), "n_steps": len(steps),
            "sampled_turns": sum(len(e.actions) for e in eps),
            "logo_extra_turns": sum(len(e.actions) - args.logo_turn for e in extra)}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args, tasks=False)  # accelerator, threads, seed, the run folder; the environment is the task
    env = run.task = make_env(args)  # run.task: the curve's title names the environment
    eval_seeds = env.seeds(args.eval_split, args.eval_examples, np.random.default_rng(12345))
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    opt = llm.make_optimizer(model.parameters(), args)
    ce_batch = held_out_ce_batch(sampler, tok, env, args, run.accel.device)  # before any update (and any resume)
    # resume from --resume (sampled_turns included), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, evaluate=lambda: evaluate(sampler, tok, env, eval_seeds, ce_batch, args),
              counters={"sampled_turns": 0})
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, env, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, grpo_loss, args, step, run.accel, sampler, ref_model)
        n = batch["n_orig"]  # metrics over the original episodes; generated tokens over all of them
        run.gen_tokens += int(batch["action_mask"][n:].sum())
        turns = run.counters["sampled_turns"] = run.counters["sampled_turns"] + batch["sampled_turns"]
        last = bool(args.turn_budget and turns >= args.turn_budget)  # the budget ends the run before --steps
        run.log_step(step, {"rewards": batch["rewards"][:n], "completion_mask": batch["action_mask"][:n],
                            "finish_reasons": batch["finish_reasons"][:n]}, stats, last=last,
                     extra={"rollout/sampled_turns": turns, **episode_metrics(batch["episodes"][:n])})
        if last:
            break
    return run.finish(f"{args.advantage} stepwise advantages", extra={"sampled_turns": run.counters["sampled_turns"]})


if __name__ == "__main__":
    main(tyro.cli(Args))
