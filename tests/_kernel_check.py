"""Shared checks for the kernel tests (tests/test_kernels_*.py).

Tolerances derive from the dtype: compare the kernel and eager torch in the same dtype
against a "gold" reference in higher precision (fp64 for fp32 inputs, fp32 for bf16/fp16 inputs). The
kernel passes when its error is at most FACTOR x eager torch's error, with a floor of a few ulps of the
output's scale so that an exactly-right eager result does not demand the impossible: 16 ulps for fp32, 1 ulp for a
16-bit output (where 16 ulps x FACTOR would let a result 100% off its scale pass).

On a machine without CUDA the kernels run through Triton's CPU interpreter: the `interpret` fixture sets
TRITON_INTERPRET=1 for the duration of one test (kernels/_interpret.py makes that work even when Triton was
imported earlier in the process), so the rest of the suite is untouched.
"""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
FACTOR = 8.0


def gold_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def assert_close_to_gold(name: str, out: torch.Tensor, eager: torch.Tensor, gold: torch.Tensor,
                         factor: float = FACTOR, ulps: float | None = None) -> None:
    assert out.shape == gold.shape, f"{name}: shape {tuple(out.shape)} != {tuple(gold.shape)}"
    eps = torch.finfo(out.dtype).eps  # a few ulps of the dtype the kernel stores
    ulps = (16.0 if out.dtype.itemsize >= 4 else 1.0) if ulps is None else ulps
    out, eager, gold = out.double().cpu(), eager.double().cpu(), gold.double().cpu()
    assert torch.isfinite(out).all(), f"{name}: kernel output has NaN/inf (unwritten elements?)"
    err = (out - gold).abs().max().item()
    err_eager = (eager - gold).abs().max().item()
    floor = ulps * eps * max(gold.abs().max().item(), 1e-30)
    tol = factor * max(err_eager, floor)
    assert err <= tol, f"{name}: kernel error {err:.3e} > {tol:.3e} (eager torch error {err_eager:.3e})"


@pytest.fixture
def interpret(monkeypatch):
    """Run kernels through the interpreter on CPU; on a CUDA machine the real kernels run instead."""
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def poison(monkeypatch):
    """Make every kernel allocate its outputs filled with NaN (-7 for integer outputs): see kernels/_interpret.py."""
    import kernels._interpret

    monkeypatch.setattr(kernels._interpret, "POISON_OUTPUTS", True)
