"""BranchGRPO on a 2-D flow-matching policy: tree-shaped SDE rollouts that share prefixes, reward fusion,
depth-wise advantages, width and depth pruning; DanceGRPO-style independent rollouts are the baseline mode.
No language model; well under a minute on a CPU.

Papers: "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models", arXiv:2509.06040;
the baseline "DanceGRPO: Unleashing GRPO on Visual Generation", arXiv:2505.07818 (SDE log-probs as in
"Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470); the sliding SDE window of
BranchGRPO-Mix follows "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", arXiv:2507.21802.

Parent: none.

Task. A conditional velocity field v(x, t, c) on R^2 (a small MLP) is pretrained by flow matching on a ring of K
Gaussians, with the condition c naming the right mode only --pretrain-label-acc of the time, so the pretrained
flow follows its prompt loosely (pretrained in seconds, cached under .cache/branch_grpo_flow/). A prompt is a mode
c; the reward of a sample is r(x, c) = exp(-|x - mu_c|^2 / (2 s^2)), s = --reward-scale. Time runs from noise
(t = 0) to data (t = 1) in T = --denoise-steps steps of h = 1/T.

Equations (function that implements each):
  sampler     x_{k+1} = x_k + h [v - (eta^2/2)(x_k - t_k v)] + eta sqrt((1 - t_k) h) eps: Euler-Maruyama of
              dx = [v + (g^2/2) score] dt + g dW with g^2 = eta^2 (1 - t) and score = -(x - t v) / (1 - t),
              which keeps the flow's marginals (eta = 0 is the ODE)                                     sde_step
  policy      log pi(x_{k+1} | x_k, c) = log N(x_{k+1}; mean_k, std_k^2 I)                      gaussian_logprob
  DanceGRPO   G chains per prompt from one shared start noise, A_i = (r_i - mean_G r) / std_G r on every step
              of chain i (--mode dance: a tree with G copies of the root and no split)                  rollout
  BranchGRPO  at each step in --branch-steps every node spawns --branch-factor children from ONE model call
              (shared mean, independent noise); leaves per prompt = factor^#splits                       rollout
  fusion      node value R(n) = mean of the rewards of its leaves (--fusion mean), or
              R(n) = sum_j softmax_j(log p(n -> j)) R(j) over its children (--fusion prob)           node_values
  depth-wise  A(n) = (R(n) - mean R) / std R over the nodes of n's depth in n's tree; the edge parent -> n
              carries A(n) and is trained once (--advantage depthwise). --advantage uniform gives every edge of a
              leaf's path that leaf's GRPO advantage (DanceGRPO's credit on the tree's leaves); an edge shared by
              m leaves is computed once with the sum of their terms                    advantages, edge_terms
  loss        per edge, with a+ / a- the sums of the positive / negative advantages it carries and
              rho = exp(log pi_new - log pi_old):  l_e = -(a+ min(rho, clip rho) + a- max(rho, clip rho)),
              which is sum_leaves max(-A rho, -A clip(rho)); L = sum_e l_e / sum_e w_e (w = 1 per edge for
              depthwise, m for uniform), one optimiser step per mini-batch                          ppo_loss
  pruning     width: after the last split only the best and the worst --width-keep share of each tree's leaf
              chains are trained; depth: edges into the depths in --depth-prune are not trained. Mix: a window
              of --mix-window steps sliding one step every --mix-shift-every iterations (and the split steps) is
              SDE and trained, the other steps are ODE and untrained. The forward rollout is never pruned.
                                                                                         train_mask, sde_steps
  NFE         rollout: one model call per node per step, sum_k n_k per prompt; training: one forward per parent
              node with a trained edge (its children share the mean), or one per (leaf, step) with
              --no-edge-once, times --epochs. nfe_ratio = rollout NFE per leaf / T (DanceGRPO's is T)  build_batch

Deviations:
- A 2-D toy: a ring of Gaussians and an MLP instead of FLUX / an image DiT, and an analytic reward instead of
  HPS; CPU only (the model is tiny). No KL term and no classifier-free guidance (DanceGRPO uses neither in training).
- Noise schedule g^2 = eta^2 (1 - t) rather than Flow-GRPO's eta sqrt(t / (1 - t)) (in their time direction),
  which is infinite at the noise end; any g keeps the marginals, and both arms use the same sampler.
- DanceGRPO trains a random subset of the time steps with a tiny clip range; here every step, clip 0.2, for
  both arms alike.
- The paper's code runs one forward per edge in training; here one forward per parent node gives all its
  children's log-probs (they share the mean), so a split costs one training model call, not factor of them.
- Width pruning ranks each tree's leaf chains after the last split by leaf reward and keeps the best and worst
  halves of --width-keep (the paper's code sorts those edges by advantage, which orders them the same way for
  mean fusion); depth pruning uses a fixed set of depths (the paper's sliding variant is not implemented).
- Depth-wise statistics use the unbiased std; a depth with one node or a spread below 1e-6 gets advantage 0.
  Advantages are clipped to +-5 (--adv-clip) as in DanceGRPO's code.
- BranchGRPO-Mix's window slides over iterations as in MixGRPO (one step every --mix-shift-every iterations).

Commands:
  python algos/branch_grpo_flow.py                                   # BranchGRPO, about 10 s on one CPU thread
  python algos/branch_grpo_flow.py --mode dance                      # the DanceGRPO baseline (G = 16 chains)
  python algos/branch_grpo_flow.py --width-keep 0.5 --depth-prune 16 17 18 19 20    # with pruning
  python algos/branch_grpo_flow.py --advantage uniform --fusion prob
  python algos/branch_grpo_flow.py --mix-window 6                    # BranchGRPO-Mix
  python benchmarks/branch_flow_table.py                             # 3 seeds of each arm: the results table
Writes out_dir/exp_name/{metrics.jsonl, summary.json, branch_grpo_flow.png} (samples before and after, reward
curve) and returns the summary: reward_start / reward_end (SDE samples of every mode from fixed noise),
reward_auc (their mean over the evaluations during training: learning speed), reward_ode_*, train_reward_first /
_last, rollout and training NFE per leaf and per iteration, nfe_ratio, iteration times, wall_s.
Expected result (default, seed 0): mean reward 0.28 -> 0.94 (+0.66; the stated margin, asserted on a shorter
run by the learning test, is +0.35), nfe_ratio 0.63 (12.7 rollout model calls per leaf against DanceGRPO's 20), in
about 10 s on one thread (the first run also pretrains the flow, about 15 s, then cached). Against DanceGRPO
(benchmarks/results/branch_flow.md, 3 seeds): final reward 0.944 vs 0.941 at 150 iterations (both saturate;
DanceGRPO gains more per iteration, BranchGRPO more per rollout model call), iteration time 0.51 +- 0.22x with
width and depth pruning and 0.35 +- 0.15x for Mix at 64 prompts per iteration, per seed on a loaded shared machine
(the paper: about 0.45x and 4.7x faster), Mix's final reward 0.932 vs 0.941, and the uniform advantage learns a
little faster than the depth-wise one here (0.790 vs 0.765 mean reward over training).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn as nn
import tyro
from tqdm import tqdm

from common import CACHE_DIR, Timer, Tracker, set_seed

N_FREQ = 4  # sin/cos time features


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "branch_grpo_flow"
    """run folder name under out_dir"""
    seed: int = 0
    """seed of the prompts, the rollouts and the mini-batch order (the pretrained flow has its own seed)"""
    track: bool = False
    """also log to wandb"""
    out_dir: str = "runs"
    """where the run folder goes"""
    threads: int = 1
    """torch CPU threads (1: for this tiny MLP a second thread only adds synchronisation; 2 ran 10x slower)"""
    save_png: bool = True
    """write the figure (samples before / after, reward curve)"""
    # task and pretrained flow
    modes: int = 8
    """K: Gaussians on the ring = prompts"""
    radius: float = 2.0
    """ring radius"""
    mode_std: float = 0.2
    """std of each Gaussian"""
    reward_scale: float = 0.5
    """s of the reward exp(-|x - mu_c|^2 / (2 s^2))"""
    pretrain_label_acc: float = 0.4
    """share of pretraining pairs whose condition names the right mode (the rest get a random one)"""
    pretrain_steps: int = 2000
    """flow-matching steps of the pretrained flow (cached by its settings)"""
    pretrain_seed: int = 0
    """seed of the pretrained flow"""
    hidden: int = 64
    """MLP width (3 hidden layers)"""
    # rollout
    mode: Literal["branch", "dance"] = "branch"
    """branch: BranchGRPO tree rollouts; dance: DanceGRPO's G independent chains per prompt"""
    denoise_steps: int = 20
    """T: SDE steps per sample"""
    eta: float = 1.0
    """SDE noise level (g^2 = eta^2 (1 - t)); 0 would be the deterministic ODE"""
    group_size: int = 16
    """G: chains per prompt in --mode dance"""
    branch_steps: tuple[int, ...] = (0, 3, 6, 9)
    """steps at which every node splits (--mode branch)"""
    branch_factor: int = 2
    """children per split"""
    fusion: Literal["mean", "prob"] = "mean"
    """node value: mean of its leaves' rewards, or the children's values weighted by softmax of their log-probs"""
    advantage: Literal["depthwise", "uniform"] = "depthwise"
    """depthwise: node values standardised per depth and tree; uniform: each leaf's GRPO advantage on its path"""
    edge_once: bool = True
    """train each edge once (one forward per parent node); off: one forward per (leaf, step) as separate chains"""
    width_keep: float = 1.0
    """share of each tree's leaf chains trained after the last split (best and worst halves); 1 = no pruning"""
    depth_prune: tuple[int, ...] = ()
    """depths (1..T) whose incoming edges are not trained; empty = no depth pruning"""
    mix_window: int = 0
    """BranchGRPO-Mix: SDE (and trained) window of this many steps, ODE elsewhere; 0 = SDE everywhere"""
    mix_shift_every: int = 10
    """iterations between one-step shifts of the SDE window"""
    # optimisation
    iters: int = 150
    """rollout batches"""
    prompts_per_iter: int = 8
    """prompts (trees) per rollout batch"""
    lr: float = 3e-4
    """Adam learning rate"""
    clip_eps: float = 0.2
    """PPO clip range"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 4
    """optimiser steps per pass (the parent nodes are split into this many)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    # eval
    eval_per_mode: int = 64
    """SDE samples per mode from fixed noise for reward_start / reward_end"""
    eval_every: int = 25
    """iterations between evaluations"""


def leaves_per_prompt(args: Args) -> int:
    if args.mode == "dance":
        return args.group_size
    return args.branch_factor ** len(args.branch_steps)


def check_args(args: Args) -> None:
    """Fail early, naming the flag."""
    T = args.denoise_steps
    if T < 2 or args.modes < 2 or args.iters < 1 or args.prompts_per_iter < 1:
        raise SystemExit("--denoise-steps and --modes must be >= 2, --iters and --prompts-per-iter >= 1")
    if args.mode == "dance" and args.group_size < 2:
        raise SystemExit(f"--group-size must be >= 2 in --mode dance, got {args.group_size}")
    if args.mode == "branch":
        if not args.branch_steps:
            raise SystemExit("--branch-steps is empty: a tree without a split has one leaf and no advantage")
        if list(args.branch_steps) != sorted(set(args.branch_steps)) or not all(0 <= s < T for s in args.branch_steps):
            raise SystemExit(f"--branch-steps must be increasing steps in 0..{T - 1}, got {args.branch_steps}")
        if args.branch_factor < 2:
            raise SystemExit(f"--branch-factor must be >= 2, got {args.branch_factor}")
    if not 0 < args.width_keep <= 1:
        raise SystemExit(f"--width-keep must be in (0, 1], got {args.width_keep}")
    if args.width_keep < 1 and args.mode == "dance":
        raise SystemExit("--width-keep < 1 prunes leaf chains after the last split: it needs --mode branch")
    if not all(1 <= d <= T for d in args.depth_prune):
        raise SystemExit(f"--depth-prune depths must be in 1..{T}, got {args.depth_prune}")
    if not 0 <= args.mix_window <= T or args.mix_shift_every < 1:
        raise SystemExit(f"--mix-window must be in 0..{T} and --mix-shift-every >= 1")
    if args.epochs < 1 or args.minibatches < 1 or args.lr <= 0 or args.clip_eps <= 0 or args.eta <= 0:
        raise SystemExit("--epochs, --minibatches, --lr, --clip-eps and --eta must be positive")
    if not 0 < args.pretrain_label_acc <= 1 or args.reward_scale <= 0:
        raise SystemExit("--pretrain-label-acc must be in (0, 1] and --reward-scale positive")
    if min(args.threads, args.hidden, args.eval_every, args.eval_per_mode) < 1:
        raise SystemExit("--threads, --hidden, --eval-every and --eval-per-mode must be >= 1")


# ---- task and the pretrained flow ----
def ring_means(modes: int, radius: float) -> torch.Tensor:
    """mu_c, [K, 2]."""
    a = 2 * math.pi * torch.arange(modes) / modes
    return radius * torch.stack([a.cos(), a.sin()], -1)


def reward(x: torch.Tensor, c: torch.Tensor, means: torch.Tensor, scale: float) -> torch.Tensor:
    """r(x, c) = exp(-|x - mu_c|^2 / (2 s^2)); x [N, 2], c [N] -> [N]."""
    return torch.exp(-((x - means[c]) ** 2).sum(-1) / (2 * scale ** 2))


class VelocityNet(nn.Module):
    """v(x, t, c): x [N, 2], t [N], c [N] (mode index) -> [N, 2]."""

    def __init__(self, modes: int, hidden: int):
        super().__init__()
        self.modes = modes
        self.net = nn.Sequential(nn.Linear(2 + 2 * N_FREQ + modes, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2))

    def forward(self, x, t, c):
        f = math.pi * t[:, None] * torch.arange(1, N_FREQ + 1, dtype=x.dtype)
        return self.net(torch.cat([x, f.sin(), f.cos(), nn.functional.one_hot(c, self.modes).to(x.dtype)], -1))


def pretrain(args: Args) -> VelocityNet:
    """Conditional flow matching: |v(t x1 + (1-t) z, t, c) - (x1 - z)|^2 with a noisy condition c."""
    gen = torch.Generator().manual_seed(args.pretrain_seed)
    torch.manual_seed(args.pretrain_seed)
    model = VelocityNet(args.modes, args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.pretrain_steps)
    means = ring_means(args.modes, args.radius)
    n = 256
    for _ in range(args.pretrain_steps):
        mode = torch.randint(args.modes, (n,), generator=gen)
        x1 = means[mode] + args.mode_std * torch.randn(n, 2, generator=gen)
        right = torch.rand(n, generator=gen) < args.pretrain_label_acc
        c = torch.where(right, mode, torch.randint(args.modes, (n,), generator=gen))
        z, t = torch.randn(n, 2, generator=gen), torch.rand(n, generator=gen)
        loss = ((model(t[:, None] * x1 + (1 - t[:, None]) * z, t, c) - (x1 - z)) ** 2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model


def pretrained_flow(args: Args) -> VelocityNet:
    """The pretrained flow, from .cache/branch_grpo_flow/<hash of its settings>.safetensors or trained now."""
    from safetensors.torch import load_file, save_file

    keys = ("modes", "radius", "mode_std", "pretrain_label_acc", "pretrain_steps", "pretrain_seed", "hidden")
    cfg = json.dumps({k: getattr(args, k) for k in keys}, sort_keys=True)
    path = CACHE_DIR / "branch_grpo_flow" / f"flow-{hashlib.sha1(cfg.encode()).hexdigest()[:12]}.safetensors"
    if path.exists():
        model = VelocityNet(args.modes, args.hidden)
        model.load_state_dict(load_file(path))
        return model
    model = pretrain(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: parallel runs may write it at once
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)
    return model


# ---- the policy: SDE steps and their log-probs ----
def sde_step(model, x, k: int | torch.Tensor, c, T: int, eta: float):
    """Mean [N, 2] and std [N] of x_{k+1} given x_k at step k (int or [N])."""
    h = 1.0 / T
    t = (torch.as_tensor(k, dtype=x.dtype) * h).expand(x.shape[0])
    v = model(x, t, c)
    mean = x + h * (v - 0.5 * eta ** 2 * (x - t[:, None] * v))
    return mean, eta * torch.sqrt((1 - t) * h)


def gaussian_logprob(x_next, mean, std):
    """log N(x_next; mean, std^2 I) in 2-D; [N, 2], [N, 2], [N] -> [N]."""
    return -((x_next - mean) ** 2).sum(-1) / (2 * std ** 2) - 2 * torch.log(std) - math.log(2 * math.pi)


def sde_steps(args: Args, it: int) -> list[bool]:
    """Which steps are stochastic (and trainable) at iteration it: all, or the Mix window plus the split steps."""
    T, W = args.denoise_steps, args.mix_window
    if W == 0:
        return [True] * T
    start = min(it // args.mix_shift_every, T - W)
    splits = set(args.branch_steps) if args.mode == "branch" else set()
    return [start <= k < start + W or k in splits for k in range(T)]


@torch.no_grad()
def rollout(model, prompts: torch.Tensor, args: Args, sde: list[bool], gen: torch.Generator) -> dict:
    """One tree per prompt from one shared start noise. levels[k]: x [N_k, 2], tree [N_k] (prompt row), and for
    k >= 1 parent [N_k] (index into level k-1) and lp [N_k] (log-prob of the edge into the node, 0 on ODE steps).
    Dance: G copies of the root, no split; branch: one root, splits at --branch-steps."""
    roots = args.group_size if args.mode == "dance" else 1
    splits = set(args.branch_steps) if args.mode == "branch" else set()
    x0 = torch.randn(len(prompts), 2, generator=gen)
    tree = torch.arange(len(prompts)).repeat_interleave(roots)
    levels, nfe = [{"x": x0[tree], "tree": tree}], 0
    for k in range(args.denoise_steps):
        x, tree = levels[-1]["x"], levels[-1]["tree"]
        # an ODE step (outside the Mix window) is the plain flow step x + h v, eta = 0
        mean, std = sde_step(model, x, k, prompts[tree], args.denoise_steps, args.eta if sde[k] else 0.0)
        nfe += len(x)  # one model call per node, shared by its children
        parent = torch.arange(len(x)).repeat_interleave(args.branch_factor if k in splits else 1)
        mean, std = mean[parent], std[parent]
        if sde[k]:
            nxt = mean + std[:, None] * torch.randn(mean.shape, generator=gen)
            lp = gaussian_logprob(nxt, mean, std)
        else:
            nxt, lp = mean, torch.zeros(len(mean))
        levels.append({"x": nxt, "tree": tree[parent], "parent": parent, "lp": lp})
    return {"levels": levels, "prompts": prompts, "sde": sde, "nfe": nfe}


# ---- the idea: fused node values, depth-wise advantages, pruning ----
def node_values(levels: list[dict], leaf_r: torch.Tensor, fusion: str) -> tuple[list, list]:
    """R(n) for every node of every level, and the number of leaves under each node."""
    T = len(levels) - 1
    vals, count = [None] * (T + 1), [None] * (T + 1)
    vals[T], count[T] = leaf_r, torch.ones_like(leaf_r)
    for k in range(T, 0, -1):
        par, n = levels[k]["parent"], len(levels[k - 1]["x"])
        count[k - 1] = torch.zeros(n).index_add_(0, par, count[k])
        if fusion == "mean":  # mean over the leaves below = leaf-count-weighted mean of the children
            w = count[k] / count[k - 1][par]
        else:  # softmax of the children's edge log-probs within each parent
            lp = levels[k]["lp"]
            top = torch.full((n,), -torch.inf).scatter_reduce_(0, par, lp, "amax")
            e = torch.exp(lp - top[par])
            w = e / torch.zeros(n).index_add_(0, par, e)[par]
        vals[k - 1] = torch.zeros(n).index_add_(0, par, w * vals[k])
    return vals, count


def group_standardise(v: torch.Tensor, group: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean_g) / (std_g + eps) within groups (unbiased std); 0 for a group of one or with std < 1e-6."""
    n = int(group.max()) + 1
    cnt = torch.zeros(n).index_add_(0, group, torch.ones_like(v))
    mean = torch.zeros(n).index_add_(0, group, v) / cnt
    var = torch.zeros(n).index_add_(0, group, (v - mean[group]) ** 2) / (cnt - 1).clamp(min=1)
    std = var.sqrt()
    ok = (cnt[group] > 1) & (std[group] > 1e-6)
    return torch.where(ok, (v - mean[group]) / (std[group] + eps), torch.zeros_like(v))


def advantages(levels: list[dict], leaf_r: torch.Tensor, args: Args) -> list:
    """Per level k >= 1 the advantage terms (a+ [N_k], a- [N_k], w [N_k]) of the edge into each node."""
    T = len(levels) - 1
    vals, count = node_values(levels, leaf_r, args.fusion)
    out = [None] * (T + 1)
    if args.advantage == "depthwise":
        for k in range(1, T + 1):
            a = group_standardise(vals[k], levels[k]["tree"]).clamp(-args.adv_clip, args.adv_clip)
            out[k] = (a.clamp(min=0), a.clamp(max=0), torch.ones_like(a))
        return out
    a = group_standardise(leaf_r, levels[T]["tree"]).clamp(-args.adv_clip, args.adv_clip)  # GRPO over leaves
    pos, neg = a.clamp(min=0), a.clamp(max=0)
    for k in range(T, 0, -1):  # an edge carries the sum of the terms of the leaves below it
        out[k] = (pos, neg, count[k])
        par, n = levels[k]["parent"], len(levels[k - 1]["x"])
        pos, neg = torch.zeros(n).index_add_(0, par, pos), torch.zeros(n).index_add_(0, par, neg)
    return out


def train_mask(levels: list[dict], leaf_r: torch.Tensor, sde: list[bool], args: Args) -> list:
    """Per level k >= 1, which edges into level k are trained: SDE steps only, minus pruned depths and chains."""
    T = len(levels) - 1
    masks = [None] + [torch.full((len(levels[k]["x"]),), sde[k - 1] and k not in args.depth_prune)
                      for k in range(1, T + 1)]
    if args.width_keep < 1 and args.mode == "branch":
        last = max(args.branch_steps)
        tree = levels[T]["tree"]
        keep = torch.zeros(len(leaf_r), dtype=torch.bool)
        for g in tree.unique():
            idx = (tree == g).nonzero().squeeze(1)
            order = idx[torch.argsort(leaf_r[idx], descending=True, stable=True)]
            m = max(2, int(len(idx) * args.width_keep))
            keep[order[: m // 2]] = True
            keep[order[len(order) - (m - m // 2):]] = True
        for k in range(T, last + 1, -1):  # edges of steps after the last split: chains, one node per leaf
            masks[k] &= keep
            keep = torch.zeros(len(levels[k - 1]["x"]), dtype=torch.bool).index_fill_(
                0, levels[k]["parent"][keep], True)
    return masks


def build_batch(ro: dict, leaf_r: torch.Tensor, args: Args) -> dict:
    """The training rows (parent states: x, step, prompt) and the trained edges (row, x_next, old log-prob, a+, a-,
    w). Edge-once: one row per parent node with a trained edge; otherwise one row per (leaf, step), each leaf's
    path trained as its own chain (depth-wise: the node's advantage on every copy; uniform: the leaf's own)."""
    levels, T = ro["levels"], args.denoise_steps
    adv, masks = advantages(levels, leaf_r, args), train_mask(levels, leaf_r, ro["sde"], args)
    anc = [None] * (T + 1)  # anc[k][leaf]: the leaf's ancestor at level k
    anc[T] = torch.arange(len(leaf_r))
    for k in range(T, 0, -1):
        anc[k - 1] = levels[k]["parent"][anc[k]]
    leaf_a = group_standardise(leaf_r, levels[T]["tree"]).clamp(-args.adv_clip, args.adv_clip)
    rows, edges, n_rows = {"x": [], "k": [], "c": []}, {n: [] for n in ("row", "x_next", "lp", "pos", "neg", "w")}, 0
    for k in range(1, T + 1):
        lv, (pos, neg, w) = levels[k], adv[k]
        if args.edge_once:
            child = masks[k].nonzero().squeeze(1)
            parents, row = torch.unique(lv["parent"][child], return_inverse=True)
            terms = (pos[child], neg[child], w[child])
        else:
            leaves = masks[k][anc[k]].nonzero().squeeze(1)
            child = anc[k][leaves]
            parents, row = lv["parent"][child], torch.arange(len(leaves))
            a = leaf_a[leaves] if args.advantage == "uniform" else pos[child] + neg[child]
            terms = (a.clamp(min=0), a.clamp(max=0), torch.ones(len(a)))
        rows["x"].append(levels[k - 1]["x"][parents])
        rows["k"].append(torch.full((len(parents),), k - 1))
        rows["c"].append(ro["prompts"][levels[k - 1]["tree"][parents]])
        for name, val in zip(edges, (n_rows + row, lv["x"][child], lv["lp"][child], *terms)):
            edges[name].append(val)
        n_rows += len(parents)
    return {"rows": {n: torch.cat(v) for n, v in rows.items()}, "edges": {n: torch.cat(v) for n, v in edges.items()}}


# ---- loss and update ----
def ppo_loss(new_lp, old_lp, pos, neg, clip_eps: float):
    """Per-edge clipped loss -(a+ min(rho, clip rho) + a- max(rho, clip rho)); [E] each -> [E]."""
    rho = torch.exp(new_lp - old_lp)
    clipped = rho.clamp(1 - clip_eps, 1 + clip_eps)
    return -(pos * torch.minimum(rho, clipped) + neg * torch.maximum(rho, clipped))


def edge_logprobs(model, batch: dict, rows: torch.Tensor, args: Args):
    """New log-probs of the edges hanging off the given rows (one forward per row); -> (edge ids, log-probs)."""
    r, e = batch["rows"], batch["edges"]
    mean, std = sde_step(model, r["x"][rows], r["k"][rows], r["c"][rows], args.denoise_steps, args.eta)
    local = torch.full((len(r["x"]),), -1, dtype=torch.long)
    local[rows] = torch.arange(len(rows))
    ids = (local[e["row"]] >= 0).nonzero().squeeze(1)
    li = local[e["row"][ids]]
    return ids, gaussian_logprob(e["x_next"][ids], mean[li], std[li])


def update(model, opt, batch: dict, args: Args, gen: torch.Generator) -> dict:
    """--epochs passes, --minibatches optimiser steps each; the loss of every step is normalised by sum_e w_e.
    rollout/logprob_mismatch: max |stored - recomputed| log-prob over the first mini-batch, before any step."""
    n_rows, e = len(batch["rows"]["x"]), batch["edges"]
    total_w = e["w"].sum().clamp(min=1e-8)
    stats = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "mismatch": None}
    for _ in range(args.epochs):
        for rows in torch.randperm(n_rows, generator=gen).chunk(args.minibatches):
            ids, lp = edge_logprobs(model, batch, rows, args)
            if stats["mismatch"] is None:
                stats["mismatch"] = (lp.detach() - e["lp"][ids]).abs().max().item() if len(ids) else 0.0
            loss = ppo_loss(lp, e["lp"][ids], e["pos"][ids], e["neg"][ids], args.clip_eps).sum() / total_w
            opt.zero_grad()
            loss.backward()
            stats["grad_norm"] += nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            opt.step()
            stats["loss"] += loss.item()
            stats["clip_frac"] += ((lp.detach() - e["lp"][ids]).exp() - 1).abs().gt(args.clip_eps).sum().item()
    steps = args.epochs * min(args.minibatches, max(n_rows, 1))
    return {"loss/pg": stats["loss"] / args.epochs, "loss/clip_frac": stats["clip_frac"] / max(len(e["row"]), 1)
            / args.epochs, "loss/grad_norm": stats["grad_norm"] / steps,
            "rollout/logprob_mismatch": stats["mismatch"] or 0.0, "perf/train_nfe": n_rows * args.epochs,
            "perf/trained_edges": len(e["row"])}


# ---- eval and figure ----
@torch.no_grad()
def evaluate(model, args: Args, means: torch.Tensor) -> dict:
    """Mean reward of SDE and ODE samples of every mode from fixed noise (the same noise at every eval)."""
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    c = torch.arange(args.modes).repeat_interleave(args.eval_per_mode)
    x0, noise = torch.randn(len(c), 2, generator=gen), torch.randn(args.denoise_steps, len(c), 2, generator=gen)
    out = {}
    for name, eta in (("sde", args.eta), ("ode", 0.0)):
        x = x0
        for k in range(args.denoise_steps):
            mean, _ = sde_step(model, x, k, c, args.denoise_steps, eta)
            x = mean + eta * math.sqrt((1 - k / args.denoise_steps) / args.denoise_steps) * noise[k]
        out[name], out[f"{name}_x"] = reward(x, c, means, args.reward_scale).mean().item(), x
    out["c"] = c
    return out


def save_figure(path: Path, before: dict, after: dict, history: list[dict], means: torch.Tensor, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, ev, name in ((axes[0], before, "before"), (axes[1], after, "after")):
        ax.scatter(ev["sde_x"][:, 0], ev["sde_x"][:, 1], c=ev["c"], cmap="tab10", s=4, alpha=0.6)
        ax.scatter(means[:, 0], means[:, 1], c=range(len(means)), cmap="tab10", marker="x", s=80)
        ax.set(title=f"samples {name}: reward {ev['sde']:.2f}", aspect="equal",
               xlim=(-3.5, 3.5), ylim=(-3.5, 3.5))
    train = [h for h in history if "rollout/reward" in h]
    axes[2].plot([h["step"] for h in train], [h["rollout/reward"] for h in train], alpha=0.5, label="train reward")
    ev = [h for h in history if "eval/reward" in h]
    axes[2].plot([h["step"] for h in ev], [h["eval/reward"] for h in ev], "o-", label="eval reward (SDE)")
    axes[2].set(xlabel="iteration", ylabel="mean reward", ylim=(0, 1), title=title)
    axes[2].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out_dir) / args.exp_name
    tracker, timer = Tracker(out, args, args.track, run_name=args.exp_name), Timer()
    means = ring_means(args.modes, args.radius)
    model = pretrained_flow(args)
    set_seed(args.seed)
    before = evaluate(model, args, means)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    history, per_iter = [{"step": 0, "eval/reward": before["sde"], "eval/reward_ode": before["ode"]}], []
    tracker.log(history[0], 0)
    bar = tqdm(range(1, args.iters + 1), desc=args.exp_name, disable=None)
    for it in bar:
        with timer("rollout"):
            prompts = torch.randint(args.modes, (args.prompts_per_iter,), generator=gen)
            ro = rollout(model, prompts, args, sde_steps(args, it - 1), gen)
            leaf = ro["levels"][-1]
            leaf_r = reward(leaf["x"], prompts[leaf["tree"]], means, args.reward_scale)
        with timer("train"):
            batch = build_batch(ro, leaf_r, args)
            m = update(model, opt, batch, args, gen)
        times = timer.pop()
        n_leaves = len(leaf_r)
        m.update({"rollout/reward": leaf_r.mean().item(), "perf/rollout_nfe": ro["nfe"],
                  "perf/rollout_nfe_per_leaf": ro["nfe"] / n_leaves,
                  "perf/train_nfe_per_leaf": m["perf/train_nfe"] / n_leaves,
                  **{f"perf/{k}_s": v for k, v in times.items()}, "step": it})
        if it % args.eval_every == 0 or it == args.iters:
            ev = evaluate(model, args, means)
            m.update({"eval/reward": ev["sde"], "eval/reward_ode": ev["ode"]})
        if not math.isfinite(m["loss/pg"]):
            raise SystemExit(f"non-finite loss at iteration {it}: {m['loss/pg']}")
        history.append(m)
        per_iter.append(times)
        tracker.log(m, it)
        bar.set_postfix(reward=f"{m['rollout/reward']:.3f}")
    after = evaluate(model, args, means)
    summary = summarize(history, per_iter, before, after, args, time.perf_counter() - t0)
    if args.save_png:
        save_figure(out / "branch_grpo_flow.png", before, after, history, means,
                    f"{args.mode}: reward {before['sde']:.2f} -> {after['sde']:.2f}")
    return tracker.finish(summary)


def summarize(history: list[dict], per_iter: list[dict], before: dict, after: dict, args: Args, wall_s: float):
    """The run's figures (common.summarize reads held-out accuracy, which this task has not)."""
    train = [h for h in history if "rollout/reward" in h]
    mean = lambda key: sum(h[key] for h in train) / len(train)  # noqa: E731
    n = min(5, len(train))
    evals = [h["eval/reward"] for h in history[1:] if "eval/reward" in h]
    s = {"reward_start": before["sde"], "reward_end": after["sde"], "reward_auc": sum(evals) / len(evals),
         "reward_ode_start": before["ode"],
         "reward_ode_end": after["ode"],
         "train_reward_first": sum(h["rollout/reward"] for h in train[:n]) / n,
         "train_reward_last": sum(h["rollout/reward"] for h in train[-n:]) / n,
         "leaves_per_prompt": leaves_per_prompt(args), "rollout_nfe_per_leaf": mean("perf/rollout_nfe_per_leaf"),
         "train_nfe_per_leaf": mean("perf/train_nfe_per_leaf"), "rollout_nfe_per_iter": mean("perf/rollout_nfe"),
         "train_nfe_per_iter": mean("perf/train_nfe"), "trained_edges_per_iter": mean("perf/trained_edges"),
         "logprob_mismatch": max(h["rollout/logprob_mismatch"] for h in train),
         "rollout_s": sum(t.get("rollout", 0.0) for t in per_iter) / len(per_iter),
         "train_s": sum(t.get("train", 0.0) for t in per_iter) / len(per_iter), "wall_s": wall_s}
    s["nfe_ratio"] = s["rollout_nfe_per_leaf"] / args.denoise_steps  # DanceGRPO: T model calls per leaf
    s["train_nfe_ratio"] = s["train_nfe_per_leaf"] / (args.denoise_steps * args.epochs)
    s["iter_s"] = s["rollout_s"] + s["train_s"]
    print(f"mean reward {s['reward_start']:.3f} -> {s['reward_end']:.3f} (ODE {s['reward_ode_start']:.3f} -> "
          f"{s['reward_ode_end']:.3f}); rollout NFE per leaf {s['rollout_nfe_per_leaf']:.2f} (ratio to DanceGRPO "
          f"{s['nfe_ratio']:.2f}), training NFE per leaf {s['train_nfe_per_leaf']:.2f}; "
          f"{1e3 * s['iter_s']:.1f} ms per iteration, {wall_s:.0f} s")
    return s


if __name__ == "__main__":
    main(tyro.cli(Args))
