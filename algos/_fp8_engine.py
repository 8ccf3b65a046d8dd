"""The simulated FP8 rollout engine of algos/fp8_rollout.py and algos/fp8_sol_rl.py: the rollout policy mu.

What it simulates (the equations, and the function that implements each, are in algos/fp8_rollout.py's header):
blockwise W8A8 e4m3 linears re-quantised at every weight sync (FP8Linear, mode w8a8), the same graph with
straight-through gradients for a unified trainer (FP8Linear, mode ste), an FP8 KV cache whose scales are calibrated
at the first forward after a sync (KVScales, qdq_static, fp8kv_attention), the switch between precisions
(set_precision, precision), a Gumbel-max sampler that records the sampled distribution and its noise (sample), and
the copy of the trainer that does the rollouts (FP8Engine). The quantisers and the block-scaled matmul are
kernels/fp8_blockwise.py's (the Triton kernel on a GPU, its reference on CPU). tests/test_fp8_rollout.py checks them.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

import common
from kernels.fp8_blockwise import TILE, fp8_blockwise_matmul, quantize_act, quantize_weight


# ---- FP8 numerics (the quantisers are kernels/fp8_blockwise.py's: the Triton kernel on a GPU, its reference here) ----
FP8_FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
EXACT_KL_MAX_VOCAB = 4096  # the full sampled distribution (exact KL, recorded noise) is kept up to this vocabulary
EXACT_KL_MAX_MB = 512  # ...and while each of those two [B, C, V] fp32 tensors fits in this many MiB


def dequantize(q, scales, rows: int):
    """fp8 values [R, C] times their block scales [ceil(R/rows), ceil(C/128)] -> fp32 [R, C]."""
    R, C = q.shape
    return q.float() * scales.repeat_interleave(rows, 0)[:R].repeat_interleave(TILE, 1)[:, :C]


def qdq_act(x):
    """Fake-quantised activations: 1 x 128 tiles per token, dynamic scales (x [..., K])."""
    q, s = quantize_act(x.reshape(-1, x.shape[-1]))
    return dequantize(q, s, 1).view(x.shape)


def qdq_weight(w):
    """Fake-quantised weight: 128 x 128 blocks of the bf16-rounded weight, as engines quantise their bf16 copy."""
    q, s = quantize_weight(w.detach().bfloat16().float())
    return dequantize(q, s, TILE)


def qdq_static(x, scale, fmt: str = "e4m3"):
    """x -> clamp(x / scale, +-max) -> fp8 -> * scale, with a straight-through gradient (the KV cache).

    The clamp comes before the cast: e5m2 overflows to inf and e4m3fn has no inf (torch saturates it on CPU)."""
    dtype, fmax = FP8_FORMATS[fmt]
    q = (x.detach().float() / scale).clamp(-fmax, fmax).to(dtype).float() * scale
    return q.to(x.dtype) + (x - x.detach())  # the value is q exactly; the gradient passes straight through


class FP8Linear(torch.nn.Linear):
    """nn.Linear whose forward follows `mode` (the class is swapped in place, so state_dict keys do not change).

    off:  plain fp32.  w8a8 (the rollout): y = bf16(fp8 blockwise matmul of quantize_act(x) and the weight quantised
    at the last sync).  ste (the unified trainer): the same value, from the weight quantised now, with the gradient
    of the fp32 matmul at the quantised operands (straight-through: quantisation and rounding count as identity).
    """
    mode, wq, ws = "off", None, None

    def requantize(self) -> None:
        self.wq, self.ws = quantize_weight(self.weight.detach().bfloat16().float())

    def forward(self, x):
        if self.mode == "off":  # the trainer's own precision (bf16 under --dtype bf16's autocast)
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):  # the fp8 simulation fixes its own dtypes: fp32 sums
            return self._fp8_forward(x)

    def _fp8_forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        wq, ws = (self.wq, self.ws) if self.mode == "w8a8" else quantize_weight(self.weight.detach().bfloat16().float())
        xq, xs = quantize_act(x2.detach().float())
        y = fp8_blockwise_matmul(xq, xs, wq, ws, torch.bfloat16).float()
        if self.mode == "ste" and torch.is_grad_enabled():
            xd = dequantize(xq, xs, 1) + (x2 - x2.detach())  # quantised values, identity gradient
            wd = dequantize(wq, ws, TILE) + (self.weight - self.weight.detach())
            g = xd @ wd.T
            y = y + (g - g.detach())  # value: the fp8 path exactly; gradient: d(xd @ wd.T)
        y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


class KVScales:
    """One layer's FP8 KV-cache scales: set at the first forward after reset() (a sync), frozen until the next."""

    def __init__(self, fmt: str, per_head: bool):
        self.fmt, self.per_head, self.k, self.v = fmt, per_head, None, None

    def reset(self) -> None:
        self.k = self.v = None

    def __call__(self, key, value):  # [B, H, T, D] after RoPE
        if self.k is None:
            dims = (0, 2, 3) if self.per_head else (0, 1, 2, 3)
            self.k = key.detach().float().abs().amax(dims, keepdim=True).clamp(min=1e-12) / 200
            self.v = value.detach().float().abs().amax(dims, keepdim=True).clamp(min=1e-12) / 100
        return qdq_static(key, self.k, self.fmt), qdq_static(value, self.v, self.fmt)


def fp8kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA attention that first passes K and V through the layer's KVScales (when one is attached)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kv = getattr(module, "fp8kv", None)
    if kv is not None:
        key, value = kv(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def set_precision(model, mode: str, kv: list | None = None) -> tuple:
    """Put the decoder's Linear layers in `mode` (off / w8a8 / ste) and attach per-layer KV scales (or none).

    lm_head and the embeddings stay high precision. Returns the previous (mode, kv) for `precision` to restore."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("fp8kv", fp8kv_attention)
    AttentionMaskInterface.register("fp8kv", sdpa_mask)
    model.config._attn_implementation = "fp8kv"  # SDPA unless a layer carries KV scales
    decoder = model.get_decoder()
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    attns = [layer.self_attn for layer in decoder.layers]
    before = (linears[0].mode if isinstance(linears[0], FP8Linear) else "off", getattr(attns[0], "fp8kv", None) and
              [a.fp8kv for a in attns])
    for m in linears:
        m.__class__, m.mode = FP8Linear, mode
        if mode == "w8a8":
            m.requantize()
    for i, a in enumerate(attns):
        a.fp8kv = kv[i] if kv else None
    return before


@contextmanager
def precision(model, mode: str, kv: list | None = None):
    """Temporarily run the trainer in another precision (fp32 eval, the diagnostics' second trainer)."""
    before = set_precision(model, mode, kv)
    try:
        yield
    finally:
        set_precision(model, *before)


# ---- the rollout policy mu ----
@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float = 1.0,
           noise=None):
    """Gumbel-max sampling over the model's KV cache: y_t = argmax_v (log softmax(z_t / T)_v + g_tv), g ~ Gumbel(0, 1).

    Returns (common.Rollout, full log-probs [B, C, V] of the distribution sampled, noise [B, C_max, V]); the last two
    are None above EXACT_KL_MAX_VOCAB or when one [B, C_max, V] fp32 tensor would exceed EXACT_KL_MAX_MB (then one
    [B, V] step exists at a time). Passing the noise back replays the same draws through another policy.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    B, V = ids.shape[0], model.get_output_embeddings().weight.shape[0]
    keep = V <= EXACT_KL_MAX_VOCAB and B * max_new_tokens * V * 4 <= EXACT_KL_MAX_MB * 2**20
    if noise is None and keep:
        noise = -torch.log(-torch.log(torch.rand(B, max_new_tokens, V, device=device).clamp(1e-20, 1 - 1e-7)))
    comp = torch.full((B, max_new_tokens), tok.pad_token_id, dtype=torch.long, device=device)
    lps, cmask = torch.zeros(B, max_new_tokens, device=device), torch.zeros_like(comp)
    full, alive, cache = [], torch.ones(B, dtype=torch.bool, device=device), DynamicCache(config=model.config)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with common.autocast(model):  # the trainer's autocast and dtype: mu differs from pi_train by its numerics only
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, -1)
        g = noise[:, t] if keep else -torch.log(-torch.log(torch.rand_like(logp).clamp(1e-20, 1 - 1e-7)))
        nxt = (logp + g).argmax(-1)
        comp[:, t] = torch.where(alive, nxt, comp[:, t])
        lps[:, t] = torch.where(alive, logp.gather(-1, nxt[:, None]).squeeze(-1), lps[:, t])
        cmask[:, t] = alive.long()
        if keep:
            full.append(logp)
        alive = alive & (nxt != tok.eos_token_id)
        if not alive.any() or t == max_new_tokens - 1:
            break
        mask, pos = torch.cat([mask, cmask[:, t:t + 1]], 1), pos[:, -1:] + 1
        with common.autocast(model):
            logits = model(input_ids=comp[:, t:t + 1], attention_mask=mask, position_ids=pos, cache=cache,
                           use_cache=True).logits[:, -1]
    C = t + 1
    comp, cmask, lps = comp[:, :C], cmask[:, :C], lps[:, :C]
    finish = ["stop" if s else "length" for s in ((comp == tok.eos_token_id) & cmask.bool()).any(1).tolist()]
    ro = common.Rollout(ids, (mask[:, :ids.shape[1]]), comp, cmask, lps, finish,
                        tok.batch_decode(comp, skip_special_tokens=True))
    return ro, (torch.stack(full, 1) if keep else None), noise


class FP8Engine:
    """mu: a copy of the trainer at `rollout_dtype` (fp8, bf16 or fp32) with an FP8 KV cache when kv_fp8 is e4m3 or
    e5m2 (scales per layer, or per head), re-synced (weights copied, re-quantised, KV scales reset) after every
    update, so every weight sync re-quantises as an FP8 engine does."""

    def __init__(self, model, rollout_dtype: str = "fp8", kv_fp8: str = "off", kv_scale: str = "per-layer"):
        self.rollout_dtype = rollout_dtype
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        n_layers = len(self.model.get_decoder().layers)
        self.kv = [KVScales(kv_fp8, kv_scale == "per-head") for _ in range(n_layers)] if kv_fp8 != "off" else None
        if rollout_dtype == "bf16":
            self.model.to(torch.bfloat16)
        set_precision(self.model, "w8a8" if rollout_dtype == "fp8" else "off", self.kv)
        self.sync_weights(model)

    @property
    def is_trainer(self) -> bool:
        """True when mu is the trainer's own computation (fp32 weights, no FP8 KV cache, the trainer's autocast), as
        common.Sampler.is_trainer: then the update needs no importance correction."""
        return self.rollout_dtype == "fp32" and self.kv is None

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        self.model.load_state_dict(model.state_dict())
        set_precision(self.model, "w8a8" if self.rollout_dtype == "fp8" else "off", self.kv)  # re-quantises
        for kv in self.kv or []:
            kv.reset()

    def sample(self, tok, prompts, group_size: int, max_new_tokens: int, temperature: float, noise=None):
        return sample(self.model, tok, prompts, group_size, max_new_tokens, temperature, noise)
