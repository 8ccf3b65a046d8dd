"""A scripted policy for the lookup environment of algos/_toolenv.py, in place of common.generate in tests.

It reads only the token ids it is given (the context, decoded), so a rollout that leaves something out of the
context (an observation, a re-rollout's prefix) changes what it does. Modes:
    expert      the shortest solution from what the context shows (look up the next queried key not yet read, then
                answer the sum of the values read); with probability `p_err` a malformed action (`xx`) instead
    answer-now  answer at once with the sum of the queried values the context shows (V(s) = 1 exactly when every
                queried value is in the context and none of them is 0)
Every call is recorded (`calls`: the contexts it was given), and its behaviour log-probs are -0.5 per token.
Use: `monkeypatch.setattr(common, "generate", scripted_generate)` and pass a ScriptedPolicy where a policy goes.
"""
import re

import numpy as np
import torch

import common


class ScriptedPolicy:
    def __init__(self, tok, mode: str = "expert", p_err: float = 0.0, seed: int = 0):
        self.tok, self.mode, self.p_err, self.rng, self.calls = tok, mode, p_err, np.random.default_rng(seed), []

    def act(self, context: str) -> str:
        query = re.findall(r"[a-z]", context.split("?", 1)[0])
        seen = dict(re.findall(r"#([a-z])=(\d+);", context))
        if self.mode == "answer-now":
            return f"!{sum(int(seen[k]) for k in query if k in seen)}"
        if self.p_err and self.rng.random() < self.p_err:
            return "xx"
        todo = [k for k in query if k not in seen]
        return f"#{todo[0]}" if todo else f"!{sum(int(seen[k]) for k in query)}"


def scripted_generate(policy, tok, prompts, group_size=1, max_new_tokens=32, temperature=1.0, top_p=1.0,
                      greedy=False):
    """common.generate's contract (a common.Rollout) for a ScriptedPolicy; anything else goes to the real one."""
    if not isinstance(policy, ScriptedPolicy):
        return _real_generate(policy, tok, prompts, group_size, max_new_tokens, temperature, top_p, greedy)
    rows = [p for p in prompts for _ in range(group_size)]
    policy.calls.append([list(p) for p in rows])
    acts = [policy.act(tok.decode(p, skip_special_tokens=True)) for p in rows]
    ids = [(tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new_tokens] for a in acts]
    C = max(map(len, ids))
    comp = torch.tensor([r + [tok.pad_token_id] * (C - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (C - len(r)) for r in ids])
    prompt_ids, prompt_mask = common.left_pad(rows, tok.pad_token_id)
    return common.Rollout(prompt_ids, prompt_mask, comp, mask, -0.5 * mask.float(),
                          ["stop" if tok.eos_token_id in r else "length" for r in ids], acts)


_real_generate = common.generate
