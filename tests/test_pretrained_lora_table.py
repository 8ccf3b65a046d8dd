"""benchmarks/pretrained_lora_table.py's warm-start targets: every worked solution states the generator's own leg
counts and scores 1 under the task's verifier (the one the GRPO runs use), and none is trained on a held-out problem."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

pytest.importorskip("reasoning_gym")

from algos._llm import ReasoningGymTask  # noqa: E402
from benchmarks import pretrained_lora_table as table  # noqa: E402


def test_worked_solutions_are_right_by_the_tasks_own_verifier():
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    task = ReasoningGymTask(table.TASK[len("rg:"):])
    held_out = {e.prompt for e in task.test}
    assert task.train and not held_out & {e.prompt for e in task.train}
    for ex in task.train:
        solution = table.worked_solution(ex.answer.entry)
        assert task.verify(solution, ex.answer)[0] == 1.0, solution
        parts = re.findall(r"([a-z ]+): (\d+) legs x (\d+) = (\d+)\.", solution)
        assert len(parts) == len(ex.answer.entry["metadata"]["animals"]), solution
        for animal, legs, count, product in parts:
            assert ANIMALS[animal.strip()] == int(legs) and int(legs) * int(count) == int(product), solution
    wrong = table.worked_solution(task.train[0].answer.entry).replace("\\boxed{", "\\boxed{1")  # another total
    assert task.verify(wrong, task.train[0].answer)[0] == 0.0
