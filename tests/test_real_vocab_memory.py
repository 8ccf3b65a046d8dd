"""A training step's memory does not grow with vocabulary x length, on a real vocabulary.

A Llama-shaped model with Qwen2.5's 151,936-token vocabulary and a tiny hidden size is built in a temporary folder
(the shipped character tokenizer's ids are a prefix of the vocabulary; the new rows copy the pad row), and one
training step of grpo.py and of each script below runs in its own process, forked from one that has imported what
every script imports (so the imports are paid once), with completions long enough that a single fp32
[batch x length x vocab] tensor of the step is at least 4x the bound on what the step may add to the process.

The bound is derived, not measured (STEP_BOUND below): the model's fp32 copies, a fixed number of [chunk x vocab]
buffers of the chunk budget (LOGPROB_CHUNK_MB, passed through the environment), the sampler's [rows x vocab] buffers
of one decode step, and a fixed slack for the allocator and the decoder's activations. Each child reports its own
peak resident memory (ru_maxrss) and its resident memory when it starts, after the imports of torch, transformers,
the model classes and matplotlib: the step's growth is the difference. It must stay under STEP_BOUND plus
FIRST_STEP_MB, the stated cost of a first step that does not grow with batch x length (library code and objects
touched for the first time, the tokenizers and vocabulary dicts of a 151,936-token vocabulary), and the whole
process under BASELINE_MB (the stated size of the Python/torch process after its imports) plus both. The 4x margin
is taken against STEP_BOUND, the part that a [batch x length x vocab] tensor would land in; one such tensor alone
exceeds STEP_BOUND + FIRST_STEP_MB. (4x the whole process, ~0.6 GB, would need ~6e8 logits per script: minutes of
CPU per case on the 2-core CI machine.)

The children pin glibc's mmap threshold at 1 MiB (MALLOC_MMAP_THRESHOLD_): by default glibc raises it after the
first large free, large CPU blocks then come from the heap, and a chunk loop that keeps a small result per chunk
(token_logprobs' per-chunk log-probs, a divergence's per-token statistics) pins one freed block per chunk, so the
resident memory grows by about a chunk per chunk (measured: +1.6 GB for 1,280 positions in 3-position chunks at this
vocabulary) although no tensor outlives its chunk. That is the CPU allocator's policy, not a tensor this test looks
for; a CPU run with a real vocabulary wants the same setting (a GPU's caching allocator reuses its blocks).

EOS is disabled by making it a token whose row copies the pad row (sampled with probability below 1/151,000 per
position, and never by greedy decoding, which takes the first of equal logits, the pad token itself), so
completions run to full width; --eval-examples 0 skips the held-out evaluations.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
V, HIDDEN, LAYERS, HEADS, INTER = 151_936, 4, 2, 1, 8
ROWS, NEW_TOKENS = 4, 200  # 2 prompts x 2 completions; 4 x 200 positions of the completions
CHUNK_MB = 2.0  # LOGPROB_CHUNK_MB in the children: 3 positions of fp32 logits per chunk at this vocabulary
CHUNK_BYTES = int(CHUNK_MB * 2 ** 20) // (4 * V) * 4 * V  # what common.chunk_positions makes of it
MB = 2 ** 20

N_PARAMS = V * HIDDEN + LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN) + HIDDEN  # tied lm_head
# fp32 copies of the parameters a step may hold: weights, gradient and Adam's two moments (4), a teacher or a
# reference or a behaviour copy (1), async_opd.py's k + 1 = 3 weight snapshots (3), the lm_head gradient
# accumulated chunk by chunk (1), a sampler or rollout-engine copy and the optimiser's temporaries (3)
MODEL_COPIES = 12
# fp32 [chunk x vocab] tensors alive at once in one chunk's forward and backward: the logits, their temperature
# scaling, the log-softmax, its exp, the divergence's intermediates, their gradients, the teacher's logits and
# log-softmax, the statistics (entropy, the two KLs)
CHUNK_BUFFERS = 16
# fp32 [rows x vocab] tensors of one decode step: the logits, the processors' scores, the recorded log-softmax of
# the previous step, the sampling probabilities, and the same again for a second engine (FP8, a draft)
SAMPLER_BUFFERS = 8
SLACK_MB = 32  # glibc's heap below its (pinned, 1 MiB) mmap threshold and the decoder's activations (< 5 MB here)
STEP_BOUND = MODEL_COPIES * 4 * N_PARAMS + CHUNK_BUFFERS * CHUNK_BYTES + SAMPLER_BUFFERS * ROWS * V * 4 + SLACK_MB * MB
BASELINE_MB = 500  # python + torch 2.13 + transformers 5.24 + numpy, tyro, matplotlib: 326 MiB resident here
# a first step's cost that does not grow with batch x length: libtorch / transformers code and objects touched for
# the first time (about 100 MiB for a step on the 99-token tiny model), a tokenizer of 151,936 tokens (~25 MiB per
# load, two loads for a teacher) and its vocabulary dicts (~14-27 MiB each, two for opd.py's teacher check)
FIRST_STEP_MB = 200
FULL_TENSOR = ROWS * NEW_TOKENS * V * 4  # one fp32 [batch x length x vocab] tensor of the step

ZYGOTE = """
import json, os, resource, runpy, sys, traceback
sys.path.insert(0, {root!r})
import numpy, torch, transformers, tyro, tqdm, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, GenerationConfig
import transformers.generation.utils
import common
for name, script, flags in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one training step of the script, then its own peak resident memory
        os.close(r)
        out = {{"base_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "error": ""}}
        try:
            sys.argv = [script] + flags
            runpy.run_path(script, run_name="__main__")
        except BaseException:
            out["error"] = traceback.format_exc()[-3000:]
        out["peak_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read() or '{{"error": "the child died"}}')
    os.waitpid(pid, 0)
    print("MEMORY " + json.dumps({{"script": name, **out}}), flush=True)
"""

COMMON = ["--steps", "1", "--eval-examples", "0", "--threads", "1", "--max-new-tokens", str(NEW_TOKENS)]
GRPO_LIKE = COMMON + ["--prompts-per-step", "2", "--group-size", "2", "--pass-k", "0", "--no-eval-hard"]
CASES = {
    "grpo": GRPO_LIKE,
    "fp8_rollout": GRPO_LIKE,
    "tree_rollout_grpo": GRPO_LIKE + ["--chains", "1", "--rounds", "1", "--branches", "1", "--continuations", "1"],
    "async_offpolicy_grpo": GRPO_LIKE + ["--staleness", "1", "--correction", "vcpo"],
    "poise": GRPO_LIKE,
    "espo": GRPO_LIKE,
    "opd": COMMON + ["--prompts-per-step", "2", "--group-size", "2", "--no-eval-hard", "--teacher", "{model}"],
    "async_opd": COMMON + ["--prompts-per-step", "2", "--group-size", "2", "--teacher", "{model}"],
    "self_opd": COMMON + ["--prompts-per-step", "2", "--group-size", "2", "--no-eval-hard"],
    "sft": ["--steps", "1", "--eval-examples", "0", "--threads", "1", "--batch-size", str(ROWS), "--max-new-tokens",
            "4", "--tasks", "jsonl:{data}"],
}


def build_model(folder: Path) -> None:
    """A random Llama with the 151,936-token vocabulary, the character tokenizer extended to it, EOS disabled."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    char = AutoTokenizer.from_pretrained(ROOT / "algos" / "models" / "tiny-0.6m")
    vocab = dict(char.get_vocab())
    assert sorted(vocab.values()) == list(range(len(vocab)))  # a prefix of the new vocabulary
    vocab.update({f"<x{i}>": i for i in range(len(vocab), V)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    eos = f"<x{V - 1}>"  # its row copies the pad row: never the first of equal logits, almost never sampled
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos, pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")
    fast.save_pretrained(folder)
    pad, eos_id = fast.pad_token_id, fast.eos_token_id
    assert pad == 0 and eos_id == V - 1 and fast("12+3=")["input_ids"] == char("12+3=")["input_ids"]
    cfg = LlamaConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=eos_id, pad_token_id=pad)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[len(char.get_vocab()):] = emb[pad]
    assert sum(p.numel() for p in model.parameters()) == N_PARAMS
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real_vocab")
    build_model(folder / "model")
    # SFT data whose responses fill the step: 4 rows of 7 + 198 characters (+ EOS)
    lines = [json.dumps({"prompt": f"{i}+{i}=", "answer": "0", "solution": "1234567890" * 19 + "12345678"})
             for i in range(10, 60)]
    (folder / "sft.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def steps(real_vocab):
    """{script: (growth, peak, metrics rows, error)} for one step of every case, each in a forked child."""
    model, out = str(real_vocab / "model"), real_vocab / "runs"
    jobs = [[name, str(ROOT / "algos" / f"{name}.py"),
             [f.format(model=model, data=real_vocab / "sft.jsonl") for f in flags]
             + ["--model", model, "--out-dir", str(out), "--exp-name", name]] for name, flags in CASES.items()]
    env = {**os.environ, "LOGPROB_CHUNK_MB": str(CHUNK_MB), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "offline", "MALLOC_MMAP_THRESHOLD_": str(2 ** 20)}  # see the header: glibc's heap
    proc = subprocess.run([sys.executable, "-c", ZYGOTE.format(root=str(ROOT)), json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("MEMORY "):
            r = json.loads(line[len("MEMORY "):])
            metrics = out / r["script"] / "metrics.jsonl"
            rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            results[r["script"]] = ((r.get("peak_kb", 0) - r.get("base_kb", 0)) * 1024, r.get("peak_kb", 0) * 1024,
                                    rows, r["error"])
    return results


def test_the_bound_is_far_below_one_full_vocabulary_tensor():
    assert FULL_TENSOR >= 4 * STEP_BOUND, (FULL_TENSOR / MB, STEP_BOUND / MB)
    assert FULL_TENSOR > STEP_BOUND + FIRST_STEP_MB * MB  # one such tensor alone fails the test
    assert CHUNK_BYTES >= 4 * V  # at least one position per chunk


@pytest.mark.slow
@pytest.mark.extended  # about 2 minutes of one core: `python -m pytest -q -m extended`
@pytest.mark.parametrize("script", list(CASES))
def test_one_step_stays_under_the_bound(steps, script):
    growth, peak, rows, error = steps[script]
    assert not error, error
    if script != "sft":  # the step really sampled (nearly) full-width completions
        lengths = [r["rollout/length"] for r in rows if "rollout/length" in r]
        assert lengths and lengths[0] >= 0.9 * NEW_TOKENS, lengths
    bound = FIRST_STEP_MB * MB + STEP_BOUND
    assert growth <= bound, (f"{script}: one step added {growth / MB:.0f} MiB, over the bound of {bound / MB:.0f} MiB "
                             f"(one fp32 [batch x length x vocab] tensor is {FULL_TENSOR / MB:.0f} MiB)")
    assert peak <= BASELINE_MB * MB + bound, f"{script}: peak {peak / MB:.0f} MiB"
