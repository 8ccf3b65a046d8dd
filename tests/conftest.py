import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no test reads the Hugging Face hub: a hub id that is not a local folder (a fake vLLM engine's "some/model") fails at
# once instead of retrying the network for about 20 s per call
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _share_cores_among_workers() -> None:
    """Under pytest-xdist every worker is one process: give each cores // workers torch threads, and cap what a
    script's `torch.set_num_threads(args.threads)` asks for at that share, so the workers do not oversubscribe."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import torch

    share = max(1, (os.cpu_count() or 1) // workers)
    set_threads = torch.set_num_threads
    set_threads(share)
    torch.set_num_threads = lambda n: set_threads(max(1, min(int(n), share)))


_share_cores_among_workers()


def _keep_freed_memory() -> None:
    """Every test process keeps the memory it frees (llm.keep_freed_memory, the scripts' --keep-freed-memory: where
    memory comes from changes, nothing computed does): the suite's many short runs otherwise fault their tensors'
    pages in again and again (SCOPE's learning test: 2.2 million page faults and 58 s, against 0.3 million and 56 s).
    Memory bounds are measured in processes of their own (tests/test_real_vocab_memory.py, tests/_sharded_load.py)."""
    if sys.platform.startswith("linux"):
        from algos._llm import keep_freed_memory

        try:
            keep_freed_memory()
        except SystemExit:  # not glibc: the allocator as it is
            pass


_keep_freed_memory()


# Tests whose outcome depends on floating-point reduction order or the CPU's vector path: learning tests (a gain
# against a margin) and equalities between two computations (within a tolerance). They carry the `numerics` mark,
# and .ci/run runs them a second time under ATEN_CPU_CAPABILITY=avx2, the kernels an AVX2-only CPU takes.
NUMERICS = re.compile(r"learn|equal|match|same|unchanged|precision|agree|close|identical|against")


# The longest test files (seconds of one idle core, measured on the suite), sent to the two workers first so that no
# long file starts last and runs alone (pytest.ini: --no-loadscope-reorder keeps this order); the rest follow by
# their number of tests, as pytest-xdist orders them by default. A scheduling hint only: it changes no test.
LONGEST_FILES = ["test_step_correction.py", "test_sharding.py", "test_tree_rollout_grpo.py",
                 "test_semi_online.py", "test_spec_rl.py", "test_espo.py", "test_spec_decode.py", "test_sfpo.py",
                 "test_dapo.py"]


def _schedule(items) -> None:
    count = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda it: (rank.get(it.path.name, len(rank)), -count[it.path.name], it.path.name))


def pytest_collection_modifyitems(config, items):
    import torch

    _schedule(items)
    for item in items:
        if NUMERICS.search(item.originalname or item.name):
            item.add_marker(pytest.mark.numerics)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Environment variables a test sets stay with that test: the vLLM seam's engine sets RANK, WORLD_SIZE and
    MASTER_ADDR (its external launcher reads them), and a later one-process test in the same worker would read them as a
    distributed launch."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
