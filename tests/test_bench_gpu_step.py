"""benchmarks/bench_gpu_step.py on a machine without a GPU: a clear exit, the physical floors, and the table.
(Its --smoke run needs TRL, a benchmark-only dependency, so the suite does not run it; timings are never asserted.)"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import bench_gpu_step as B  # noqa: E402


def test_without_a_gpu_it_exits_2_with_a_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "benchmarks/bench_gpu_step.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--smoke" in r.stderr


def test_floors_by_hand():
    """135M parameters, 128 new tokens, 4 TB/s, 700 TFLOP/s: decode 128 x 270 MB / 4 TB/s = 8.64 ms; update
    6 x 135e6 x 256 x 168 / 700e12 = 49.8 ms."""
    f = B.floors(135_000_000, 128, {"copy_GBps": 4000.0, "bf16_TFLOPs": 700.0})
    assert f["rollout_floor_s"] == pytest.approx(128 * 2 * 135e6 / 4e12)
    assert f["update_floor_s"] == pytest.approx(6 * 135e6 * 256 * 168 / 700e12)


def test_markdown_table_from_the_csv(tmp_path, monkeypatch):
    """The table takes the newest rows of each side, and the ratio ours / the fastest TRL setting with the same
    gradient checkpointing: ours (off) against trl-nockpt only, ours-ckpt against trl and trl-liger (on)."""
    import benchmarks._results as R

    monkeypatch.setattr(R, "RESULTS", tmp_path)
    monkeypatch.setenv("PROVENANCE_COMMIT", "abc1234")
    floors = {"rollout_floor_s": 0.01, "update_floor_s": 0.05}
    side = {"step_s": 1.0, "rollout_s": 0.6, "update_s": 0.4, "rollout_tokens_per_s": 50000.0, "peak_GB": 10.0, **floors}
    cfg = "135m new_tokens=128 prompts=32 group=8 micro=64 bf16"
    R.append_rows("gpu_step.csv", "gpu_step", "b", f"{cfg} trl", 0, {**side, "step_s": 4.0}, command="c")
    R.append_rows("gpu_step.csv", "gpu_step", "b", f"{cfg} trl-nockpt", 0, {**side, "step_s": 2.0}, command="c")
    R.append_rows("gpu_step.csv", "gpu_step", "b", f"{cfg} ours-ckpt", 0, {**side, "step_s": 1.6}, command="c")
    R.append_rows("gpu_step.csv", "gpu_step", "b", f"{cfg} trl-liger", 0, {**side, "step_s": 5.0}, command="c")
    R.append_rows("gpu_step.csv", "gpu_step", "b", f"{cfg} ours", 0,
                  {**side, "rollout_fp32_dynamic_tokens_per_s": 10000.0, "rollout_bf16_dynamic_tokens_per_s": 12000.0,
                   "logprob_mismatch": 0.01}, command="c")
    B.write_markdown()
    text = (tmp_path / "gpu_step.md").read_text()
    rows = {ln.split(" | ")[2]: ln for ln in text.splitlines() if ln.startswith("| 135m | 128 |")}
    assert "| off | common.generate" in rows["ours"] and "| 1.00 |" in rows["ours"]
    assert rows["ours"].count("**") == 2 and "**0.50**" in rows["ours"]  # 1.0 / 2.0 (trl-nockpt), not / 4.0
    assert "**0.40**" in rows["ours-ckpt"]  # 1.6 / min(4.0, 5.0): the TRL sides that checkpoint
    assert "| on | HF generate" in rows["trl-liger"] and "| 5.00 |" in rows["trl-liger"] and "**" not in rows["trl"]
    assert "(5.0x previous)" in text and "abc1234" in text
