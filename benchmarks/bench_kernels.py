"""GPU benchmark of the Triton kernels in kernels/ against torch eager, torch.compile and (attention) SDPA.

For each kernel and shape it measures, side by side in one run:
    median time (triton.testing.do_bench) of ours, the eager reference, torch.compile of the reference, and
    for attention torch SDPA (FlashAttention backend) on the replicated N(P+R) layout;
    peak extra GPU memory of each;
    the roofline floor of the shape: max(bytes moved / measured copy bandwidth, flops / measured matmul rate),
    so the table shows how far each kernel is from the limit (ours / floor = 1 means at the roofline).
Rows go to benchmarks/results/kernels.csv (with GPU name, versions and commit, via _results.append_rows) and the
table to benchmarks/results/kernels.md, which `python benchmarks/report.py` puts into benchmarks/README.md.

    python benchmarks/bench_kernels.py            # one CUDA GPU (Hopper or newer for the fp8 rows)
    python benchmarks/bench_kernels.py --smoke    # CPU: runs every code path once on tiny shapes, writes nothing
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # same, with our kernels in the interpreter

Without a GPU (and without --smoke) it exits with a message and status 2. Timings are never asserted in tests.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import RESULTS, append_rows, provenance  # noqa: E402
from kernels import clipped_pg_loss as PG  # noqa: E402
from kernels import dualkv_attention as DK  # noqa: E402
from kernels import fp8_blockwise as F8  # noqa: E402
from kernels import fused_logprob as FL  # noqa: E402
from kernels import spec_rejection as SR  # noqa: E402

COMMAND = "python benchmarks/bench_kernels.py"
KERNEL_ORDER = ["fused_logprob", "dualkv_attention", "clipped_pg_loss", "fp8_blockwise", "spec_rejection"]


# ---- timing and memory ----
def bench(fn, smoke: bool) -> float:
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

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


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


def machine_rates(smoke: bool, device) -> dict:
    """Measured copy bandwidth (bytes/s) and bf16 / fp8 matmul rates (flop/s) of this GPU."""
    if smoke:
        return {"bw": 1e10, "mm_bf16": 1e11, "mm_fp8": 2e11}
    n = 2**28  # 1 GiB of fp32
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (bench(lambda: y.copy_(x), False) * 1e-3)
    del x, y
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


SKIP_COMPILE = False  # --smoke: inductor's CPU build takes minutes on a small machine


def compiled(fn):
    if SKIP_COMPILE:
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception:  # noqa: BLE001
        return None


def fwd_bwd(fn, inputs_fn):
    """A closure running forward + backward of fn on fresh leaf inputs (sum of outputs as the loss)."""
    def run():
        args = inputs_fn()
        outs = fn(*args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    return run


# ---- cases: (kernel, shape, pass, {impl: fn}, flops, bytes, matmul rate key) ----
def cases(device, smoke: bool):
    bf16 = torch.bfloat16 if not smoke else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*s, dtype=bf16, scale=1.0):
        return (torch.randn(*s, device=device, generator=g) * scale).to(dtype)

    # 1. fused linear -> log-prob + entropy (Qwen-like vocabulary)
    N, H, V = (4096, 4096, 151936) if not smoke else (64, 32, 500)
    hidden, weight = randn(N, H), randn(V, H, scale=H ** -0.5)
    targets = torch.randint(0, V, (N,), device=device, generator=g)

    def flp_inputs():
        return hidden.detach().requires_grad_(), weight.detach().requires_grad_(), targets

    impls = {"ours": FL.fused_linear_logprob, "eager": FL.fused_linear_logprob_ref,
             "compile": compiled(FL.fused_linear_logprob_ref)}
    b = 2 if not smoke else 4
    yield ("fused_logprob", f"N={N} H={H} V={V}", "fwd+bwd",
           {k: fwd_bwd(f, flp_inputs) for k, f in impls.items() if f is not None},
           8 * N * V * H, 3 * (N * H + V * H) * b + 8 * (N * H + V * H) + 16 * N, "mm_bf16")

    # 2. DualKV shared-prompt attention vs SDPA on the replicated layout
    B, Nr, Hh, P, R, D = (1, 16, 32, 2048, 512, 128) if not smoke else (1, 3, 2, 20, 9, 16)
    qp, kp, vp = (randn(B, Hh, P, D) for _ in range(3))
    qr, kr, vr = (randn(B, Nr, Hh, R, D) for _ in range(3))

    def dk_inputs():
        return [x.detach().requires_grad_() for x in (qp, kp, vp, qr, kr, vr)]

    def sdpa_replicated(qp, kp, vp, qr, kr, vr):
        q, k, v = (DK.unpack_shared_prompt(p.transpose(1, 2), r.transpose(2, 3)).flatten(0, 1).transpose(1, 2)
                   for p, r in ((qp, qr), (kp, kr), (vp, vr)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = {"ours": DK.dualkv_attention, "eager": DK.dualkv_attention_ref,
             "compile": compiled(DK.dualkv_attention_ref), "sdpa_replicated": sdpa_replicated}
    T = P + Nr * R
    flops_fwd = 4 * D * Hh * B * (P * P / 2 + Nr * (P * R + R * R / 2))
    yield ("dualkv_attention", f"B={B} N={Nr} H={Hh} P={P} R={R} D={D} rho={DK.token_reduction(Nr, P, R):.2f}",
           "fwd+bwd", {k: fwd_bwd(f, dk_inputs) for k, f in impls.items() if f is not None},
           3.5 * flops_fwd, 12 * B * T * Hh * D * b, "mm_bf16")

    # 3. clipped policy-gradient loss with KL
    Bq, Tq = (64, 4096) if not smoke else (4, 50)
    old = -torch.rand(Bq, Tq, device=device, generator=g) * 3
    logp = old + 0.3 * torch.randn(Bq, Tq, device=device, generator=g)
    ref = old + 0.3 * torch.randn(Bq, Tq, device=device, generator=g)
    adv = torch.randn(Bq, device=device, generator=g)
    mask = torch.rand(Bq, Tq, device=device, generator=g) < 0.8

    def pg_inputs():
        return logp.detach().requires_grad_(), old, adv, mask, 0.2, 0.28, ref, 0.05

    impls = {"ours": PG.clipped_pg_loss, "eager": PG.clipped_pg_loss_ref, "compile": compiled(PG.clipped_pg_loss_ref)}
    yield ("clipped_pg_loss", f"B={Bq} T={Tq}", "fwd+bwd",
           {k: fwd_bwd(lambda *a, f=f: f(*a)[0], pg_inputs) for k, f in impls.items() if f is not None},
           0, 36 * Bq * Tq, "mm_bf16")

    # 4. FP8 blockwise linear (quantise both + block-scaled matmul) vs the bf16 matmul it replaces
    M, Nn, Kk = (4096, 4096, 4096) if not smoke else (32, 64, 256)
    x, w = randn(M, Kk), randn(Nn, Kk, scale=Kk ** -0.5)

    def fp8_eager(x, w):
        xq, xs = F8.quantize_act_ref(x)
        wq, ws = F8.quantize_weight_ref(w)
        return F8.fp8_blockwise_matmul_ref(xq, xs, wq, ws, x.dtype)

    impls = {"ours": F8.fp8_linear, "eager": fp8_eager, "compile": compiled(fp8_eager),
             "bf16_matmul": lambda x, w: x @ w.T}
    yield ("fp8_blockwise", f"M={M} N={Nn} K={Kk}", "fwd",
           {k: (lambda f=f: f(x, w)) for k, f in impls.items() if f is not None},
           2 * M * Nn * Kk, 4 * (M * Kk + Nn * Kk) + 2 * M * Nn, "mm_fp8")

    # 5. speculative rejection sampler
    Bs, Kd, Vs = (256, 5, 151936) if not smoke else (16, 3, 300)
    q = torch.softmax(torch.randn(Bs, Kd, Vs, device=device, generator=g), -1)
    p = torch.softmax(torch.randn(Bs, Kd + 1, Vs, device=device, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, Vs), 1, generator=g).reshape(Bs, Kd)
    u = torch.rand(Bs, Kd + 1, device=device, generator=g)
    impls = {"ours": SR.spec_rejection_sample, "eager": SR.spec_rejection_sample_ref,
             "compile": compiled(SR.spec_rejection_sample_ref)}
    yield ("spec_rejection", f"B={Bs} K={Kd} V={Vs}", "fwd",
           {k: (lambda f=f: f(drafts, q, p, u)) for k, f in impls.items() if f is not None},
           0, 16 * Bs * Vs, "mm_bf16")


# ---- main ----
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: run each code path once on tiny shapes, write nothing")
    ap.add_argument("--only", nargs="+", metavar="KERNEL",
                    help="measure only these kernels (e.g. fused_logprob); their rows replace the old ones in "
                         "kernels.md, the other rows stay")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_kernels.py needs a CUDA GPU (none found): GPU figures are still to be measured.\n"
              f"Run `{COMMAND}` on a GPU machine; `--smoke` checks the script on CPU.", file=sys.stderr)
        return 2
    global SKIP_COMPILE
    SKIP_COMPILE = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    import triton

    rates = machine_rates(args.smoke, device)
    prov = provenance()
    print(f"{prov['hardware']}: copy {rates['bw'] / 1e9:.0f} GB/s, bf16 {rates['mm_bf16'] / 1e12:.0f} TFLOP/s, "
          f"fp8 {rates['mm_fp8'] / 1e12:.0f} TFLOP/s")
    table = []
    for kernel, shape, kind, impls, flops, nbytes, rate in cases(device, args.smoke):
        if args.only and kernel not in args.only:
            continue
        floor_ms = max(flops / rates[rate], nbytes / rates["bw"]) * 1e3
        res = {}
        for impl, fn in impls.items():
            try:
                res[impl] = (bench(fn, args.smoke), peak_mb(fn, args.smoke))
            except Exception as e:  # noqa: BLE001 - one failing baseline (e.g. compile) must not lose the rest
                print(f"  {kernel} {impl}: failed ({type(e).__name__}: {str(e)[:120]})")
        for impl, (ms, mb) in res.items():
            print(f"{kernel:18s} {kind:8s} {impl:16s} {ms:9.3f} ms  {mb:9.1f} MB  floor {floor_ms:.3f} ms")
            if not args.smoke:
                append_rows("kernels.csv", "kernels", "benchmarks/bench_kernels.py",
                            f"{kernel} {shape} {kind} {impl} triton={triton.__version__}", 0,
                            {"median_ms": ms, "peak_mb": mb, "floor_ms": floor_ms, "x_floor": ms / floor_ms},
                            command=COMMAND)
        table.append((kernel, shape, kind, floor_ms, res))
        if not args.smoke:  # after every kernel, so a run cut short still leaves its finished rows
            write_markdown(table, prov, rates, keep_others=bool(args.only))
    return 0


def write_markdown(table, prov, rates, keep_others: bool = False) -> None:
    def f(x, nd=2):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"

    lines = [f"Measured on {prov['hardware']} ({prov['versions']}; commit {prov['commit']}), "
             f"`{COMMAND}`. Copy bandwidth {rates['bw'] / 1e9:.0f} GB/s, bf16 matmul "
             f"{rates['mm_bf16'] / 1e12:.0f} TFLOP/s, fp8 {rates['mm_fp8'] / 1e12:.0f} TFLOP/s. "
             "Times are medians in ms; x floor = ours / roofline floor; baseline = SDPA on the replicated "
             "layout (attention) or the bf16 matmul (fp8), else none.", "",
             "| kernel | shape | pass | ours ms | eager ms | compile ms | baseline ms | speedup vs eager "
             "| floor ms | x floor | peak MB ours / eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kernel, shape, kind, floor_ms, res in table:
        ours, eager, comp = res.get("ours"), res.get("eager"), res.get("compile")
        base = res.get("sdpa_replicated") or res.get("bf16_matmul")
        speed = eager[0] / ours[0] if ours and eager else None
        lines.append(f"| {kernel} | {shape} | {kind} | {f(ours and ours[0], 3)} | {f(eager and eager[0], 3)} | "
                     f"{f(comp and comp[0], 3)} | {f(base and base[0], 3)} | {f(speed)}x | {f(floor_ms, 3)} | "
                     f"{f(ours and ours[0] / floor_ms)} | {f(ours and ours[1], 0)} / {f(eager and eager[1], 0)} |")
    path = RESULTS / "kernels.md"
    if keep_others and path.exists():  # --only: keep the other kernels' rows and header, say what was redone
        old = path.read_text().splitlines()
        redone = {row[0] for row in table}
        kept = [ln for ln in old[1:] if ln.startswith("| ") and ln.split(" | ")[0][2:] not in redone
                and not ln.startswith("| kernel |")]
        note = (f" Rows for {', '.join(sorted(redone))} re-measured with `{COMMAND} --only ...` on "
                f"{prov['hardware']} at commit {prov['commit']} (bf16 {rates['mm_bf16'] / 1e12:.0f} TFLOP/s, "
                f"copy {rates['bw'] / 1e9:.0f} GB/s).")
        lines = [old[0].split(" Rows for ")[0] + note, ""] + lines[2:4] + \
            sorted(lines[4:] + kept, key=lambda ln: KERNEL_ORDER.index(ln.split(" | ")[0][2:]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'kernels.md'} ({len(table)} kernels)")


if __name__ == "__main__":
    sys.exit(main())
