"""benchmarks/bench_kernels.py: the --smoke run goes through every code path on CPU (our kernels in Triton's
interpreter) and writes nothing; the table keeps its best-baseline logic; --report-only rebuilds kernels.md
and dualkv_sweep.md from kernels.csv.
Timings are never asserted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _snapshot():
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*") if p.name.startswith(("kernels", "dualkv"))}


@pytest.mark.slow
@pytest.mark.extended  # the whole benchmark under the interpreter; each kernel's own tests and this file's table tests
def test_smoke_runs_every_path_and_writes_nothing():  # are in the suite
    before = _snapshot()
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "benchmarks/bench_kernels.py", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    assert "failed" not in out, out
    for kernel in ("fused_logprob", "grpo_loss", "dualkv_attention", "clipped_pg_loss", "fp8_blockwise",
                   "spec_rejection", "dualkv_sweep"):
        assert f"{kernel} " in out, f"{kernel} missing from the smoke run:\n{out}"
    assert "Liger-Kernel: skipped on CPU" in out
    assert "ours_per_call" in out and "ours_loss" in out and "sdpa_replicated" in out
    assert "| kernel | shape | pass | ours ms | best baseline |" in out
    assert _snapshot() == before, "--smoke wrote into benchmarks/results"


def test_best_baseline_and_live_table():
    import benchmarks.bench_kernels as BK

    res = {"ours": (2.0, 10.0), "ours_per_call": (1.0, 5.0), "eager": (4.0, 50.0), "compile": (3.0, 20.0),
           "liger_flce": (2.5, 1.0)}
    assert BK.best_baseline(res) == ("liger_flce", (2.5, 1.0))  # ours* never count as a baseline
    assert BK.best_baseline({"ours": (1.0, 1.0)}) == (None, None)

    prov = {"hardware": "GPU X", "versions": "v", "commit": "abc", "timestamp": "2026-01-02T03:04:05Z"}
    rates = {"bw": 1e12, "mm_bf16": 1e14, "mm_fp8": 2e14}
    full = [("fused_logprob", "N=1", "fwd+bwd", 1.0, res, ""),
            ("spec_rejection", "B=1", "fwd", 0.1, {"ours": (0.5, 0.0), "compile": (0.4, 0.0)}, ""),
            ("clipped_pg_loss", "B=2", "fwd+bwd", 0.1, {"ours": (0.3, 0.0), "eager": (0.6, 0.0)}, "")]
    lines = BK.kernels_markdown(full, prov, rates).splitlines()
    assert lines[2] == BK.HEADER and all(ln.count("|") - 1 == BK.N_COLS for ln in lines[2:])
    fl = next(ln for ln in lines if ln.startswith("| fused_logprob"))
    assert "| liger_flce | 2.500 | 0.80 |" in fl and "ours_per_call 1.000 ms, 5 MB" in fl
    assert fl.endswith("| abc 2026-01-02 03:04 |")
    assert "compile (spec_rejection)" in lines[0] and "commit abc" in lines[0]


def test_grpo_loss_written_per_token_equals_the_composed_loss(monkeypatch):
    """The bench's ours_loss (fused_linear_logprob_loss with the GRPO loss written per token) computes the same
    loss and gradients as fused_linear_logprob then clipped_pg_loss (token mean, clip, k3 KL), so the two rows
    time the same work."""
    import torch

    import benchmarks.bench_kernels as BK

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 16, 40
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / 4
    tgt = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        lp0 = BK.FL.fused_linear_logprob_ref(hidden, weight, tgt)[0]
    old, ref = lp0 + 0.3 * torch.randn(B, T, generator=g), lp0 + 0.3 * torch.randn(B, T, generator=g)
    adv, mask = torch.randn(B, generator=g), torch.arange(T)[None, :] < torch.tensor([[7], [3], [5]])
    outs = []
    for fn in (BK._grpo_ours_loss, BK._grpo_ref):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, tgt, old, adv, mask, ref)
        loss.backward()
        outs.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _csv_rows(config, run, **metrics):
    commit, ts = run
    return [{"bench": "kernels", "script": "benchmarks/bench_kernels.py", "config": config, "seed": "0",
             "metric": m, "value": str(v), "command": "python benchmarks/bench_kernels.py", "commit": commit,
             "hardware": "GPU X", "versions": "v", "timestamp": ts} for m, v in metrics.items()]


def test_report_only_rebuilds_tables_from_csv(tmp_path, monkeypatch):
    """--report-only: the newest row per (kernel, shape, impl), older-layout rows included, each row saying
    which commit and time measured it; the sweep table from the sweep rows; nothing measured, no GPU needed."""
    import csv

    import benchmarks._results as R
    import benchmarks.bench_kernels as BK

    old, new = ("aaa1111", "2026-01-01T00:10:00Z"), ("bbb2222", "2026-01-02T05:06:07Z")
    rows = []
    # the older layout: no x_best_baseline; dualkv_attention and fused_logprob measured by the old run only
    for impl, ms in (("ours", 5.0), ("eager", 100.0), ("sdpa_replicated", 8.0)):
        rows += _csv_rows(f"dualkv_attention B=1 N=16 rho=4.00 fwd+bwd {impl} triton=3.6.0", old,
                          median_ms=ms, peak_mb=10.0, floor_ms=2.0, x_floor=ms / 2)
    for impl, ms in (("ours", 40.0), ("compile", 20.0)):
        rows += _csv_rows(f"fused_logprob N=8 H=4 V=9 (micro-batch 8x1024) fwd+bwd {impl} triton=3.6.0", old,
                          median_ms=ms, peak_mb=1.0, floor_ms=10.0, x_floor=ms / 10)
    # clipped_pg_loss: old run (ours, eager, compile), new run (ours, eager): compile stays from the old run
    for impl, ms in (("ours", 0.8), ("eager", 1.4), ("compile", 0.7)):
        rows += _csv_rows(f"clipped_pg_loss B=64 T=4096 fwd+bwd {impl} triton=3.6.0", old,
                          median_ms=ms, peak_mb=2.0, floor_ms=0.002, x_floor=ms / 0.002)
    rows += _csv_rows("clipped_pg_loss B=64 T=4096 fwd+bwd ours triton=3.6.0", new, median_ms=0.4, peak_mb=2.0,
                      floor_ms=0.002, x_floor=200.0, x_best_baseline=0.3)
    rows += _csv_rows("clipped_pg_loss B=64 T=4096 fwd+bwd eager triton=3.6.0", new, median_ms=1.3, peak_mb=12.0,
                      floor_ms=0.002, x_floor=650.0)
    for N in (8, 16):
        shape = f"B=1 N={N} H=32 P=1024 R=256 D=128 rho={N * 1280 / (1024 + N * 256):.2f}"
        rows += _csv_rows(f"dualkv_sweep {shape} fwd+bwd ours triton=3.6.0", old, median_ms=1.0,
                          speedup_vs_sdpa=2.0, rho=3.0)
        rows += _csv_rows(f"dualkv_sweep {shape} fwd+bwd sdpa_replicated triton=3.6.0", old, median_ms=2.0)
    with open(tmp_path / "kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=R.FIELDS)
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "kernels.md").write_text("a table with only clipped_pg_loss\n")
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    monkeypatch.setattr(BK, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--report-only"])
    assert BK.main() == 0

    lines = (tmp_path / "kernels.md").read_text().splitlines()
    assert lines[2] == BK.HEADER and all(ln.count("|") - 1 == BK.N_COLS for ln in lines[2:])
    assert "--report-only" in lines[0] and "aaa1111, bbb2222" in lines[0]
    body = lines[4:]
    assert [BK._kernel_of(ln) for ln in body] == ["fused_logprob", "dualkv_attention", "clipped_pg_loss"]
    fl, dk, pg = body
    assert "(micro-batch 8x1024) | fwd+bwd | 40.000 | compile | 20.000 | 2.00 |" in fl
    assert fl.endswith("| aaa1111 2026-01-01 00:10 |")
    assert "| 5.000 | sdpa_replicated | 8.000 | 0.62 | 100.000 |" in dk and "| 2.000 | 2.50 | 10 / 10 |" in dk
    # the newest ours and eager, the old compile as best baseline, and the row says so
    assert "| 0.400 | compile | 0.700 | 0.57 | 1.300 | 0.700 |" in pg
    assert pg.endswith("| bbb2222 2026-01-02 05:06; compile: aaa1111 2026-01-01 00:10 |")
    sweep = (tmp_path / "dualkv_sweep.md").read_text().splitlines()
    assert sweep[2].endswith("| measured |") and len(sweep) == 6
    assert sweep[4] == "| 8 | 1024 | 256 | 3.33 | 1.000 | 2.000 | 2.00x | aaa1111 2026-01-01 00:10 |"


@pytest.mark.parametrize("only", [["grpo_loss"], ["dualkv_sweep"]])
def test_only_choices_are_accepted(only):
    import benchmarks.bench_kernels as BK

    assert set(only) <= set(BK.KERNEL_ORDER + [BK.SWEEP])
    assert set(BK.BUILDERS) == set(BK.KERNEL_ORDER)


def test_rows_sweep_table_and_plot_are_written(tmp_path, monkeypatch):
    """The writing half of a GPU run, on CPU: rows with provenance, the sweep's rows, table and plot."""
    import torch

    import benchmarks._results as R
    import benchmarks.bench_kernels as BK

    monkeypatch.setattr(R, "RESULTS", tmp_path)
    monkeypatch.setattr(BK, "RESULTS", tmp_path)
    monkeypatch.setattr(BK, "SMOKE", True)
    monkeypatch.setattr(BK, "SKIP_COMPILE", True)
    dev, g = torch.device("cpu"), torch.Generator().manual_seed(0)
    rates = {"bw": 1e10, "mm_bf16": 1e11, "mm_fp8": 2e11}
    rows = []
    for case in BK.clipped_pg_cases(dev, g, True):
        BK.run_case(case, rates, True, rows)
    BK.save_rows(rows, "9.9")
    csv_rows = R.read_rows("kernels.csv")
    ours = [r for r in csv_rows if r["config"] == "clipped_pg_loss B=4 T=50 fwd+bwd ours triton=9.9"]
    assert {r["metric"] for r in ours} == {"median_ms", "peak_mb", "floor_ms", "x_floor", "x_best_baseline"}
    assert all(r["hardware"] and r["commit"] for r in ours)
    points = BK.run_sweep(dev, True, "9.9", write=True)
    assert [(p["N"], p["P"], p["R"]) for p in points] == BK.sweep_configs(True)[0]
    sweep = [r for r in R.read_rows("kernels.csv") if r["config"].startswith("dualkv_sweep ")]
    assert {r["metric"] for r in sweep} == {"median_ms", "speedup_vs_sdpa", "rho"}
    md = BK.sweep_markdown(points, R.provenance(), True)
    assert md.count("\n| ") == 1 + len(points)
    BK.sweep_plot(points, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
