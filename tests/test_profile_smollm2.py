"""benchmarks/profile_smollm2.py's table on planted rows: a step is generation + update + its share of evaluation, a
speed-up is only taken against the same machine's baseline row (fp32 at the code before the speed-ups; else its first
row), and a configuration measured twice is averaged."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _results  # noqa: E402
from benchmarks import profile_smollm2 as prof  # noqa: E402


def plant(root: Path, rows: dict[str, dict], profile: str) -> None:
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    for label, metrics in rows.items():
        for m in metrics if isinstance(metrics, list) else [metrics]:  # a list: the label measured several times
            _results.append_rows(prof.CSV, label, "algos/grpo.py", "smollm2-135m words", 0, m, command="planted")
    (results / "smollm2_step_profile.txt").write_text(profile)


def test_speed_ups_within_a_machine_and_the_matmul_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(_results, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(prof, "ROOT", tmp_path)
    row = lambda gen, train, per: {"gen_s": gen, "train_s": train, "eval_s_per_problem": per,  # noqa: E731
                                   "eval_per_step": 10}
    plant(tmp_path, {"fp32@old": row(20.0, 40.0, 0.4),          # xeon: step 64
                     "epyc/fp32@old": row(10.0, 30.0, 1.0),     # epyc: step 50, its machine's first row
                     "epyc/bf16@new": [row(4.0, 12.0, 1.0), row(6.0, 8.0, 1.0)],  # epyc: mean step 25
                     "epyc-c/bf16@new": row(5.0, 10.0, 0.5),    # epyc-c: step 20, measured before its baseline
                     f"epyc-c/{prof.BASELINE}": row(20.0, 35.0, 0.5)},  # epyc-c: step 60
          "## epyc/bf16@new (threads 1)\n  aten::mm   40.00%   4.000s   40.00%   4.000s   1ms   10\n")
    assert prof.machine_of("epyc/bf16@new") == ("epyc", "bf16@new")
    assert prof.machine_of("fp32@old") == ("xeon", "fp32@old")
    assert prof.matmul_seconds((tmp_path / "benchmarks/results/smollm2_step_profile.txt").read_text()) == \
        {"epyc/bf16@new": 4.0}
    table = prof.report()
    lines = {line.split(" | ")[0] + "|" + line.split(" | ")[1]: line for line in table.splitlines()
             if line.startswith("| xeon") or line.startswith("| epyc")}
    assert lines["| epyc-c|bf16"].endswith("| 20.0 | 3.00x |")  # against epyc-c's baseline, not its first row
    assert lines["| xeon|fp32"].endswith("| 64.0 | 1.00x |")
    assert lines["| epyc|fp32"].endswith("| 50.0 | 1.00x |")
    assert lines["| epyc|bf16"].endswith("| 25.0 | 2.00x |") and "| new | 2 | 5.0 | 10.0 |" in lines["| epyc|bf16"]  # against epyc's first row, not the xeon's
    # the update's non-matmul time removed: 25 - 10 + 4 = 19 s, 50 / 19 = 2.63x
    assert "`epyc/bf16@new`: 4.0 s of 10.0 s; step at least 19.0 s, at most 2.63x its machine's baseline" in table
