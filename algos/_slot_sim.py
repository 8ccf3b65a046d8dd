"""The slot simulator of algos/partial_rollout.py: how a rollout scheduler uses S decode slots, without a model.

Event-driven and exact (numpy, seconds): between two finishes every busy slot makes one token per tick; a tick costs
c0 + c1 * busy slots (PRESETS: measured for the tiny CPU model, a roofline estimate for a 7B model on a GPU). It
drives the scheduler it is given (algos/partial_rollout.py's Scheduler, with trajectories of its Traj class), so that
the simulator and the real chunked loop share one scheduling policy, and so does a copy of the script with a new
policy. Colocated policies (sync, april, copris) pause generation while training; async keeps generating and trains
in parallel (a version bump when a training step ends). Figures: idle-slot fraction = idle slot-ticks / (S * ticks),
tokens/s over generation time, step time with training, tokens discarded (generated - trained - in flight) and the
age (trainer version - sampling version) of every trained token. Used by algos/partial_rollout.py (its summary) and
benchmarks/partial_rollout_table.py; tests/test_partial_rollout.py checks it against closed forms.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter

import numpy as np

from algos import _llm as llm

# (c0 s per tick, c1 s per busy slot per tick, training s per step). cpu: tiny-sums decode steps measured on one
# thread of the 2-core test machine (4.3 ms at 1 row, 26 ms at 256 rows), training 1.0 s per 256-sequence step.
# gpu: a roofline estimate, not a measurement: a 7B model in bf16 with grouped KV heads (8 x 128, 32 layers) on a
# 3.3 TB/s GPU reads 14 GB of weights per decode step (c0 = 4.5 ms) and 128 KB of KV cache per context token, about
# 0.26 GB for a 2k-token context (c1 = 0.08 ms per busy slot); training takes GPU_TRAIN_FRAC of a synchronous step.
PRESETS = {"cpu": (4.3e-3, 8.5e-5, 1.0), "gpu": (4.5e-3, 8e-5, 0.0)}
GPU_TRAIN_FRAC = 0.1  # rollout is "more than 90% of total runtime" (APRIL's abstract)


def draw_lengths(kind: str, sigma: float, median: int = 64, cap: int = 1024):
    """A length sampler rng, G -> G response lengths: lognormal(log median, sigma) per response, capped; or the
    reference length (characters + EOS) of one sums-task prompt with the operand-count mix, for the whole group."""
    if kind == "lognormal":
        return lambda rng, G: np.clip(np.round(median * np.exp(sigma * rng.standard_normal(G))), 1, cap).astype(int)
    task = llm.SumsTask("mix", 1)
    return lambda rng, G: np.full(G, len(task.sample("train", 1, rng)[0].solution) + 1)


class SlotSim:
    """The simulator's state: a clock in ticks, the time `now` those ticks cost, the busy slot-ticks, the weights
    version, the heap of finish ticks of the running trajectories and the age histogram of trained tokens."""

    def __init__(self, sched, c0: float, c1: float):
        self.sched, self.c0, self.c1 = sched, c0, c1
        self.clock, self.now, self.busy, self.version, self.trained_steps, self.seq = 0, 0.0, 0, 0, 0, 0
        self.heap = []  # (finish tick, seq, traj) of the running trajectories
        self.placed_at, self.ages = {}, Counter()  # id(traj) -> tick of its (re)placement; age -> trained tokens

    def place(self) -> None:
        for t in self.sched.fill():
            self.placed_at[id(t)] = self.clock
            heapq.heappush(self.heap, (self.clock + t.target - t.n, self.seq, t))
            self.seq += 1

    def close(self, t) -> None:
        """Credit the tokens made since placement (or the last version bump) to the current version."""
        self.sched.record(t, self.clock - self.placed_at[id(t)], self.version)
        self.placed_at[id(t)] = self.clock

    def close_running(self) -> None:
        for t in list(self.sched.running.values()):
            self.close(t)

    def advance(self, k: int) -> None:
        active = len(self.sched.running)
        self.now += k * (self.c0 + self.c1 * active)
        self.busy += k * active
        self.clock += k

    def pop_finished(self) -> None:
        while self.heap and self.heap[0][0] == self.clock:
            t = heapq.heappop(self.heap)[2]
            self.close(t)
            self.sched.finish(t)

    def train(self) -> None:
        for g in self.sched.harvest():
            for t in g:
                for v, c in t.segs:
                    self.ages[self.version - v] += c

    def end_training_step(self) -> None:
        """Async: the running rows keep decoding, their later tokens under the new weights."""
        self.close_running()
        self.version, self.trained_steps = self.version + 1, self.trained_steps + 1


def run_colocated(sim: SlotSim, steps: int, policy: str, slots: int) -> None:
    """sync, april, copris: decode until B groups are complete, interrupt, train (generation paused), repeat."""
    for _ in range(steps):
        sim.sched.begin_step()
        while not sim.sched.ready():
            sim.place()
            if not sim.heap:
                raise RuntimeError(f"{policy}: no trajectory can run (slots {slots})")
            sim.advance(sim.heap[0][0] - sim.clock)
            sim.pop_finished()
        sim.close_running()  # interrupted: partial tokens stay with the trajectory
        sim.heap.clear()
        sim.sched.end_step()
        sim.train()
        sim.version += 1


def run_async(sim: SlotSim, steps: int, train_s: float) -> None:
    """async: the pool never stops; a training step starts once B groups are complete and lasts train_s."""
    train_end = None
    while sim.trained_steps < steps:
        sim.place()
        dt = sim.c0 + sim.c1 * len(sim.sched.running)
        k = sim.heap[0][0] - sim.clock
        if train_end is not None:
            k = min(k, max(1, math.ceil((train_end - sim.now) / dt - 1e-9)))
        sim.advance(k)
        if train_end is not None and sim.now >= train_end - 1e-12:
            sim.end_training_step()
            train_end = None
        sim.pop_finished()
        while train_end is None and sim.sched.ready() and sim.trained_steps < steps:
            sim.train()
            if train_s > 0:
                train_end = sim.now + train_s
            else:
                sim.end_training_step()


def simulate(scheduler, traj, policy: str, lengths, steps: int, groups: int, group_size: int, slots: int,
             over: float = 2.0, c0: float = 1.0, c1: float = 0.0, train_s: float = 0.0, seed: int = 0) -> dict:
    """Event-driven slot simulation of `policy` on the scheduler class `scheduler` with trajectories of class `traj`.

    Returns idle-slot fraction, tokens/s (generation time), step time (with training), discarded tokens and the age
    histogram of trained tokens.
    """
    rng = np.random.default_rng(seed)
    sched = scheduler(policy, groups, group_size, slots, over,
                      lambda gid: [traj(gid, target=int(L)) for L in lengths(rng, group_size)])
    sim = SlotSim(sched, c0, c1)
    if policy == "async":
        run_async(sim, steps, train_s)
        gen_s = wall = sim.now
    else:
        run_colocated(sim, steps, policy, slots)
        gen_s, wall = sim.now, sim.now + steps * train_s
    sim.close_running()  # async: count the tokens of the rows still decoding
    sched.check()
    ages, n_aged = sim.ages, sum(sim.ages.values())
    return {"idle_frac": 1 - sim.busy / max(1, slots * sim.clock), "tokens_per_s": sched.generated / gen_s,
            "gen_s_per_step": gen_s / steps, "step_s": wall / steps, "generated": sched.generated,
            "trained_tokens": sched.trained, "discarded_tokens": sched.discarded_tokens(),
            "mean_age": sum(a * c for a, c in ages.items()) / n_aged, "max_age": max(ages),
            **{f"age_frac_{a}": ages.get(a, 0) / n_aged for a in (0, 1, 2)},
            "age_frac_3plus": sum(c for a, c in ages.items() if a >= 3) / n_aged}


def compare_policies(scheduler, traj, kind: str, sigma: float, preset: str, steps: int, groups: int, group_size: int,
                     slots: int, over: float, seed: int,
                     policies=("sync", "april", "copris", "async")) -> dict[str, dict]:
    """simulate() for each policy on the same length law and cost model; the gpu preset's training time is
    GPU_TRAIN_FRAC of the synchronous rollout time per step (measured here, first)."""
    c0, c1, train_s = PRESETS[preset]
    out = {}
    for policy in policies:
        out[policy] = simulate(scheduler, traj, policy, draw_lengths(kind, sigma), steps, groups, group_size, slots,
                               over, c0, c1, train_s, seed)
        if preset == "gpu" and policy == "sync" and not train_s:
            train_s = GPU_TRAIN_FRAC * out["sync"]["gen_s_per_step"]
            out["sync"] = simulate(scheduler, traj, "sync", draw_lengths(kind, sigma), steps, groups, group_size,
                                   slots, over, c0, c1, train_s, seed)
    return out
