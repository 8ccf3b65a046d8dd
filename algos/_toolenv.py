"""A small multi-turn text environment that ships with the repository: a key-value store the policy must query.

Each episode hides a store of `n_keys` letter keys holding `digits`-digit values and asks for the sum of `n_query`
of them. The prompt names the keys only (`b+d+a?`); the values reach the policy through the environment's answers,
so it has to act, read what the environment says, and act again:

    b+d+a?  #b  =4;  #d  =7;  #a  =2;  !13        (prompt, then action / observation turns, then the answer)

Actions (one per turn, each ended by EOS in token space):
    #k    look key k up              -> observation `=V;` (the value)
    !N  or  !X+Y=N                   -> the episode ends; reward 1 if N is the sum, else 0 (X+Y= is an optional
                                        scratchpad, not checked; the expert answers `!N`)
    anything else, or a key that is not in the store -> the error observation `err;` (never an exception)
Limits, each ending the episode with reward LIMIT_REWARD = 0 and the observation `end;`:
    the turn limit   `max_turns` actions without an answer
    the context limit the transcript (prompt + actions + observations, in characters) would pass `max_context`

`reset(seed)` is deterministic in the seed. An episode (its store and its query) is held out when a hash of it is
0 mod 10, so training never plays a held-out episode (the prompt does not show the values, so a split on the
values alone would test nothing the policy sees). The state is the transcript, so exact stepwise values are defined for any policy, and
`expert_action` gives the shortest solution (the SFT traces).

Shared by algos/sft.py (traces, per-turn accuracy of the shipped `tiny-toolenv`), algos/multiturn_grpo.py,
algos/echo.py and algos/hgpo.py: the environment, the turn-by-turn episode runner `play` (batched generation through
`common.generate`, observation tokens appended to each context), and the held-out evaluation.
"""
from __future__ import annotations

import copy
import hashlib
import re
import string
from dataclasses import dataclass, field

import numpy as np
import torch

import common
from algos import _llm as llm

LIMIT_REWARD = 0.0  # reward of an episode ended by the turn or the context limit (and of a wrong answer)
ERROR_OBS = "err;"
END_OBS = "end;"


class LookupEnv:
    """gymnasium-like: `reset(seed) -> observation` (the prompt), `step(action_text) -> (observation, reward, done)`."""

    def __init__(self, n_keys: int = 4, digits: int = 1, max_turns: int = 5, max_context: int = 40, n_query: int = 3):
        if not 2 <= n_query <= n_keys <= 26 or not 1 <= digits <= 4 or max_turns < 1 or max_context < 8:
            raise ValueError(f"LookupEnv needs 2 <= n_query <= n_keys <= 26, 1 <= digits <= 4, max_turns >= 1, "
                             f"max_context >= 8; got {n_query}, {n_keys}, {digits}, {max_turns}, {max_context}")
        self.n_keys, self.digits, self.max_turns, self.max_context = n_keys, digits, max_turns, max_context
        self.n_query, self.name = n_query, f"lookup{n_query}of{n_keys}d{digits}"
        self.done, self.transcript = True, ""

    @staticmethod
    def episode(seed: int, n_keys: int = 4, digits: int = 1, n_query: int = 3) -> tuple[dict, tuple]:
        """(store, queried keys) of episode `seed`: a pure function of its arguments."""
        rng = np.random.default_rng([7919, int(seed)])
        keys = rng.choice(list(string.ascii_lowercase[:8 if n_keys <= 8 else 26]), n_keys, replace=False)
        values = rng.integers(0, 10 ** digits, size=n_keys)
        store = {str(k): int(v) for k, v in zip(keys, values)}
        return store, tuple(str(k) for k in rng.choice(keys, n_query, replace=False))

    def is_held_out(self, seed: int) -> bool:
        store, query = self.episode(seed, self.n_keys, self.digits, self.n_query)
        return int(hashlib.md5(repr((sorted(store.items()), query)).encode()).hexdigest(), 16) % 10 == 0

    def seeds(self, split: str, n: int, rng: np.random.Generator) -> list[int]:
        """n episode seeds of 'train' or 'test' drawn with `rng`."""
        out = []
        while len(out) < n:
            s = int(rng.integers(0, 2**31 - 1))
            if self.is_held_out(s) == (split == "test"):
                out.append(s)
        return out

    def reset(self, seed: int) -> str:
        self.seed = int(seed)
        self.store, self.query = self.episode(seed, self.n_keys, self.digits, self.n_query)
        self.answer = sum(self.store[k] for k in self.query)
        self.turns, self.done, self.reward = 0, False, 0.0
        self.transcript = "+".join(self.query) + "?"
        return self.transcript

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(seed)")
        self.turns += 1
        self.transcript += action
        a = action.strip()
        obs, reward, done = ERROR_OBS, 0.0, False
        if re.fullmatch(r"#[a-z]", a) and a[1] in self.store:
            obs = f"={self.store[a[1]]};"
        elif re.fullmatch(r"!(\d{1,6}\+\d{1,6}=)?\d{1,6}", a):
            obs, reward, done = "", float(int(a.rsplit("=", 1)[-1].lstrip("!")) == self.answer), True
        if not done and (self.turns >= self.max_turns or len(self.transcript) + len(obs) > self.max_context):
            obs, reward, done = END_OBS, LIMIT_REWARD, True
        self.transcript += obs
        self.done, self.reward = done, reward
        return obs, reward, done

    def expert_action(self) -> str:
        """The shortest solution's next action: look up the queried keys in order, then answer their sum `!N`."""
        for k in self.query:
            if f"#{k}" not in self.transcript:
                return f"#{k}"
        return f"!{self.answer}"

    def clone(self) -> "LookupEnv":
        return copy.deepcopy(self)


# ---- SFT traces ----
@dataclass
class TraceExample(llm.Example):
    """An expert episode for algos/sft.py: `turns` = [(action, observation), ...]; only actions are trained on."""
    turns: list = field(default_factory=list)
    seed: int = 0


class TraceTask:
    """The environment as an SFT task (`python algos/sft.py --tasks toolenv`): expert traces, held-out evaluation."""

    def __init__(self, env: LookupEnv | None = None, max_action_tokens: int = 6):
        self.env, self.max_action_tokens = env or LookupEnv(), max_action_tokens
        self.name, self.kind = "toolenv", "toolenv"

    def trace(self, seed: int) -> TraceExample:
        env = self.env.clone()
        prompt, turns = env.reset(seed), []
        while not env.done:
            a = env.expert_action()
            obs, _, _ = env.step(a)
            turns.append((a, obs))
        return TraceExample(prompt=prompt, answer=str(env.answer), solution=env.transcript[len(prompt):],
                            turns=turns, seed=seed)

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[TraceExample]:
        return [self.trace(s) for s in self.env.seeds(split, n, rng)]

    def evaluate(self, model, tok, examples: list, max_new_tokens: int = 0, pass_k: int = 0) -> dict:
        """Greedy episode success, and per-turn accuracy (the greedy action equals the expert's, given the expert's
        history) for every turn index."""
        res = evaluate(model, tok, self.env, [e.seed for e in examples], self.max_action_tokens)
        return {"acc": res["success"], **{k: v for k, v in res.items() if k != "success"}}


# ---- the turn-by-turn episode runner ----
@dataclass
class Episode:
    """One finished episode. `ids` are the tokens after the initial context: actions (kind 1, sampled, EOS
    included when the policy stopped) and observations (kind 2, written by the environment)."""
    env: LookupEnv
    ids: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    turn: list = field(default_factory=list)  # turn index of each token (0-based, counted from the start state)
    actions: list = field(default_factory=list)  # action texts, in order
    observations: list = field(default_factory=list)
    truncated: int = 0  # actions that hit the token budget without EOS
    reward: float = 0.0


def encode_obs(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


@torch.no_grad()
def play(policy, tok, envs: list[LookupEnv], contexts: list[list[int]], max_action_tokens: int,
         temperature: float = 1.0, greedy: bool = False, first_turn: int = 0) -> list[Episode]:
    """Run every (env, context) to the end, one batched generation per turn: the sampled action (with its
    behaviour log-probs) and then the environment's observation tokens are appended to each context. `policy`: a
    common.Sampler (its copy or its vLLM engine) or a model, as common.generate takes it."""
    eps = [Episode(env) for env in envs]
    ctx = [list(c) for c in contexts]
    t = first_turn
    while True:
        live = [i for i, e in enumerate(eps) if not e.env.done]
        if not live:
            return eps
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, temperature,
                             greedy=greedy)
        for row, i in enumerate(live):
            e, n = eps[i], int(ro.completion_mask[row].sum())
            a_ids = ro.completion_ids[row, :n].tolist()
            obs, r, done = e.env.step(ro.texts[row])
            o_ids = encode_obs(tok, obs)
            e.ids += a_ids + o_ids
            e.kind += [1] * n + [2] * len(o_ids)
            e.logprobs += ro.logprobs[row, :n].tolist() + [0.0] * len(o_ids)
            e.turn += [t] * (n + len(o_ids))
            e.actions.append(ro.texts[row])
            e.observations.append(obs)
            e.truncated += ro.finish_reasons[row] == "length"
            e.reward = r
            ctx[i] += a_ids + o_ids
        t += 1


def evaluate(policy, tok, env: LookupEnv, seeds: list[int], max_action_tokens: int) -> dict:
    """Held-out greedy success, tool use (at least one successful lookup) and per-turn accuracy (teacher-forced:
    the greedy action given the expert's history equals the expert's action) of turn 1, 2, ...; `policy` as play's."""
    model = policy.model if isinstance(policy, common.Sampler) else policy
    was = model.training
    model.eval()
    envs = [env.clone() for _ in seeds]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)])
    eps = play(policy, tok, envs, prompts, max_action_tokens, greedy=True)
    out = {"success": float(np.mean([e.reward for e in eps])),
           "tool_use": float(np.mean([any(o.startswith("=") for o in e.observations) for e in eps]))}
    experts = [env.clone() for _ in seeds]
    ctx = common.encode_prompts(tok, [e.reset(s) for e, s in zip(experts, seeds)])
    turn = 0
    while not all(e.done for e in experts):
        live = [i for i, e in enumerate(experts) if not e.done]
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, greedy=True)
        hits = []
        for row, i in enumerate(live):
            a = experts[i].expert_action()
            hits.append(ro.texts[row].strip() == a)
            obs, _, _ = experts[i].step(a)
            ctx[i] += tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + encode_obs(tok, obs)
        turn += 1
        out[f"turn{turn}_acc"] = float(np.mean(hits))
    model.train(was)
    return out
