"""GPU benchmark of the Triton kernels in kernels/ against their best baseline: torch eager, torch.compile, SDPA,
the bf16 matmul and Liger-Kernel.

For each kernel and shape it measures, side by side in one run:
    median time (triton.testing.do_bench) of ours and of every baseline that has the op: the eager reference,
    torch.compile of the reference (where it can be the fastest baseline), torch SDPA (FlashAttention backend)
    on the replicated N(P+R) layout (attention), the bf16 matmul (fp8), Liger-Kernel's fused linear
    cross-entropy (fused_logprob) and its fused linear GRPO loss (against fused_logprob + clipped_pg_loss);
    peak extra GPU memory of each;
    "best baseline" = the fastest baseline of the row, and ours / best (< 1: ours wins);
    the roofline floor of the shape: max(bytes moved / measured copy bandwidth, flops / measured matmul rate),
    so the table shows how far each kernel is from the limit (ours / floor = 1 means at the roofline).
Also the DualKV sweep of the DualKV paper (N in {8, 16, 32} responses, prompt P in {1K, 2K, 4K, 8K}, response
R in {256, 1024}; forward + backward, ours vs SDPA on the replicated layout), speedup against the token
reduction rho = N (P + R) / (P + N R): rows "dualkv_sweep" in kernels.csv, and from them a table dualkv_sweep.md
and a plot dualkv_sweep.png beside it (neither is committed yet: the sweep has not run on a GPU here).
Rows go to benchmarks/results/kernels.csv (with GPU name, versions and commit, via _results.append_rows) and the
table to benchmarks/results/kernels.md, which `python benchmarks/report.py` puts into benchmarks/README.md. A full
run writes its own rows only; after `--only` (and with `--report-only`) the table is rebuilt from kernels.csv, so
rows of earlier runs and of older CSV layouts stay, each row's `measured` column naming its commit and time.

    python benchmarks/bench_kernels.py            # one CUDA GPU (Hopper or newer for the fp8 rows), ~3-4 min
    python benchmarks/bench_kernels.py --only fused_logprob grpo_loss   # some kernels (--only dualkv_sweep:
                                                  # the sweep); kernels.md is then rebuilt from kernels.csv
    python benchmarks/bench_kernels.py --report-only   # no GPU, measures nothing: kernels.md (and dualkv_sweep.md
                                                  # when the CSV has sweep rows) rebuilt from kernels.csv, the
                                                  # newest row of every (kernel, shape, impl), each row naming
                                                  # the commit and UTC time of the run that measured it
    python benchmarks/bench_kernels.py --no-sweep # without the DualKV sweep
    python benchmarks/bench_kernels.py --smoke    # CPU: runs every code path once on tiny shapes, writes nothing
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # same, with our kernels in the interpreter

Liger-Kernel (liger-kernel==0.8.5) is a benchmark-only dependency, imported lazily: without it (or on CPU) one
line is printed and its rows are skipped. Without a GPU (and without --smoke) the script exits with a message
and status 2. Timings are never asserted in tests.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import RESULTS, append_rows, provenance  # noqa: E402
from kernels import clipped_pg_loss as PG  # noqa: E402
from kernels import dualkv_attention as DK  # noqa: E402
from kernels import fp8_blockwise as F8  # noqa: E402
from kernels import fused_logprob as FL  # noqa: E402
from kernels import spec_rejection as SR  # noqa: E402
from kernels import tree_verify_attention as TV  # noqa: E402

COMMAND = "python benchmarks/bench_kernels.py"
KERNEL_ORDER = ["fused_logprob", "grpo_loss", "dualkv_attention", "clipped_pg_loss", "fp8_blockwise",
                "spec_rejection", "tree_verify_attention"]
SWEEP = "dualkv_sweep"
# the GRPO loss settings of every grpo_loss impl (DAPO-style token mean, asymmetric clip, k3 KL)
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.05

SMOKE = False          # --smoke: tiny shapes on CPU, nothing written
SKIP_COMPILE = False   # --smoke: inductor's CPU build takes minutes on a small machine
ALL_BASELINES = False  # --all-baselines: also the baselines that cannot win (compile for fp8 and attention)
BUDGET_S = 270.0       # --budget: sweep configs past this many seconds of the run are skipped (printed)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


# ---- timing and memory ----
def bench(fn, smoke: bool, rep: int = 100) -> float:
    """Median milliseconds of fn()."""
    if smoke:
        fn()
        t = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")


def peak_mb(fn, smoke: bool) -> float:
    """Peak GPU memory allocated while fn() runs, above what was allocated before, in MB."""
    if smoke:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def machine_rates(smoke: bool, device) -> dict:
    """Measured copy bandwidth (bytes/s) and bf16 / fp8 matmul rates (flop/s) of this GPU."""
    if smoke:
        return {"bw": 1e10, "mm_bf16": 1e11, "mm_fp8": 2e11}
    n = 2**28  # 1 GiB of fp32
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (bench(lambda: y.copy_(x), False) * 1e-3)
    x = y = None  # noqa: F841 - free the 2 GiB before the matmuls
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_bf16 = 2 * m**3 / (bench(lambda: a @ b, False) * 1e-3)
    mm_fp8 = 2 * mm_bf16  # fallback when torch._scaled_mm is unavailable
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.T.contiguous().to(torch.float8_e4m3fn).T
        one = torch.ones((), device=device)
        mm_fp8 = 2 * m**3 / (bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), False) * 1e-3)
    except Exception as e:  # noqa: BLE001 - report and keep the fallback
        print(f"fp8 matmul rate not measured ({type(e).__name__}); using 2x bf16")
    return {"bw": bw, "mm_bf16": mm_bf16, "mm_fp8": mm_fp8}


def compiled(fn):
    if SKIP_COMPILE:
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception:  # noqa: BLE001
        return None


_LIGER = None


def liger():
    """Liger-Kernel's functional ops (namespace with flce, GRPOLoss, version), or None (one line printed)."""
    global _LIGER
    if _LIGER is None:
        _LIGER = False
        if SMOKE or not torch.cuda.is_available():
            print("Liger-Kernel: skipped on CPU (its rows need a GPU)")
        else:
            try:
                from importlib.metadata import version

                from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
                from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

                _LIGER = argparse.Namespace(flce=liger_fused_linear_cross_entropy, GRPOLoss=LigerFusedLinearGRPOLoss,
                                            version=version("liger-kernel"))
                print(f"Liger-Kernel {_LIGER.version}: its rows are measured")
            except Exception as e:  # noqa: BLE001 - a benchmark-only dependency: skip its rows, keep the rest
                print(f"Liger-Kernel not available ({type(e).__name__}: {str(e)[:100]}): its rows are skipped")
    return _LIGER or None


def fwd_bwd(fn, inputs_fn):
    """A closure running forward + backward of fn on fresh leaf inputs (sum of outputs as the loss)."""
    def run():
        args = inputs_fn()
        outs = fn(*args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    return run


@dataclasses.dataclass
class Case:
    kernel: str
    shape: str
    kind: str                      # "fwd" or "fwd+bwd"
    impls: dict                    # name -> zero-argument callable; "ours" first, the rest are baselines
    flops: float
    nbytes: float
    rate: str                      # machine_rates key of the matmul rate
    note: str = ""
    cpu_optional: tuple = ()       # impls that may not run on CPU (--smoke): a failure there is a printed skip


# ---- cases: each builder yields Cases; the tensors of a case live in its closures and go with it ----
def _rand(device, g, smoke):
    dt = torch.bfloat16 if not smoke else torch.float32

    def randn(*s, dtype=dt, scale=1.0):
        return (torch.randn(*s, device=device, generator=g) * scale).to(dtype)
    return randn


def _fused_logprob_case(device, g, smoke, N, H, V, label=""):
    randn = _rand(device, g, smoke)
    hidden, weight = randn(N, H), randn(V, H, scale=H ** -0.5)
    targets = torch.randint(0, V, (N,), device=device, generator=g)

    def inputs():
        return hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets

    impls = {"ours": FL.fused_linear_logprob, "eager": FL.fused_linear_logprob_ref,
             "compile": compiled(FL.fused_linear_logprob_ref)}
    if hasattr(FL, "fused_linear_logprob_loss"):  # gradients in the forward: the loss Liger's FLCE computes
        impls["ours_loss"] = lambda h, w, t: FL.fused_linear_logprob_loss(h, w, t, _nll_sum)[0]
    run = {k: fwd_bwd(f, inputs) for k, f in impls.items() if f is not None}
    lg = liger()
    if lg is not None:  # a loss (sum of -log p(target)), not per-token log-probs: same matmuls, fwd + bwd
        run["liger_flce"] = fwd_bwd(lambda h, w, t: lg.flce(h, w, t, reduction="sum"), inputs)
    b = 2 if not smoke else 4
    # floor: 6 N V H flops (logits, d hidden, d weight; a design that recomputes the logits needs 8 N V H)
    return Case("fused_logprob", f"N={N} H={H} V={V}{label}", "fwd+bwd", run, 6 * N * V * H,
                3 * (N * H + V * H) * b + 8 * N, "mm_bf16")


def _nll_sum(lp, ent, rows):
    return -lp.sum()  # Liger's fused linear cross-entropy with reduction="sum"


def fused_logprob_cases(device, g, smoke):
    shapes = [(4096, 4096, 151936, ""), (16384, 896, 151936, ""), (8192, 576, 49152, ""),
              (8192, 896, 151936, " (Qwen2.5-0.5B GRPO micro-batch 8x1024)")]
    if smoke:
        shapes = [(64, 32, 500, ""), (48, 16, 300, " (micro-batch)")]
    for N, H, V, label in shapes:
        yield _fused_logprob_case(device, g, smoke, N, H, V, label)


def _grpo_ours(h, w, tgt, old, adv, mask, ref):
    lp, _ = FL.fused_linear_logprob(h, w, tgt)
    return PG.clipped_pg_loss(lp, old, adv, mask, EPS_LOW, EPS_HIGH, ref, BETA, "token_mean")[0]


def _grpo_ref(h, w, tgt, old, adv, mask, ref):
    lp, _ = FL.fused_linear_logprob_ref(h, w, tgt)
    return PG.clipped_pg_loss_ref(lp, old, adv, mask, EPS_LOW, EPS_HIGH, ref, BETA, "token_mean")[0]


def _grpo_ours_loss(h, w, tgt, old, adv, mask, ref):
    """The same loss written per token, its gradients computed in the forward (fused_linear_logprob_loss)."""
    weights = (mask.float() / mask.float().sum().clamp(min=1.0)).reshape(-1)   # token_mean
    old, ref = old.reshape(-1), ref.reshape(-1)
    adv = adv[:, None].expand(mask.shape).reshape(-1)

    def token_loss(lp, ent, rows):
        ratio, a = torch.exp(lp - old[rows]), adv[rows]
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
        d = ref[rows] - lp
        return (weights[rows] * (pg + BETA * (torch.exp(d) - d - 1))).sum()
    return FL.fused_linear_logprob_loss(h, w, tgt, token_loss)[0]


def grpo_loss_cases(device, g, smoke):
    """Qwen2.5-0.5B GRPO micro-batch: lm-head + GRPO loss, forward + backward (d hidden and d weight)."""
    B, T, H, V = (8, 1024, 896, 151936) if not smoke else (2, 24, 16, 300)
    randn = _rand(device, g, smoke)
    hidden, weight = randn(B, T, H), randn(V, H, scale=H ** -0.5)
    targets = torch.randint(0, V, (B, T), device=device, generator=g)
    with torch.no_grad():  # behaviour and reference log-probs near the current policy's, as in a real step
        lp0 = torch.cat([FL.fused_linear_logprob_ref(hidden[i:i + 1], weight, targets[i:i + 1])[0]
                         for i in range(B)]).float()
    old = lp0 + 0.05 * torch.randn(B, T, device=device, generator=g)
    ref = lp0 + 0.05 * torch.randn(B, T, device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    mask = (torch.arange(T, device=device)[None, :] <
            torch.randint(T // 2, T + 1, (B, 1), device=device, generator=g))

    def inputs():
        return hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets, old, adv, mask, ref

    impls = {"ours": _grpo_ours, "eager": _grpo_ref, "compile": compiled(_grpo_ref)}
    if hasattr(FL, "fused_linear_logprob_loss"):
        impls["ours_loss"] = _grpo_ours_loss
    run = {k: fwd_bwd(f, inputs) for k, f in impls.items() if f is not None}
    lg = liger()
    if lg is not None:
        # token-level clip with DAPO normalisation (sum over masked tokens / their count) = our token_mean
        grpo = lg.GRPOLoss(beta=BETA, compiled=True, use_ref_model=True, epsilon_low=EPS_LOW,
                           epsilon_high=EPS_HIGH, loss_type="dapo")

        def liger_grpo(h, w, tgt, old, adv, mask, ref):
            return grpo(h, w, tgt, mask.to(torch.int64), adv, ref_per_token_logps=ref,
                        old_per_token_logps=old)[0]
        run["liger_grpo"] = fwd_bwd(liger_grpo, inputs)
    b = 2 if not smoke else 4
    N = B * T
    yield Case("grpo_loss", f"B={B} T={T} H={H} V={V} (Qwen2.5-0.5B)", "fwd+bwd", run, 6 * N * V * H,
               3 * (N * H + V * H) * b + 24 * N, "mm_bf16",
               note="ours = fused_linear_logprob then clipped_pg_loss")


def _sdpa_replicated(qp, kp, vp, qr, kr, vr):
    q, k, v = (DK.unpack_shared_prompt(p.transpose(1, 2), r.transpose(2, 3)).flatten(0, 1).transpose(1, 2)
               for p, r in ((qp, qr), (kp, kr), (vp, vr)))
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _dualkv_inputs(device, g, smoke, B, N, H, P, R, D):
    randn = _rand(device, g, smoke)
    ts = [randn(B, H, P, D) for _ in range(3)] + [randn(B, N, H, R, D) for _ in range(3)]

    def inputs():
        return [x.detach().requires_grad_() for x in ts]
    return inputs


def _dualkv_flops(B, N, H, P, R, D):
    """Forward + backward flops of the packed layout (what ours computes; 3.5x the forward)."""
    return 3.5 * 4 * D * H * B * (P * P / 2 + N * (P * R + R * R / 2))


def dualkv_cases(device, g, smoke):
    B, N, H, P, R, D = (1, 16, 32, 2048, 512, 128) if not smoke else (1, 3, 2, 20, 9, 16)
    inputs = _dualkv_inputs(device, g, smoke, B, N, H, P, R, D)
    impls = {"ours": DK.dualkv_attention, "eager": DK.dualkv_attention_ref, "sdpa_replicated": _sdpa_replicated}
    if ALL_BASELINES or smoke:  # compile of the eager reference: 44.6 ms vs SDPA 8.7 ms on the H200, never best
        impls["compile"] = compiled(DK.dualkv_attention_ref)
    b = 2 if not smoke else 4
    T = P + N * R
    yield Case("dualkv_attention", f"B={B} N={N} H={H} P={P} R={R} D={D} rho={DK.token_reduction(N, P, R):.2f}",
               "fwd+bwd", {k: fwd_bwd(f, inputs) for k, f in impls.items() if f is not None},
               _dualkv_flops(B, N, H, P, R, D), 12 * B * T * H * D * b, "mm_bf16")


def clipped_pg_cases(device, g, smoke):
    Bq, Tq = (64, 4096) if not smoke else (4, 50)
    old = -torch.rand(Bq, Tq, device=device, generator=g) * 3
    logp = old + 0.3 * torch.randn(Bq, Tq, device=device, generator=g)
    ref = old + 0.3 * torch.randn(Bq, Tq, device=device, generator=g)
    adv = torch.randn(Bq, device=device, generator=g)
    mask = torch.rand(Bq, Tq, device=device, generator=g) < 0.8

    def inputs():
        return logp.detach().requires_grad_(), old, adv, mask, EPS_LOW, EPS_HIGH, ref, BETA

    impls = {"ours": PG.clipped_pg_loss, "eager": PG.clipped_pg_loss_ref, "compile": compiled(PG.clipped_pg_loss_ref)}
    yield Case("clipped_pg_loss", f"B={Bq} T={Tq}", "fwd+bwd",
               {k: fwd_bwd(lambda *a, f=f: f(*a)[0], inputs) for k, f in impls.items() if f is not None},
               0, 36 * Bq * Tq, "mm_bf16")


def _fp8_case(device, g, smoke, M, N, K):
    randn = _rand(device, g, smoke)
    x, w = randn(M, K), randn(N, K, scale=K ** -0.5)
    prepare = getattr(F8, "prepare_weight", None)
    out_dtype = x.dtype
    prepared = None
    if prepare is not None:  # the weight quantised once per weight sync, outside the timed region
        try:
            prepared = prepare(w)
        except Exception as e:  # noqa: BLE001 - keep the row with the older split below
            print(f"fp8_blockwise: prepare_weight failed ({type(e).__name__}: {str(e)[:100]}); ours uses "
                  "quantize_weight once instead")
    if prepared is not None:
        def ours():
            return F8.fp8_linear(x, prepared)
        how = "prepare_weight once, fp8_linear(x, prepared) per call"
    else:  # the same split with the older API: quantize_weight once, activation quantisation + GEMM per call
        try:
            wq, ws = F8.quantize_weight(w)

            def ours():
                xq, xs = F8.quantize_act(x)
                return F8.fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype)
        except Exception as e:  # noqa: BLE001 - reported when the impl runs
            err = e

            def ours():
                raise err
        how = "quantize_weight once, quantize_act + fp8_blockwise_matmul per call"

    def fp8_eager():
        xq, xs = F8.quantize_act_ref(x)
        wq_, ws_ = F8.quantize_weight_ref(w)
        return F8.fp8_blockwise_matmul_ref(xq, xs, wq_, ws_, out_dtype)

    impls = {"ours": ours, "ours_per_call": lambda: F8.fp8_linear(x, w), "eager": fp8_eager,
             "bf16_matmul": lambda: x @ w.T}
    if prepared is not None and "split_k" in inspect.signature(F8.fp8_linear).parameters:
        impls["ours_fused"] = lambda: F8.fp8_linear(x, prepared, fused=True)   # quantisation inside the GEMM
        impls["ours_nosplit"] = lambda: F8.fp8_linear(x, prepared, split_k=1)  # what split-K gains
    if ALL_BASELINES or smoke:  # compile of the eager reference: 4.8 ms vs the bf16 matmul's 0.19 ms, never best
        impls["compile"] = compiled(fp8_eager)
    impls = {k: f for k, f in impls.items() if f is not None}
    # floor of the prepared path: read x (bf16) and w (fp8) once, write y (bf16)
    return Case("fp8_blockwise", f"M={M} N={N} K={K}", "fwd", impls, 2 * M * N * K, 2 * M * K + N * K + 2 * M * N,
                "mm_fp8", note=f"ours: {how}, split_k chosen by timing on the first call; ours_per_call: "
                "fp8_linear(x, w) quantises the weight every call; ours_fused: fused=True; ours_nosplit: split_k=1",
                cpu_optional=("ours", "ours_per_call", "ours_fused", "ours_nosplit"))


def fp8_cases(device, g, smoke):
    if smoke:
        print("fp8_blockwise: on CPU our fp8 path runs in the interpreter (TRITON_INTERPRET=1) or falls back to the "
              "torch reference; where it cannot run it is skipped with a printed line")
    shapes = [(4096, 4096, 4096), (64, 4096, 4096), (128, 4096, 4096), (256, 4096, 4096)]
    if smoke:
        shapes = [(32, 64, 256), (8, 64, 256)]
    for M, N, K in shapes:
        yield _fp8_case(device, g, smoke, M, N, K)


def spec_cases(device, g, smoke):
    Bs, Kd, Vs = (256, 5, 151936) if not smoke else (16, 3, 300)
    q = torch.softmax(torch.randn(Bs, Kd, Vs, device=device, generator=g), -1)
    p = torch.softmax(torch.randn(Bs, Kd + 1, Vs, device=device, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, Vs), 1, generator=g).reshape(Bs, Kd)
    u = torch.rand(Bs, Kd + 1, device=device, generator=g)
    impls = {"ours": SR.spec_rejection_sample, "eager": SR.spec_rejection_sample_ref,
             "compile": compiled(SR.spec_rejection_sample_ref)}
    yield Case("spec_rejection", f"B={Bs} K={Kd} V={Vs}", "fwd",
               {k: (lambda f=f: f(drafts, q, p, u)) for k, f in impls.items() if f is not None},
               0, 16 * Bs * Vs, "mm_bf16")


def _sdpa_tree(q, k, v, parents):
    """SDPA with the dense [B, 1, T, P + T] tree mask (no FlashAttention backend takes an arbitrary mask)."""
    mask = TV.tree_attention_mask(parents, k.shape[2] - q.shape[2])[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def tree_verify_cases(device, g, smoke):
    """Verifying a 64-node draft tree over a 2K prefix (forward), and training on a prefix-shared rollout tree
    (fwd+bwd); random trees (parents[i] uniform below i)."""
    shapes = [("fwd", 8, 32, 2048, 64, 128), ("fwd+bwd", 1, 32, 1024, 4096, 128)]
    if smoke:
        shapes = [("fwd", 2, 2, 20, 9, 16), ("fwd+bwd", 1, 2, 7, 40, 16)]
    randn = _rand(device, g, smoke)
    for kind, B, H, P, T, D in shapes:
        q, k, v = randn(B, H, T, D), randn(B, H, P + T, D), randn(B, H, P + T, D)
        parents = (torch.rand(B, T, device=device, generator=g) * torch.arange(T, device=device)).long() - 1
        parents[:, 0] = -1
        impls = {"ours": TV.tree_verify_attention, "eager": TV.tree_verify_attention_ref, "sdpa_mask": _sdpa_tree}
        if kind == "fwd":
            run = {name: (lambda f=f: f(q, k, v, parents)) for name, f in impls.items()}
        else:
            run = {name: fwd_bwd(lambda q_, k_, v_, f=f: f(q_, k_, v_, parents),
                                 lambda: [x.detach().requires_grad_() for x in (q, k, v)]) for name, f in impls.items()}
        b = 2 if not smoke else 4
        flops = 4 * D * H * B * T * (P + T / 2) * (1 if kind == "fwd" else 3.5)
        yield Case("tree_verify_attention", f"B={B} H={H} P={P} T={T} D={D}", kind, run, flops,
                   (2 * T + 2 * (P + T)) * B * H * D * b * (1 if kind == "fwd" else 2), "mm_bf16")


BUILDERS: dict[str, Callable] = {"fused_logprob": fused_logprob_cases, "grpo_loss": grpo_loss_cases,
                                 "dualkv_attention": dualkv_cases, "clipped_pg_loss": clipped_pg_cases,
                                 "fp8_blockwise": fp8_cases, "spec_rejection": spec_cases,
                                 "tree_verify_attention": tree_verify_cases}


def best_baseline(res: dict):
    """(name, (ms, MB)) of the fastest baseline in res (every impl not named ours*), or (None, None)."""
    base = {k: v for k, v in res.items() if not k.startswith("ours") and not math.isnan(v[0])}
    if not base:
        return None, None
    name = min(base, key=lambda k: base[k][0])
    return name, base[name]


def run_case(case: Case, rates: dict, smoke: bool, rows: list) -> tuple:
    t0 = time.perf_counter()
    floor_ms = max(case.flops / rates[case.rate], case.nbytes / rates["bw"]) * 1e3
    res = {}
    for impl, fn in case.impls.items():
        try:
            res[impl] = (bench(fn, smoke), peak_mb(fn, smoke))
        except Exception as e:  # noqa: BLE001 - one failing impl (e.g. compile, Liger) must not lose the rest
            if smoke and impl in case.cpu_optional:
                print(f"  {case.kernel} {impl}: skipped on CPU ({type(e).__name__}: {str(e)[:100]})")
                continue
            print(f"  {case.kernel} {impl}: failed ({type(e).__name__}: {str(e)[:160]})")
        free_memory()
    best, best_res = best_baseline(res)
    for impl, (ms, mb) in res.items():
        print(f"{case.kernel:16s} {case.kind:8s} {impl:16s} {ms:9.3f} ms  {mb:9.1f} MB  floor {floor_ms:.3f} ms")
        metrics = {"median_ms": ms, "peak_mb": mb, "floor_ms": floor_ms, "x_floor": ms / floor_ms}
        if impl.startswith("ours") and best_res:
            metrics["x_best_baseline"] = ms / best_res[0]
        rows.append((f"{case.kernel} {case.shape} {case.kind} {impl}", metrics))
    if "ours" in res and best_res:
        log(f"{case.kernel} {case.shape}: ours / best baseline ({best}) = {res['ours'][0] / best_res[0]:.2f} "
            f"[case took {time.perf_counter() - t0:.1f} s]")
    else:
        log(f"{case.kernel} {case.shape}: done [case took {time.perf_counter() - t0:.1f} s]")
    return case.kernel, case.shape, case.kind, floor_ms, res, case.note


def save_rows(rows: list, triton_version: str) -> None:
    for config, metrics in rows:
        append_rows("kernels.csv", "kernels", "benchmarks/bench_kernels.py", f"{config} triton={triton_version}", 0,
                    metrics, command=COMMAND)


# ---- the DualKV sweep ----
def sweep_configs(smoke: bool):
    if smoke:
        return [(2, 16, 8), (3, 32, 8)], (1, 2, 16)
    return ([(N, P, R) for N in (8, 16, 32) for P in (1024, 2048, 4096, 8192) for R in (256, 1024)],
            (1, 32, 128))  # B, H, D of the main dualkv row (a 7B-class layer: 32 heads of 128)


def run_sweep(device, smoke: bool, triton_version: str, write: bool) -> list:
    configs, (B, H, D) = sweep_configs(smoke)
    g = torch.Generator(device=device).manual_seed(1)
    out = []
    for N, P, R in configs:
        t0 = time.perf_counter()
        if t0 - T0 > BUDGET_S:
            print(f"{SWEEP} N={N} P={P} R={R}: skipped (past the {BUDGET_S:.0f} s wall-time budget, --budget)")
            continue
        L = P + R
        need = 2 * (3 * 3 + 2) * B * N * L * H * D  # replicated q,k,v + grads + copies, out, d out (bf16)
        if not smoke:
            free, _ = torch.cuda.mem_get_info()
            if need > 0.8 * free:
                print(f"{SWEEP} N={N} P={P} R={R}: skipped (needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} free)")
                continue
        rho = DK.token_reduction(N, P, R)
        try:
            inputs = _dualkv_inputs(device, g, smoke, B, N, H, P, R, D)
            ms = {}
            for impl, f in (("ours", DK.dualkv_attention), ("sdpa_replicated", _sdpa_replicated)):
                ms[impl] = bench(fwd_bwd(f, inputs), smoke, rep=50)
            del inputs
        except torch.cuda.OutOfMemoryError:
            print(f"{SWEEP} N={N} P={P} R={R}: skipped (out of memory)")
            free_memory()
            continue
        except Exception as e:  # noqa: BLE001 - one failing config must not lose the rest of the sweep
            print(f"{SWEEP} N={N} P={P} R={R}: failed ({type(e).__name__}: {str(e)[:160]})")
            free_memory()
            continue
        free_memory()
        speed = ms["sdpa_replicated"] / ms["ours"]
        out.append({"N": N, "P": P, "R": R, "rho": rho, "ours": ms["ours"], "sdpa": ms["sdpa_replicated"],
                    "speedup": speed})
        log(f"{SWEEP} N={N} P={P} R={R} rho={rho:.2f}: ours {ms['ours']:.3f} ms, SDPA replicated "
            f"{ms['sdpa_replicated']:.3f} ms, speedup {speed:.2f}x [{time.perf_counter() - t0:.1f} s]")
        if write:
            shape = f"B={B} N={N} H={H} P={P} R={R} D={D} rho={rho:.2f}"
            for impl, v in ms.items():
                metrics = {"median_ms": v}
                if impl == "ours":
                    metrics.update(speedup_vs_sdpa=speed, rho=rho)
                append_rows("kernels.csv", "kernels", "benchmarks/bench_kernels.py",
                            f"{SWEEP} {shape} fwd+bwd {impl} triton={triton_version}", 0, metrics, command=COMMAND)
    return out


def sweep_markdown(points: list, prov: dict, smoke: bool) -> str:
    _, (B, H, D) = sweep_configs(smoke)
    lines = [f"DualKV sweep measured on {prov['hardware']} ({prov['versions']}; commit {prov['commit']}), "
             f"`{COMMAND}`: forward + backward of one attention layer (B={B}, H={H} heads of D={D}, bf16, causal), "
             "ours on the packed layout (the prompt stored once) vs SDPA (FlashAttention backend) on the replicated "
             "N(P+R) layout; rho = N(P+R)/(P+NR) is the token reduction. Times are medians in ms. The DualKV "
             "paper reports a 1.63-2.09x faster policy update at N=32, P=8K (a whole training step, not one layer).",
             "", "| N | P | R | rho | ours ms | SDPA replicated ms | speedup |", "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['N']} | {p['P']} | {p['R']} | {p['rho']:.2f} | {p['ours']:.3f} | {p['sdpa']:.3f} | "
                     f"{p['speedup']:.2f}x |")
    done = {(p["N"], p["P"], p["R"]) for p in points}
    missing = [c for c in sweep_configs(smoke)[0] if c not in done]
    if missing:
        lines += ["", "Not measured (memory, time budget or a failure; see the run's log): " +
                  ", ".join(f"N={n} P={pp} R={r}" for n, pp, r in missing) + "."]
    return "\n".join(lines) + "\n"


def sweep_plot(points: list, path: Path | None) -> None:
    """Speedup against rho, one marker per N and one line style per R; path None: draw without saving."""
    if not points:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no dualkv_sweep.png")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for N, marker in zip(sorted({p["N"] for p in points}), "osd^v"):
        for R, ls in zip(sorted({p["R"] for p in points}), ("-", "--", ":")):
            pts = sorted((p for p in points if p["N"] == N and p["R"] == R), key=lambda p: p["rho"])
            if pts:
                ax.plot([p["rho"] for p in pts], [p["speedup"] for p in pts], marker=marker, ls=ls,
                        label=f"N={N} R={R}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("token reduction rho = N(P+R)/(P+NR)")
    ax.set_ylabel("speedup vs SDPA replicated (fwd+bwd)")
    ax.set_title("DualKV attention: prompt P in 1K..8K")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        print(f"wrote {path}")
    plt.close(fig)


# ---- main ----
def main() -> int:
    global SMOKE, SKIP_COMPILE, ALL_BASELINES, BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: run each code path once on tiny shapes, write nothing")
    ap.add_argument("--only", nargs="+", metavar="KERNEL", choices=KERNEL_ORDER + [SWEEP],
                    help="measure only these kernels (e.g. fused_logprob grpo_loss; dualkv_sweep: the sweep); their "
                         "rows replace the old ones in kernels.md, the other rows stay")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="the DualKV sweep (default on; with --only it runs when dualkv_sweep is named)")
    ap.add_argument("--all-baselines", action="store_true",
                    help="also torch.compile for fp8_blockwise and dualkv_attention (slower than their best baseline)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help="wall-time budget in s: DualKV sweep configs that would start after it are skipped")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rebuild kernels.md (and dualkv_sweep.md) from kernels.csv, the newest row "
                         "of every (kernel, shape, impl), each row saying which commit and date measured it")
    args = ap.parse_args()
    if args.report_only:
        write_report()
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_kernels.py needs a CUDA GPU (none found): GPU figures are still to be measured.\n"
              f"Run `{COMMAND}` on a GPU machine; `--smoke` checks the script on CPU.", file=sys.stderr)
        return 2
    SMOKE = SKIP_COMPILE = args.smoke
    ALL_BASELINES = args.all_baselines
    BUDGET_S = args.budget
    write = not args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    import triton

    rates = machine_rates(args.smoke, device)
    prov = provenance()
    log(f"{prov['hardware']}: copy {rates['bw'] / 1e9:.0f} GB/s, bf16 {rates['mm_bf16'] / 1e12:.0f} TFLOP/s, "
        f"fp8 {rates['mm_fp8'] / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device=device).manual_seed(0)
    table = []
    for kernel in KERNEL_ORDER:
        if args.only and kernel not in args.only:
            continue
        rows = []
        for case in BUILDERS[kernel](device, g, args.smoke):
            table.append(run_case(case, rates, args.smoke, rows))
            del case
            free_memory()
        if write:  # after every kernel, so a run cut short still leaves its finished rows
            save_rows(rows, triton.__version__)
        if args.only and write:  # the other kernels' rows from kernels.csv, each with the run that measured it
            write_report(sweep=False)
        else:
            text = write_markdown(table, prov, rates, dry=not write)
    if args.sweep and (not args.only or SWEEP in args.only):
        log(f"{SWEEP}: ours vs SDPA on the replicated layout")
        points = run_sweep(device, args.smoke, triton.__version__, write)
        sweep_text = sweep_markdown(points, prov, args.smoke)
        if write and points:
            (RESULTS / f"{SWEEP}.md").write_text(sweep_text)
            print(f"wrote {RESULTS / f'{SWEEP}.md'}")
        sweep_plot(points, RESULTS / f"{SWEEP}.png" if write and points else None)
        if args.smoke:
            print("smoke: dualkv_sweep.md would hold\n" + "\n".join(sweep_text.splitlines()[2:]))
    if args.smoke and table:
        print("smoke: kernels.md would begin\n" + "\n".join(text.splitlines()[:6]))
    log("done")
    return 0


HEADER = ("| kernel | shape | pass | ours ms | best baseline | best ms | ours / best | eager ms | compile ms "
          "| Liger ms | floor ms | ours / floor | peak MB ours / best | measured |")
N_COLS = HEADER.count("|") - 1
PASSES = ("fwd", "fwd+bwd")


def _kernel_of(line: str) -> str:
    return line.split(" | ")[0][2:]


def _order(kernel: str) -> int:
    return KERNEL_ORDER.index(kernel) if kernel in KERNEL_ORDER else len(KERNEL_ORDER)


def _f(x, nd=2):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _when(prov: dict) -> str:
    """'commit YYYY-MM-DD HH:MM' (UTC) of a run's provenance."""
    ts = prov.get("timestamp", "")
    return f"{prov.get('commit', '?')} {ts[:10]} {ts[11:16]}".strip()


def _table_row(kernel, shape, kind, floor_ms, res, measured) -> str:
    """One kernels.md row; res: impl -> (ms, MB)."""
    ours = res.get("ours")
    best, best_res = best_baseline(res)
    liger_ms = next((v[0] for k, v in res.items() if k.startswith("liger")), None)
    eager, comp = res.get("eager"), res.get("compile")
    extra = [f"{k} {v[0]:.3f} ms" + (f", {v[1]:.0f} MB" if not math.isnan(v[1]) else "")
             for k, v in res.items() if k.startswith("ours_")]
    shape_txt = shape + (f" ({'; '.join(extra)})" if extra else "")
    x_floor = ours[0] / floor_ms if ours and floor_ms else None
    return (f"| {kernel} | {shape_txt} | {kind} | {_f(ours and ours[0], 3)} | {best or '-'} | "
            f"{_f(best_res and best_res[0], 3)} | {_f(ours and best_res and ours[0] / best_res[0])} | "
            f"{_f(eager and eager[0], 3)} | {_f(comp and comp[0], 3)} | {_f(liger_ms, 3)} | {_f(floor_ms, 3)} | "
            f"{_f(x_floor)} | {_f(ours and ours[1], 0)} / {_f(best_res and best_res[1], 0)} | {measured} |")


def _winners(entries) -> str:
    """'compile (clipped_pg_loss, spec_rejection); ...' from (kernel, res) pairs."""
    winners = {}
    for kernel, res in entries:
        best, _ = best_baseline(res)
        if best:
            winners.setdefault(best, set()).add(kernel)
    return "; ".join(f"{b} ({', '.join(sorted(ks))})" for b, ks in winners.items()) or "-"


def _legend() -> str:
    return ("Times are medians in ms, forward + backward unless the pass says fwd; peak MB = GPU memory allocated "
            "beyond the inputs. Best baseline = the fastest of eager, torch.compile, SDPA on the replicated layout "
            "(attention), the bf16 matmul (fp8) and Liger-Kernel per row; ours / best < 1 means ours wins; ours / "
            "floor = ours over the roofline floor of the shape (max of bytes / copy bandwidth and flops / matmul "
            "rate, both measured on the GPU of the run). Liger's fused linear cross-entropy returns a loss "
            "(reduction sum), not per-token log-probs and entropies: it is compared at equal matmul work (logits, "
            "d hidden, d weight), forward + backward; ours_loss (fused_logprob, grpo_loss) = "
            "fused_linear_logprob_loss, the gradients computed in the forward as Liger does, on the same loss. "
            "grpo_loss: ours = fused_linear_logprob then clipped_pg_loss vs Liger's LigerFusedLinearGRPOLoss "
            f"(token-level clip, DAPO token mean, k3 KL with beta {BETA}, eps {EPS_LOW}/{EPS_HIGH}). fp8_blockwise: "
            "ours has the weight quantised once outside the timed region and split-K chosen by timing on the first "
            "call; ours_per_call quantises the weight every call, ours_fused quantises the activation inside the "
            "GEMM, ours_nosplit forces split_k=1. torch.compile is left out where it cannot win (fp8: 4.8 ms vs the "
            "bf16 matmul's 0.19 ms; attention: 44.6 ms vs SDPA's 8.7 ms at 4096^3 / N=16 P=2048 on the H200; "
            "`--all-baselines` adds it). fused_logprob's floor counts 6 N V H flops.")


def kernels_markdown(table, prov, rates) -> str:
    """The kernels.md text of one full run: one row per (kernel, shape), all measured now."""
    when = _when(prov)
    rows = [_table_row(kernel, shape, kind, floor_ms, res, when) for kernel, shape, kind, floor_ms, res, _ in table]
    head = (f"Measured on {prov['hardware']} ({prov['versions']}; commit {prov['commit']}), `{COMMAND}`, every "
            f"row in this one run ({when} UTC). Copy bandwidth {rates['bw'] / 1e9:.0f} GB/s, bf16 matmul "
            f"{rates['mm_bf16'] / 1e12:.0f} TFLOP/s, fp8 {rates['mm_fp8'] / 1e12:.0f} TFLOP/s. " + _legend() +
            f" Best baseline per kernel: {_winners((row[0], row[4]) for row in table)}.")
    return "\n".join([head, "", HEADER, "|" + "---|" * N_COLS] + rows) + "\n"


def write_markdown(table, prov, rates, dry: bool = False) -> str:
    """Write kernels.md (see kernels_markdown; dry: only return the text)."""
    text = kernels_markdown(table, prov, rates)
    if not dry:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "kernels.md").write_text(text)
        print(f"wrote {RESULTS / 'kernels.md'} ({len(table)} rows)")
    return text


# ---- --report-only: the tables rebuilt from kernels.csv ----
def parse_config(config: str):
    """(kernel, shape, pass, impl) of a kernels.csv config 'kernel <shape ...> <pass> <impl> [triton=X]', or None."""
    toks = config.split()
    if toks and toks[-1].startswith("triton="):
        toks = toks[:-1]
    if len(toks) < 3 or toks[-2] not in PASSES:
        return None
    return toks[0], " ".join(toks[1:-2]), toks[-2], toks[-1]


def newest_rows(csv_rows: list) -> dict:
    """(kernel, shape, pass, impl) -> {"metrics": {...}, "run": provenance} of the newest run that measured it.

    A run is one (commit, hardware, versions, timestamp) group of rows; the newest is the latest timestamp (a tie:
    the later in the file). Rows of every layout come through: the older ones lack x_best_baseline, which the
    table recomputes from the medians anyway."""
    runs: dict = {}
    for i, r in enumerate(csv_rows):
        key = parse_config(r.get("config", ""))
        if key is None or r.get("bench", "kernels") != "kernels":
            continue
        try:
            value = float(r["value"])
        except (TypeError, ValueError):
            continue
        run = (r.get("timestamp", ""), r.get("commit", ""), r.get("hardware", ""), r.get("versions", ""))
        entry = runs.setdefault(key, {}).setdefault(run, {"metrics": {}, "pos": i, "first": i})
        entry["metrics"][r["metric"]] = value
        entry["pos"] = i
    out = {}
    for key, by_run in runs.items():
        run, entry = max(by_run.items(), key=lambda kv: (kv[0][0], kv[1]["pos"]))
        out[key] = {"metrics": entry["metrics"], "first": min(e["first"] for e in by_run.values()),
                    "run": {"timestamp": run[0], "commit": run[1], "hardware": run[2], "versions": run[3]}}
    return out


def _measured_cell(runs: dict, main_impl: str, show_hw: bool) -> str:
    """The measured column: the run of main_impl, then the impls measured by other runs."""
    def txt(run):
        return _when(run) + (f" {run['hardware']}" if show_hw else "")

    main = runs[main_impl]
    others: dict = {}
    for impl, run in runs.items():
        if txt(run) != txt(main):
            others.setdefault(txt(run), []).append(impl)
    return txt(main) + "".join(f"; {', '.join(impls)}: {t}" for t, impls in others.items())


def report_markdown(csv_rows: list) -> tuple[str, str | None]:
    """(kernels.md, dualkv_sweep.md or None) rebuilt from the rows of kernels.csv."""
    newest = newest_rows(csv_rows)
    groups: dict = {}
    for (kernel, shape, kind, impl), e in newest.items():
        g = groups.setdefault((kernel, shape, kind), {"impls": {}, "first": e["first"]})
        g["impls"][impl] = e
        g["first"] = min(g["first"], e["first"])
    hw = sorted({(e["run"]["hardware"], e["run"]["versions"]) for e in newest.values()})
    show_hw = len({h for h, _ in hw}) > 1
    table_keys = sorted((k for k in groups if k[0] != SWEEP), key=lambda k: (_order(k[0]), groups[k]["first"]))
    rows, entries, commits = [], [], set()
    for kernel, shape, kind in table_keys:
        impls = groups[(kernel, shape, kind)]["impls"]
        res = {impl: (e["metrics"].get("median_ms", float("nan")), e["metrics"].get("peak_mb", float("nan")))
               for impl, e in impls.items()}
        main_impl = "ours" if "ours" in impls else next(iter(impls))
        floor_ms = impls[main_impl]["metrics"].get("floor_ms")
        if floor_ms is None:
            floor_ms = next((e["metrics"]["floor_ms"] for e in impls.values() if "floor_ms" in e["metrics"]), None)
        runs = {impl: e["run"] for impl, e in impls.items()}
        commits |= {r["commit"] for r in runs.values()}
        rows.append(_table_row(kernel, shape, kind, floor_ms, res, _measured_cell(runs, main_impl, show_hw)))
        entries.append((kernel, res))
    machines = "; ".join(f"{h} ({v})" for h, v in hw) or "-"
    head = (f"Rebuilt from benchmarks/results/kernels.csv by `{COMMAND} --report-only`: for every (kernel, shape, "
            "impl) the newest row of the CSV, so the rows come from different runs and are not one run's "
            "figures. The measured column gives the commit and UTC time of the run that measured the row's ours "
            "(and, after a semicolon, the run of any impl in the row measured by another run); each row's floor "
            "is the one its run computed from that run's measured copy bandwidth and matmul rates. Commits: "
            f"{', '.join(sorted(commits)) or '-'}. Machines: {machines}. " + _legend() +
            f" Best baseline per kernel: {_winners(entries)}.")
    kernels_text = "\n".join([head, "", HEADER, "|" + "---|" * N_COLS] + rows) + "\n"
    return kernels_text, sweep_report_markdown(groups)


def sweep_report_markdown(groups: dict) -> str | None:
    """dualkv_sweep.md from the newest sweep rows of kernels.csv (None when there are none)."""
    points = []
    for (kernel, shape, _kind), g in groups.items():
        if kernel != SWEEP:
            continue
        dims = dict(re.findall(r"(\w+)=([\d.]+)", shape))
        ours, sdpa = g["impls"].get("ours"), g["impls"].get("sdpa_replicated")
        if ours is None or sdpa is None or not {"N", "P", "R"} <= set(dims):
            continue
        o, s = ours["metrics"].get("median_ms"), sdpa["metrics"].get("median_ms")
        if o is None or s is None:
            continue
        points.append({"B": dims.get("B", "?"), "H": dims.get("H", "?"), "D": dims.get("D", "?"),
                       "N": int(dims["N"]), "P": int(dims["P"]), "R": int(dims["R"]),
                       "rho": float(dims.get("rho", "nan")), "ours": o, "sdpa": s, "speedup": s / o,
                       "measured": _measured_cell({"ours": ours["run"], "sdpa_replicated": sdpa["run"]}, "ours",
                                                  False)})
    if not points:
        return None
    points.sort(key=lambda p: (p["N"], p["P"], p["R"]))
    bhd = sorted({f"B={p['B']}, H={p['H']} heads of D={p['D']}" for p in points})
    lines = [f"DualKV sweep rebuilt from benchmarks/results/kernels.csv by `{COMMAND} --report-only` (the newest "
             "row of each configuration; the measured column gives the commit and UTC time of its run): forward "
             f"+ backward of one attention layer ({'; '.join(bhd)}, bf16, causal), ours on the packed layout (the "
             "prompt stored once) vs SDPA (FlashAttention backend) on the replicated N(P+R) layout; rho = "
             "N(P+R)/(P+NR) is the token reduction. Times are medians in ms. The DualKV paper reports a "
             "1.63-2.09x faster policy update at N=32, P=8K (a whole training step, not one layer).",
             "", "| N | P | R | rho | ours ms | SDPA replicated ms | speedup | measured |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['N']} | {p['P']} | {p['R']} | {p['rho']:.2f} | {p['ours']:.3f} | {p['sdpa']:.3f} | "
                     f"{p['speedup']:.2f}x | {p['measured']} |")
    return "\n".join(lines) + "\n"


def write_report(dry: bool = False, sweep: bool = True) -> tuple[str, str | None]:
    """Rebuild kernels.md (and dualkv_sweep.md when sweep rows exist and sweep) from kernels.csv alone."""
    from benchmarks import _results

    csv_rows = _results.read_rows("kernels.csv")
    kernels_text, sweep_text = report_markdown(csv_rows)
    if not dry:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "kernels.md").write_text(kernels_text)
        print(f"wrote {RESULTS / 'kernels.md'} ({kernels_text.count(chr(10) + '| ') - 1} rows from "
              f"{len(csv_rows)} CSV rows)")
        if sweep and sweep_text is not None:
            (RESULTS / f"{SWEEP}.md").write_text(sweep_text)
            print(f"wrote {RESULTS / f'{SWEEP}.md'}")
    return kernels_text, sweep_text


if __name__ == "__main__":
    sys.exit(main())
