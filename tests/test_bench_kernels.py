"""benchmarks/bench_kernels.py: the --smoke run goes through every code path on CPU (our kernels in Triton's
interpreter) and writes nothing; the table keeps its best-baseline logic and the --only merging of kernels.md.
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


def test_smoke_runs_every_path_and_writes_nothing():
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
    assert "ours_per_call" in out and "sdpa_replicated" in out
    assert "| kernel | shape | pass | ours ms | best baseline |" in out
    assert _snapshot() == before, "--smoke wrote into benchmarks/results"


def test_best_baseline_and_only_merging(tmp_path, monkeypatch):
    import benchmarks.bench_kernels as BK

    res = {"ours": (2.0, 10.0), "ours_per_call": (1.0, 5.0), "eager": (4.0, 50.0), "compile": (3.0, 20.0),
           "liger_flce": (2.5, 1.0)}
    assert BK.best_baseline(res) == ("liger_flce", (2.5, 1.0))  # ours* never count as a baseline
    assert BK.best_baseline({"ours": (1.0, 1.0)}) == (None, None)

    monkeypatch.setattr(BK, "RESULTS", tmp_path)
    prov = {"hardware": "GPU X", "versions": "v", "commit": "abc"}
    rates = {"bw": 1e12, "mm_bf16": 1e14, "mm_fp8": 2e14}
    full = [("fused_logprob", "N=1", "fwd+bwd", 1.0, res, ""),
            ("spec_rejection", "B=1", "fwd", 0.1, {"ours": (0.5, 0.0), "compile": (0.4, 0.0)}, ""),
            ("clipped_pg_loss", "B=2", "fwd+bwd", 0.1, {"ours": (0.3, 0.0), "eager": (0.6, 0.0)}, "")]
    text = BK.kernels_markdown(full, prov, rates)
    lines = text.splitlines()
    assert lines[2] == BK.HEADER and all(ln.count("|") - 1 == BK.N_COLS for ln in lines[2:])
    fl = next(ln for ln in lines if ln.startswith("| fused_logprob"))
    assert "| liger_flce | 2.500 | 0.80 |" in fl and "ours_per_call 1.000 ms" in fl
    assert "compile (spec_rejection)" in lines[0]
    # an old-format row (fewer columns) is dropped, the other kernels' rows stay, in KERNEL_ORDER
    (tmp_path / "kernels.md").write_text(text + "| dualkv_attention | old | fwd+bwd | 1 | 2 | 3 |\n")
    redo = [("clipped_pg_loss", "B=2", "fwd+bwd", 0.1, {"ours": (0.2, 0.0), "eager": (0.6, 0.0)}, "")]
    BK.write_markdown(redo, prov, rates, keep_others=True)
    merged = (tmp_path / "kernels.md").read_text().splitlines()
    rows = [ln for ln in merged[4:]]
    assert [ln.split(" | ")[0][2:] for ln in rows] == ["fused_logprob", "clipped_pg_loss", "spec_rejection"]
    assert "| 0.200 |" in rows[1] and "Rows for clipped_pg_loss re-measured" in merged[0]


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
