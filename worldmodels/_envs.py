"""Tiny batched gridworlds for the world-model scripts (a shared module, not a script).

A map is an M x M grid with a wall border, random interior walls and a few objects; one of the objects is
the goal. An agent moves with five discrete actions whose inverses are known:

    0 up, 1 down, 2 left, 3 right, 4 noop        INVERSE = [1, 0, 3, 2, 4]

A move into a wall leaves the agent in place; `step` then reports the *effective* action (noop), and the
effective action followed by its inverse always returns the same state (LIVE's reverse pass needs this).

Frames (`render`) are float32 arrays in [0, 1] of shape (N, 3, F, F):
    channel 0 walls (1 = wall), channel 1 objects (1.0 = goal, 0.5 = other object), channel 2 the agent.
- `view=None` (default): the whole map, allocentric, F = M * cell_px. The next frame is a function of the
  current frame and the action (the world is Markov in pixels).
- `view=V` (odd): an egocentric V x V window centred on the agent, F = V * cell_px; cells outside the map
  read as wall. With V < 2M - 1 part of the map is out of sight, so revisiting a place tests memory.

Everything is batched numpy: `collect(EnvConfig(), 1000, 32, seed=0)` draws 33,000 frames in well under a
second. Scripted policies of graded quality (`greedy_actions` with an epsilon) walk the shortest path to
the goal, with a probability `eps` of a random action instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_ACTIONS = 5
NOOP = 4
INVERSE = np.array([1, 0, 3, 2, 4], dtype=np.int64)
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1], [0, 0]], dtype=np.int64)  # (drow, dcol) per action
N_CHANNELS = 3
GOAL, OBJECT = 1.0, 0.5


@dataclass(frozen=True)
class EnvConfig:
    map_size: int = 10
    """M: cells per side, border walls included (>= 5)"""
    wall_density: float = 0.12
    """probability that an interior cell is a wall"""
    n_objects: int = 3
    """objects per map; the first is the goal"""
    view: int | None = None
    """None: whole map; odd V: egocentric V x V window"""
    cell_px: int = 1
    """pixels per cell side"""

    def __post_init__(self):
        if self.map_size < 5:
            raise ValueError(f"map_size must be >= 5, got {self.map_size}")
        if not 0.0 <= self.wall_density < 0.5:
            raise ValueError(f"wall_density must be in [0, 0.5), got {self.wall_density}")
        if self.n_objects < 1:
            raise ValueError(f"n_objects must be >= 1 (the goal), got {self.n_objects}")
        if self.view is not None and (self.view < 3 or self.view % 2 == 0):
            raise ValueError(f"view must be None or an odd number >= 3, got {self.view}")
        if self.cell_px < 1:
            raise ValueError(f"cell_px must be >= 1, got {self.cell_px}")

    @property
    def frame_size(self) -> int:
        return (self.view or self.map_size) * self.cell_px


def inverse(actions: np.ndarray) -> np.ndarray:
    """The action that undoes each (effective) action."""
    return INVERSE[np.asarray(actions)]


def _free_cells_reachable(walls: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Boolean (N, M, M): cells reachable from `start` (N, 2) without crossing walls (batched flood fill)."""
    n, m, _ = walls.shape
    reach = np.zeros_like(walls)
    reach[np.arange(n), start[:, 0], start[:, 1]] = True
    free = ~walls
    for _ in range(m * m):
        grown = reach.copy()
        grown[:, 1:] |= reach[:, :-1]
        grown[:, :-1] |= reach[:, 1:]
        grown[:, :, 1:] |= reach[:, :, :-1]
        grown[:, :, :-1] |= reach[:, :, 1:]
        grown &= free
        if (grown == reach).all():
            break
        reach = grown
    return reach


def distance_map(walls: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Shortest-path distance (N, M, M) from every free cell to `goal` (N, 2); unreachable = large."""
    n, m, _ = walls.shape
    big = m * m + 1
    dist = np.full(walls.shape, big, dtype=np.int64)
    dist[np.arange(n), goal[:, 0], goal[:, 1]] = 0
    free = ~walls
    for _ in range(m * m):
        nb = dist.copy()
        nb[:, 1:] = np.minimum(nb[:, 1:], dist[:, :-1] + 1)
        nb[:, :-1] = np.minimum(nb[:, :-1], dist[:, 1:] + 1)
        nb[:, :, 1:] = np.minimum(nb[:, :, 1:], dist[:, :, :-1] + 1)
        nb[:, :, :-1] = np.minimum(nb[:, :, :-1], dist[:, :, 1:] + 1)
        nb = np.where(free, nb, big)
        if (nb == dist).all():
            break
        dist = nb
    return dist


class GridWorld:
    """N independent maps stepped together. State: walls (N,M,M) bool, objects (N,M,M), pos (N,2), goal (N,2)."""

    def __init__(self, cfg: EnvConfig, n: int, seed: int):
        self.cfg, self.n = cfg, n
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> np.ndarray:
        cfg, n, m, rng = self.cfg, self.n, self.cfg.map_size, self.rng
        walls = rng.random((n, m, m)) < cfg.wall_density
        walls[:, 0, :] = walls[:, -1, :] = walls[:, :, 0] = walls[:, :, -1] = True
        # the agent starts on a random interior cell (cleared if it was a wall)
        pos = rng.integers(1, m - 1, size=(n, 2))
        walls[np.arange(n), pos[:, 0], pos[:, 1]] = False
        reach = _free_cells_reachable(walls, pos)
        small = reach.sum((1, 2)) < cfg.n_objects + 1  # boxed in: clear that map's interior walls
        walls[small, 1:-1, 1:-1] = False
        reach[small] = ~walls[small]
        walls |= ~reach  # fill unreachable pockets so every free cell is reachable
        objects = np.zeros((n, m, m), dtype=np.float32)
        goal = np.zeros((n, 2), dtype=np.int64)
        for i in range(n):
            cells = np.argwhere(reach[i])
            cells = cells[(cells != pos[i]).any(1)]  # never on the start cell
            k = min(cfg.n_objects, len(cells))
            pick = cells[rng.choice(len(cells), size=k, replace=False)]
            objects[i, pick[:, 0], pick[:, 1]] = OBJECT
            objects[i, pick[0, 0], pick[0, 1]] = GOAL
            goal[i] = pick[0]
        self.walls, self.objects, self.pos, self.goal = walls, objects, pos, goal
        self._dist = None
        return self.render()

    def state(self) -> tuple:
        return self.walls.copy(), self.objects.copy(), self.pos.copy(), self.goal.copy()

    def set_state(self, state: tuple) -> None:
        self.walls, self.objects, self.pos, self.goal = (s.copy() for s in state)
        self._dist = None

    def step(self, actions: np.ndarray) -> np.ndarray:
        """Apply actions (N,) in place; return the effective actions (noop where a wall blocked the move)."""
        actions = np.asarray(actions, dtype=np.int64)
        if actions.shape != (self.n,) or actions.min() < 0 or actions.max() >= N_ACTIONS:
            raise ValueError(f"actions must be ints in [0, {N_ACTIONS}) of shape ({self.n},)")
        target = self.pos + MOVES[actions]
        blocked = self.walls[np.arange(self.n), target[:, 0], target[:, 1]]
        self.pos = np.where(blocked[:, None], self.pos, target)
        return np.where(blocked, NOOP, actions)

    def at_goal(self) -> np.ndarray:
        return (self.pos == self.goal).all(1)

    def distance(self) -> np.ndarray:
        if self._dist is None:
            self._dist = distance_map(self.walls, self.goal)
        return self._dist

    def render(self) -> np.ndarray:
        return render(self.cfg, self.walls, self.objects, self.pos)


def render(cfg: EnvConfig, walls: np.ndarray, objects: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Frames (N, 3, F, F) float32 in [0, 1] (see the module docstring)."""
    n, m, _ = walls.shape
    img = np.zeros((n, N_CHANNELS, m, m), dtype=np.float32)
    img[:, 0] = walls
    img[:, 1] = objects
    img[np.arange(n), 2, pos[:, 0], pos[:, 1]] = 1.0
    if cfg.view is not None:
        v, h = cfg.view, cfg.view // 2
        pad = np.zeros((n, N_CHANNELS, m + 2 * h, m + 2 * h), dtype=np.float32)
        pad[:, 0] = 1.0  # outside the map reads as wall
        pad[:, :, h:h + m, h:h + m] = img
        rows = pos[:, 0, None] + np.arange(v)[None]  # (N, V) in padded coordinates
        cols = pos[:, 1, None] + np.arange(v)[None]
        img = pad[np.arange(n)[:, None, None, None], np.arange(N_CHANNELS)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
    if cfg.cell_px > 1:
        img = img.repeat(cfg.cell_px, axis=2).repeat(cfg.cell_px, axis=3)
    return np.ascontiguousarray(img)


# ---- policies ----
def random_actions(rng: np.random.Generator, n: int, t: int, repeat_p: float = 0.5) -> np.ndarray:
    """Sticky random moves (N, T): each step repeats the previous action with probability repeat_p."""
    acts = rng.integers(0, 4, size=(n, t))
    for j in range(1, t):
        keep = rng.random(n) < repeat_p
        acts[:, j] = np.where(keep, acts[:, j - 1], acts[:, j])
    return acts


def greedy_actions(dist: np.ndarray, pos: np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
    """Shortest-path move towards the goal (ties: first action), a uniform random move with probability eps.

    dist: (N, M, M) distance map; pos: (N, 2) agent cells. Works on positions decoded from imagined frames.
    """
    n, m, _ = dist.shape
    cand = pos[:, None, :] + MOVES[None, :4]  # (N, 4, 2)
    cand = np.clip(cand, 0, m - 1)
    d = dist[np.arange(n)[:, None], cand[..., 0], cand[..., 1]]  # (N, 4)
    best = d.argmin(1)
    rand = rng.integers(0, 4, size=n)
    return np.where(rng.random(n) < eps, rand, best)


def collect(cfg: EnvConfig, n: int, t: int, seed: int, repeat_p: float = 0.5, eps: float | None = None):
    """n trajectories of t steps. Returns frames (n, t+1, 3, F, F), actions (n, t), effective actions (n, t).

    eps=None: sticky random actions; else the greedy policy with that epsilon (the episode keeps going
    after the goal, so all trajectories have the same length).
    """
    if n < 1 or t < 1:
        raise ValueError(f"need n >= 1 and t >= 1, got n={n}, t={t}")
    env = GridWorld(cfg, n, seed)
    rng = np.random.default_rng(seed + 1)
    plan = random_actions(rng, n, t, repeat_p) if eps is None else None
    frames = [env.render()]
    acts, effs = [], []
    for j in range(t):
        a = plan[:, j] if plan is not None else greedy_actions(env.distance(), env.pos, eps, rng)
        effs.append(env.step(a))
        acts.append(a)
        frames.append(env.render())
    return np.stack(frames, 1), np.stack(acts, 1), np.stack(effs, 1)


def agent_cells(frames: np.ndarray, cfg: EnvConfig) -> np.ndarray:
    """Decode the agent's cell (.., 2) from (.., 3, F, F) frames (argmax of the agent channel, per cell)."""
    a = frames[..., 2, :, :]
    if cfg.cell_px > 1:
        s = a.shape
        a = a.reshape(*s[:-2], s[-2] // cfg.cell_px, cfg.cell_px, s[-1] // cfg.cell_px, cfg.cell_px).mean((-3, -1))
    flat = a.reshape(*a.shape[:-2], -1).argmax(-1)
    return np.stack([flat // a.shape[-1], flat % a.shape[-1]], -1)
