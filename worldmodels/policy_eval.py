"""Policy evaluation inside a learned world model (SC3-Eval), with forward-inverse consistency.

Parent: none.

Paper. "SC3-Eval: Evaluating Robot Foundation Models via Self-Consistent Video Generation" (arXiv:2606.18610):
evaluate policies by rolling them out in an action-conditioned world model instead of the real world, and judge
the evaluator by the Pearson correlation and the MMRV between world-model and real success rates (paper: 0.929
and 0.119 over seven real-world policies).

Method. A next-frame model f (teacher forcing, per-pixel Bernoulli, as in ar_world_model.py with K = 1) and an
inverse-dynamics head g(x_t, x_{t+1}) -> action are trained together; the consistency term asks g to recover
the action from the *predicted* next frame, which pushes f towards frames that show the requested move (g is
held fixed in that term: it is trained on real transitions only, so f cannot satisfy it with frames that merely
encode the action for a g that learned to read them).
Scripted policies are then run in the real gridworld and, from the same initial frames, inside the model: the
policy reads the agent cell from the imagined frame, and an episode succeeds when the (imagined) agent reaches the
goal. By default seven of graded quality (shortest path to the goal with a random action with probability eps);
`--policies` adds policies that differ in kind (`policy_actions`): a detour to a decoy object for K steps before
the goal (detour=K), the shortest path only within distance D of the goal and random moves elsewhere (near=D),
the shortest path with a noop with probability P (stall=P).
Test-time consistency: an imagined episode is terminated when g, applied to the imagined transition, gives
the expected action a probability below `term_threshold`; terminated episodes are left out of the estimate.

Equations (function that implements each):
  (1) forward loss      L_f = BCE(f(x_t, a_t), x_{t+1})                                           `forward_loss`
  (2) inverse loss      L_g = CE(g(x_t, x_{t+1}), a_t)                                            `inverse_loss`
  (3) consistency       L_c = CE(g(x_t, sigmoid f(x_t, a_t)), a_t), gradient into f only      `consistency_loss`
                        total L = L_f + L_g + lambda_c L_c                                         `main`
  (4) Pearson           r = cov(S, R) / (std S std R) over policies                              `pearson`
  (5) MMRV              MMRV = 1/N sum_i max_j |R_i - R_j| 1[(S_i < S_j) != (R_i < R_j)]          `mmrv`
                        R: real success rates, S: imagined ones (Li et al. 2024, SIMPLER, the definition
                        SC3-Eval reports)
  (6) next-state check  along real executed rollouts: one-step pixel MSE and agent-cell accuracy, and the
                        open-loop replay of the executed actions in the model                     `next_state_check`

Deviations:
- A pretrained video model, multi-view inpainting (cross-view consistency) and real robot policies are
  replaced by a small conv model, a single view and scripted gridworld policies; there is one camera, so
  cross-view consistency has nothing to act on and is left out.
- The termination rule (probability of the expected action under g below a threshold, terminated episodes
  dropped from the estimate) is our reading of "terminates rollouts whose generated frames drift away from
  the requested actions"; the expected action is the effective one (noop when the frame shows a wall).
- The policies' goal and walls are read from the initial frame (they are static in this world).
- The action enters f as one-hot planes and, by default, also multiplicatively (`--action-gate`: the frame times
  each action's indicator, `gated_planes` in _envs.py), with which one 3x3 convolution moves the agent.
- g is held fixed in eq. (3) (`--no-frozen-g` lets the term train g too). With g trained by the term, f and g
  agree on a code: f stops drawing the move and g reads the action from what f draws (gated model: one-step
  agent-cell accuracy 0.11 ± 0.13, MMRV 0.36 ± 0.22, 3 seeds; benchmarks/results/world_models.md).
- Other options: `--feedback snap` (imagined frames snapped to {0, 0.5, 1} before being fed back) and
  `--change-weight`. Imagined success and the accuracy checks count an agent only where exactly one is drawn.

Commands:
  python worldmodels/policy_eval.py                    # ~2-3 min on 1 CPU thread
  python worldmodels/policy_eval.py --train-eps 0.3    # train on greedy-policy data too
  python worldmodels/policy_eval.py --policies 0 0.5 1 detour=6 near=2 stall=0.5   # policies that differ in kind
  python worldmodels/policy_eval.py --device cuda --steps 10000 --channels 128
Expected result (benchmarks/results/world_models.md, policy-evaluation table, 3 seeds): the default ranks the
seven policies as the real gridworld does, Pearson 0.97 ± 0.01 and MMRV 0.00 ± 0.00 (imagined success 0.55 ...
0.03 against real 0.99 ... 0.08), one-step agent-cell accuracy 0.86 ± 0.12. Termination makes it slightly worse
(Pearson 0.93, MMRV 0.06, two thirds of the episodes terminated). `--consistency 0` ranks as well (0.97 / 0.00)
and tracks the agent better (one-step 0.97, open-loop agent error after 12 steps 0.36 vs 0.79): at this scale the
consistency term costs agent tracking without improving the ranking. `--no-action-gate`: Pearson 0.77 ± 0.20,
MMRV 0.18 ± 0.16. With six policies that differ in kind added to the seven (world_models_table.py's KINDS:
detour=6, detour=9, near=2, near=4, stall=0.5, stall=0.7), the same model ranks the thirteen less well: Pearson
0.87 ± 0.07, MMRV 0.13 ± 0.06, and the six others among themselves 0.59 ± 0.20 (3 seeds); it undercounts the
detours most (imagined 0.18 against real 0.67 for detour=6). A perfect model gives r = 1 and MMRV = 0 exactly
(tests/test_wm_policy_eval.py::test_true_dynamics_reproduce_real_success and ..._for_every_kind).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Literal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tqdm import tqdm

from worldmodels._envs import (GOAL, MOVES, N_ACTIONS, N_CHANNELS, NOOP, OBJECT, EnvConfig, GridWorld, RunArgs,
                               agent_cells, collect, conv_stack, distance_map, gated_planes, greedy_actions, optimiser,
                               start_run)


# ---- args ----
@dataclass
class Args(RunArgs):  # the fields all world-model scripts share: RunArgs in worldmodels/_envs.py
    exp_name: str = "policy_eval"
    out_dir: str = "runs/policy_eval"
    traj_len: int = 16
    steps: int = 800
    train_eps: float | None = None
    """None: sticky random training data; a number: half the data from the greedy policy with this eps"""
    consistency: float = 0.5
    """lambda_c in eq. (3); 0 turns forward-inverse consistency off"""
    frozen_g: bool = True
    """eq. (3) updates f only (g held fixed in it); --no-frozen-g lets it train g too"""
    policies: tuple[str, ...] = ("0", "0.1", "0.2", "0.35", "0.5", "0.7", "1")
    """the scripted policies (`parse_policy`): a number is the epsilon of the eps-greedy shortest path (0 = shortest
    path, 1 = random); detour=K (to a decoy object for K steps, then to the goal), near=D (shortest path within
    distance D of the goal, random moves elsewhere), stall=P (shortest path, noop with probability P)"""
    episodes: int = 200
    """episodes per policy, real and imagined"""
    horizon: int = 12
    """steps per episode"""
    term_threshold: float = 0.5
    """terminate an imagined episode when g gives the expected action less than this probability"""
    feedback: Literal["soft", "snap"] = "soft"
    """what an imagined step feeds back: probabilities, or the frame snapped to the pixel values {0, .5, 1}"""
    change_weight: float = 0.0
    """extra BCE weight on the pixels a step changed (the agent's old and new cells); 0: unweighted"""
    action_gate: bool = True
    """also feed the frame times each action's indicator (`gated_planes` in _envs.py) to the forward model"""


def check_args(args: Args) -> EnvConfig:
    if len(args.policies) < 2:
        raise SystemExit(f"--policies needs at least two policies, got {args.policies}")
    for spec in args.policies:
        parse_policy(spec)
    if args.train_eps is not None and not 0.0 <= args.train_eps <= 1.0:
        raise SystemExit(f"--train-eps must be in [0, 1], got {args.train_eps}")
    if args.episodes < 2 or args.horizon < 1:
        raise SystemExit(f"need --episodes >= 2 and --horizon >= 1, got {args.episodes}, {args.horizon}")
    if not 0.0 <= args.term_threshold < 1.0:
        raise SystemExit(f"--term-threshold must be in [0, 1), got {args.term_threshold}")
    if args.steps < 1 or args.batch_size < 1 or args.train_traj < 1 or args.consistency < 0:
        raise SystemExit("--steps, --batch-size, --train-traj must be >= 1 and --consistency >= 0")
    return EnvConfig(map_size=args.map_size, wall_density=args.wall_density)


# ---- model ----
class WorldModel(nn.Module):
    """forward(x (B,C,F,F), a (B,)) -> next-frame logits; inverse(x, x_next) -> action logits (B, A)."""

    def __init__(self, channels: int, action_gate: bool = False):
        super().__init__()
        self.action_gate = action_gate
        n_in = N_CHANNELS + N_ACTIONS + (N_ACTIONS * N_CHANNELS if action_gate else 0)
        self.f = conv_stack(n_in, channels, N_CHANNELS)
        self.g = conv_stack(2 * N_CHANNELS, channels, N_ACTIONS)

    def forward(self, x, a):
        b, _, h, w = x.shape
        planes = F.one_hot(a, N_ACTIONS).float()[:, :, None, None].expand(b, N_ACTIONS, h, w)
        gate = [gated_planes(x, a)] if self.action_gate else []
        return self.f(torch.cat([x, planes, *gate], 1))

    def inverse(self, x, x_next, g=None):
        """Action logits; g: the network to apply in place of self.g (consistency_loss passes g held fixed)."""
        return (g or self.g)(torch.cat([x, x_next], 1)).amax(dim=(2, 3))  # max-pool: the move happens in one place


# ---- losses ----
def forward_loss(model: WorldModel, x, a, x_next, change_weight: float = 0.0):
    """Eq. (1), the pixels where x_next != x weighted 1 + change_weight. Returns (loss, logits)."""
    logits = model(x, a)
    w = 1.0 + change_weight * (x_next != x).float() if change_weight else None
    return F.binary_cross_entropy_with_logits(logits, x_next, weight=w), logits


def feed(logits: torch.Tensor, feedback: str) -> torch.Tensor:
    """The imagined frame fed back: sigmoid(logits), snapped to {0, 0.5, 1} if feedback == 'snap'."""
    p = torch.sigmoid(logits)
    return torch.round(p * 2) / 2 if feedback == "snap" else p


def inverse_loss(model: WorldModel, x, a, x_next_or_pred):
    """Eq. (2) on a true next frame (and eq. (3) on a predicted one when g may learn from it too)."""
    return F.cross_entropy(model.inverse(x, x_next_or_pred), a)


def consistency_loss(model: WorldModel, x, a, pred):
    """Eq. (3) with g held fixed: its gradient goes into f only. A g also trained on predicted frames learns to
    read the action from whatever f draws, and f then need not move the agent."""
    params = {k: v.detach() for k, v in model.g.named_parameters()}
    fixed_g = lambda inp: torch.func.functional_call(model.g, params, (inp,))  # noqa: E731
    return F.cross_entropy(model.inverse(x, pred, g=fixed_g), a)


# ---- evaluation metrics ----
def pearson(s, r) -> float:
    """Eq. (4). Zero-variance inputs give nan."""
    s, r = np.asarray(s, float), np.asarray(r, float)
    s, r = s - s.mean(), r - r.mean()
    den = np.sqrt((s ** 2).sum() * (r ** 2).sum())
    return float((s * r).sum() / den) if den > 0 else float("nan")


def mmrv(real, imagined) -> float:
    """Eq. (5): mean over policies of the largest real-success gap among pairs whose order the model flips."""
    r, s = np.asarray(real, float), np.asarray(imagined, float)
    if r.shape != s.shape or r.ndim != 1 or len(r) < 2:
        raise ValueError(f"mmrv needs two 1-D arrays of equal length >= 2, got {r.shape} and {s.shape}")
    flipped = (s[:, None] < s[None, :]) != (r[:, None] < r[None, :])
    return float((np.abs(r[:, None] - r[None, :]) * flipped).max(1).mean())


# ---- scripted policies ----
POLICY_KINDS = ("eps", "detour", "near", "stall")


def parse_policy(spec) -> tuple[str, float]:
    """'0.2' or 'eps=0.2' -> ('eps', 0.2); 'detour=K', 'near=D' (whole numbers >= 0); 'stall=P' (P in [0, 1])."""
    kind, _, val = str(spec).strip().rpartition("=")
    kind = kind or "eps"
    try:
        v = float(val)
    except ValueError:
        v = math.nan
    ok = kind in POLICY_KINDS and (0.0 <= v <= 1.0 if kind in ("eps", "stall") else v >= 0 and v == int(v))
    if not ok:
        raise SystemExit(f"--policies: cannot read {spec!r}; a policy is a number in [0, 1] (eps), detour=K, near=D "
                         "(whole numbers) or stall=P (P in [0, 1])")
    return kind, v


def policy_label(spec) -> str:
    kind, v = parse_policy(spec)
    return f"{kind}={v:g}"


def decoy_cells(objects: np.ndarray) -> np.ndarray:
    """(N, 2): each map's first non-goal object in raster order (the goal itself where there is none)."""
    flat = objects.reshape(len(objects), -1)
    idx = np.where((flat == OBJECT).any(1), (flat == OBJECT).argmax(1), (flat == GOAL).argmax(1))
    return np.stack([idx // objects.shape[-1], idx % objects.shape[-1]], 1)


def policy_actions(policy: tuple[str, float], dist: np.ndarray, dist_decoy: np.ndarray, cells: np.ndarray, t: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Actions (N,) of a parsed policy at step t from the agent cells (N, 2) it reads; dist / dist_decoy: (N, M, M)
    shortest-path distances to the goal and to the decoy object. eps draws from rng exactly as greedy_actions."""
    kind, v = policy
    n = len(cells)
    if kind == "eps":
        return greedy_actions(dist, cells, v, rng)
    if kind == "detour":  # prefers the wrong target: shortest path to the decoy for the first K steps
        return greedy_actions(dist_decoy if t < v else dist, cells, 0.0, rng)
    best = greedy_actions(dist, cells, 0.0, rng)
    if kind == "near":  # competent only close to the goal
        d = dist[np.arange(n), cells[:, 0], cells[:, 1]]
        return np.where(d <= v, best, rng.integers(0, 4, size=n))
    return np.where(rng.random(n) < v, NOOP, best)  # stall: stands still with probability P


# ---- rollouts ----
def expected_action(walls: np.ndarray, cells: np.ndarray, acts: np.ndarray) -> np.ndarray:
    """The effective action the frame implies: noop where the target cell is a wall."""
    n, m, _ = walls.shape
    tgt = np.clip(cells + MOVES[acts], 0, m - 1)
    return np.where(walls[np.arange(n), tgt[:, 0], tgt[:, 1]], NOOP, acts)


def run_real(cfg: EnvConfig, policy, n: int, horizon: int, seed: int):
    """Real episodes of a policy spec. Returns success (n,), frames (n, T+1, C, F, F), effective actions (n, T)."""
    env = GridWorld(cfg, n, seed)
    rng = np.random.default_rng(seed + 7)
    pol = parse_policy(policy)
    dist_decoy = distance_map(env.walls, decoy_cells(env.objects)) if pol[0] == "detour" else None
    done = np.zeros(n, bool)
    frames, effs = [env.render()], []
    for t in range(horizon):
        effs.append(env.step(policy_actions(pol, env.distance(), dist_decoy, env.pos, t, rng)))
        frames.append(env.render())
        done |= env.at_goal()
    return done, np.stack(frames, 1), np.stack(effs, 1)


@torch.no_grad()
def run_imagined(model: WorldModel, cfg: EnvConfig, policy, n: int, horizon: int, seed: int, thr: float,
                 feedback: str = "soft"):
    """Imagined episodes from the same initial frames. Returns success (n,), terminated (n,), frames."""
    env = GridWorld(cfg, n, seed)  # only its initial frame and static layout are used
    rng = np.random.default_rng(seed + 7)
    pol = parse_policy(policy)
    walls, goal = env.walls, env.goal
    dist = distance_map(walls, goal)
    dist_decoy = distance_map(walls, decoy_cells(env.objects)) if pol[0] == "detour" else None
    x = torch.from_numpy(env.render())
    done, term = np.zeros(n, bool), np.zeros(n, bool)
    frames = [x.numpy()]
    for t in range(horizon):
        cells = agent_cells(x.numpy(), cfg)
        a = policy_actions(pol, dist, dist_decoy, cells, t, rng)
        nxt = feed(model(x, torch.from_numpy(a)), feedback)
        probs = torch.softmax(model.inverse(x, nxt), -1).numpy()
        exp_a = expected_action(walls, cells, a)
        term |= ~done & (probs[np.arange(n), exp_a] < thr)
        x = nxt
        frames.append(x.numpy())
        done |= (agent_cells(x.numpy(), cfg, strict=True) == goal).all(1)  # an agent drawn on the goal
    return done, term, np.stack(frames, 1)


@torch.no_grad()
def next_state_check(model: WorldModel, cfg: EnvConfig, frames: np.ndarray, effs: np.ndarray,
                     feedback: str = "soft") -> dict:
    """Eq. (6): one-step and open-loop agreement with real executed rollouts (frames (n, T+1, ...))."""
    n, t = effs.shape
    x = torch.from_numpy(frames[:, :-1].reshape(n * t, *frames.shape[2:]))
    a = torch.from_numpy(effs.reshape(-1))
    one = torch.sigmoid(model(x, a)).numpy().reshape(frames[:, 1:].shape)
    cur, open_loop = torch.from_numpy(frames[:, 0]), []
    for j in range(t):
        cur = feed(model(cur, torch.from_numpy(effs[:, j])), feedback)
        open_loop.append(cur.numpy())
    open_loop = np.stack(open_loop, 1)
    hit = lambda p: (agent_cells(p, cfg, strict=True) == agent_cells(frames[:, 1:], cfg)).all(-1)  # (n, T)
    return {"one_step_mse": float(((one - frames[:, 1:]) ** 2).mean()), "one_step_agent_acc": float(hit(one).mean()),
            "open_loop_mse": ((open_loop - frames[:, 1:]) ** 2).mean(axis=(0, 2, 3, 4)),
            "open_loop_agent_acc": hit(open_loop).mean(0)}


def save_figure(path: Path, real, imag, imag_term, labels, r, m) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 4))
    ax.plot([0, 1], [0, 1], ":", color="grey")
    ax.scatter(real, imag, label=f"imagined (r={r:.3f}, MMRV={m:.3f})")
    ax.scatter(real, imag_term, marker="x", label="with inverse-dynamics termination")
    for e, x, y in zip(labels, real, imag):
        ax.annotate(e, (x, y), fontsize=6, xytext=(3, -8), textcoords="offset points")
    ax.set_xlabel("real success"), ax.set_ylabel("world-model success"), ax.legend(fontsize=7)
    ax.set_title("Scripted policies evaluated in the world model", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    cfg = check_args(args)
    t0 = time.perf_counter()
    device, tracker, timer = start_run(args)

    if args.train_eps is None:
        fr, _, eff = collect(cfg, args.train_traj, args.traj_len, seed=args.seed)
    else:
        half = args.train_traj // 2
        f1, _, e1 = collect(cfg, half, args.traj_len, seed=args.seed)
        f2, _, e2 = collect(cfg, args.train_traj - half, args.traj_len, seed=args.seed + 1, eps=args.train_eps)
        fr, eff = np.concatenate([f1, f2]), np.concatenate([e1, e2])
    x_all = torch.from_numpy(fr[:, :-1].reshape(-1, *fr.shape[2:])).to(device)
    y_all = torch.from_numpy(fr[:, 1:].reshape(-1, *fr.shape[2:])).to(device)
    a_all = torch.from_numpy(eff.reshape(-1)).to(device)

    model = WorldModel(args.channels, args.action_gate).to(device)
    opt, sched = optimiser(model, args.lr, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc=args.exp_name, disable=None)
    for step in bar:
        with timer("train"):
            idx = torch.randint(0, len(a_all), (args.batch_size,), generator=gen)
            x, a, y = x_all[idx], a_all[idx], y_all[idx]
            lf, logits = forward_loss(model, x, a, y, args.change_weight)
            lg = inverse_loss(model, x, a, y)
            lc = ((consistency_loss if args.frozen_g else inverse_loss)(model, x, a, torch.sigmoid(logits))
                  if args.consistency > 0 else torch.zeros(()))
            loss = lf + lg + args.consistency * lc
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            tracker.log({"loss/forward": lf.item(), "loss/inverse": lg.item(), "loss/consistency": lc.item(),
                         **{f"perf/{n}_s": v for n, v in timer.pop().items()}}, step)
            bar.set_postfix(fwd=f"{lf.item():.4f}", inv=f"{lg.item():.3f}")

    model.eval().cpu()
    real, imag, imag_t, term_frac, checks = [], [], [], [], []
    for i, spec in enumerate(args.policies):
        seed = args.seed + 20_000 + i
        r_succ, r_frames, r_effs = run_real(cfg, spec, args.episodes, args.horizon, seed)
        i_succ, i_term, _ = run_imagined(model, cfg, spec, args.episodes, args.horizon, seed, args.term_threshold,
                                         args.feedback)
        keep = ~i_term
        real.append(r_succ.mean())
        imag.append(i_succ.mean())
        imag_t.append(i_succ[keep].mean() if keep.any() else i_succ.mean())
        term_frac.append(i_term.mean())
        checks.append(next_state_check(model, cfg, r_frames, r_effs, args.feedback))
        tracker.log({"eval/real_success": real[-1], "eval/imagined_success": imag[-1],
                     "eval/imagined_success_term": imag_t[-1], "eval/terminated": term_frac[-1]}, i)
    r, m = pearson(imag, real), mmrv(real, imag)
    rt, mt = pearson(imag_t, real), mmrv(real, imag_t)
    ol_mse = np.mean([c["open_loop_mse"] for c in checks], 0)
    ol_acc = np.mean([c["open_loop_agent_acc"] for c in checks], 0)
    summary = {"err_h1": float(ol_mse[0]), f"err_h{args.horizon}": float(ol_mse[-1]),
               "agent_err_h1": float(1 - ol_acc[0]), f"agent_err_h{args.horizon}": float(1 - ol_acc[-1]),
               "pearson": r, "mmrv": m, "pearson_term": rt, "mmrv_term": mt,
               "terminated_frac": float(np.mean(term_frac)),
               "one_step_agent_acc": float(np.mean([c["one_step_agent_acc"] for c in checks])),
               "one_step_mse": float(np.mean([c["one_step_mse"] for c in checks])),
               "real_success": [float(v) for v in real], "imagined_success": [float(v) for v in imag],
               "imagined_success_term": [float(v) for v in imag_t]}
    is_eps = np.array([parse_policy(p)[0] == "eps" for p in args.policies])
    if 2 <= is_eps.sum() <= len(is_eps) - 2:  # a mixed set: the ranking within each part as well
        for name, sel in (("eps", is_eps), ("kinds", ~is_eps)):
            ri, si = np.asarray(real)[sel], np.asarray(imag)[sel]
            summary[f"pearson_{name}"], summary[f"mmrv_{name}"] = pearson(si, ri), mmrv(ri, si)
    if args.save_png:
        save_figure(Path(args.out_dir) / "policy_eval.png", real, imag, imag_t,
                    [policy_label(p) for p in args.policies], r, m)
    summary["wall_s"] = time.perf_counter() - t0
    return tracker.finish(summary)


if __name__ == "__main__":
    out = main(tyro.cli(Args))
    print({k: (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v]) for k, v in out.items()})
