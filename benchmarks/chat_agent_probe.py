"""What a pretrained chat model does in the multi-turn environments before any training: SmolLM2-135M-Instruct (or any
chat model) plays held-out episodes of both environments of algos/_toolenv.py through its chat template, with the
tool schemas in the system turn and hermes JSON tool calls as actions, greedily and sampled.

    python benchmarks/chat_agent_probe.py                       # smollm2-135m, 16 held-out episodes per environment
    python benchmarks/chat_agent_probe.py --report-only         # rebuild chat_agent_probe.md from the CSV

Environments: `lookup` (the key-value store: look up three keys, answer their sum; the scripts' default) and `calc`
(reasoning-gym's basic_arithmetic with a calculator tool and an answer tool: `--env calc`), each at the multi-turn
scripts' defaults (turn limit 5, `--max-context 40`) with a per-turn budget of `--max-new-tokens` tokens and a context
budget of `--max-context-tokens`. The held-out episodes are the first `--episodes` of the scripts' evaluation seeds.
Decoding: greedy, and sampled at temperature 0.7 (the scripts' rollout temperature; torch seed `--seed`).

Figures per (environment, decoding): call_rate, the share of assistant turns whose reply holds a parseable tool call
of a known tool with valid arguments; tool_use, the share of episodes with at least one tool call answered with a
value; success, the share of episodes whose final answer earned reward 1; turns, the mean assistant turns per episode.
Rows go to benchmarks/results/chat_agent_probe.csv (one per figure), the table to chat_agent_probe.md and the first
replies of the first episodes to chat_agent_probe_samples.txt. One thread: minutes on a CPU core.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSV = "chat_agent_probe.csv"
ENVS = ("lookup", "calc")
DECODING = {"greedy": (True, 1.0), "sampled": (False, 0.7)}  # name -> (greedy, temperature)


def probe(model, tok, env_name: str, decoding: str, episodes: int, max_new_tokens: int, max_context_tokens: int,
          seed: int) -> tuple[dict, list[str]]:
    """Play `episodes` held-out episodes of one environment; (figures, the first replies of the first episodes)."""
    import numpy as np
    import torch

    from algos import _toolenv, multiturn_grpo as mt

    args = mt.Args(model="smollm2-135m", env=env_name, max_context_tokens=max_context_tokens)
    env = mt.make_env(args)
    seeds = env.seeds("test", episodes, np.random.default_rng(12345))  # the scripts' evaluation seeds, in order
    envs = [env.clone() for _ in seeds]
    texts = [e.reset(s) for e, s in zip(envs, seeds)]
    prompts = _toolenv.encode_prompts(tok, texts, env.system_prompt)
    greedy, temperature = DECODING[decoding]
    torch.manual_seed(seed)
    t0 = time.time()
    eps = _toolenv.play(model, tok, envs, prompts, max_new_tokens, temperature, greedy=greedy)
    wall = time.time() - t0
    turns = [(r, a) for e in eps for r, a in zip(e.replies, e.actions)]
    figures = {"call_rate": float(np.mean([bool(a) for _, a in turns])),
               "tool_use": float(np.mean([any(o.startswith("=") for o in e.observations) for e in eps])),
               "success": float(np.mean([e.reward for e in eps])),
               "turns": float(np.mean([len(e.actions) for e in eps])),
               "truncated_turns": float(np.mean([e.truncated / len(e.actions) for e in eps])),
               "episodes": float(len(eps)), "wall_s": wall}
    samples = [f"[{env_name} {decoding}] {t!r} -> turn 1: {e.replies[0][:160]!r}" for t, e in zip(texts, eps[:3])]
    return figures, samples


def report() -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks._results import read_rows

    rows = read_rows(CSV)
    if not rows:
        return ""
    by, meta = {}, {}
    for r in rows:
        by.setdefault(r["config"], {})[r["metric"]] = float(r["value"])
        meta[r["config"]] = r
    lines = ["# A pretrained chat model in the multi-turn environments, before training", "",
             "Held-out episodes of `algos/_toolenv.py`'s environments played through the model's chat template (tool "
             "schemas in the system turn, hermes JSON tool calls, each observation a tool turn) by "
             "`benchmarks/chat_agent_probe.py`. call rate: share of assistant turns with a parseable call of a known "
             "tool; tool use: share of episodes where a tool answered with a value; success: share of episodes "
             "answered right (reward 1); turns: mean assistant turns per episode (turn limit 5).", "",
             "| model | environment | decoding | episodes | call rate (%) | tool use (%) | success (%) | turns | "
             "turns cut by the token budget (%) |", "|---|---|---|---|---|---|---|---|---|"]
    for config, m in by.items():
        model, env, decoding = config.split(" ")
        lines.append(f"| {model} | {env} | {decoding} | {m['episodes']:.0f} | {100 * m['call_rate']:.1f} | "
                     f"{100 * m['tool_use']:.1f} | {100 * m['success']:.1f} | {m['turns']:.2f} | "
                     f"{100 * m['truncated_turns']:.1f} |")
    for model in dict.fromkeys(c.split(" ")[0] for c in by):
        ms = {c.split(" ", 1)[1]: m for c, m in by.items() if c.startswith(model + " ")}
        turns = sum(round(m["turns"] * m["episodes"]) for m in ms.values())
        if max(m["call_rate"] for m in ms.values()) == 0:
            lines += ["", f"{model} writes no parseable tool call in any of its {turns} assistant turns (both "
                      "environments, greedy and sampled): its replies are prose (see the samples), so every episode "
                      "ends at the turn limit with reward 0. Every GRPO group then has zero reward variance and zero "
                      "advantage: multi-turn RL cannot move this model from here; it needs a supervised warm start on "
                      "tool calls first."]
        else:
            calls = ", ".join(f"{100 * m['call_rate']:.1f}% ({k})" for k, m in ms.items())
            wins = ", ".join(f"{100 * m['success']:.1f}% ({k})" for k, m in ms.items())
            lines += ["", f"{model} makes a parseable tool call in {calls} of its turns and succeeds in {wins} of the "
                      "episodes."]
    last = next(iter(meta.values()))
    lines += ["", f"Command: `{last['command']}`; commit {last['commit']}, {last['hardware']}, {last['versions']}.",
              "First replies of the first episodes: `benchmarks/results/chat_agent_probe_samples.txt`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a chat model: smollm2-135m, a Hugging Face id or a path")
    ap.add_argument("--episodes", type=int, default=16, help="held-out episodes per environment and decoding")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="token budget of one assistant turn")
    ap.add_argument("--max-context-tokens", type=int, default=2048, help="token budget of the whole conversation")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the sampled decoding")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--report-only", action="store_true", help="rebuild the table from the CSV")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks._results import RESULTS, append_rows

    if not a.report_only:
        import torch

        import common
        from algos import _toolenv

        torch.set_num_threads(a.threads)
        model, tok = common.load_model(a.model)
        model.eval()
        if not _toolenv.chat_mode(tok):
            raise SystemExit(f"--model {a.model}: its tokenizer has no chat template; the probe is for chat models")
        samples = []
        for env_name in ENVS:
            for decoding in DECODING:
                figures, s = probe(model, tok, env_name, decoding, a.episodes, a.max_new_tokens, a.max_context_tokens,
                                   a.seed)
                samples += s
                print(env_name, decoding, {k: round(v, 3) for k, v in figures.items()}, flush=True)
                append_rows(CSV, "chat_agent_probe", "benchmarks/chat_agent_probe.py",
                            f"{a.model} {env_name} {decoding}", a.seed, figures,
                            command=f"python benchmarks/chat_agent_probe.py --model {a.model} --episodes {a.episodes} "
                                    f"--max-new-tokens {a.max_new_tokens} --max-context-tokens {a.max_context_tokens} "
                                    f"--seed {a.seed} --threads {a.threads}")
        (RESULTS / "chat_agent_probe_samples.txt").write_text("\n".join(samples) + "\n")
    table = report()
    if table:
        (RESULTS / "chat_agent_probe.md").write_text(table)


if __name__ == "__main__":
    main()
