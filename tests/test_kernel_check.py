"""tests/_kernel_check.py: the tolerance rule the kernel tests share must reject a wrong result in every dtype."""
import pytest
import torch

from _kernel_check import assert_close_to_gold


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_eager_accepts_a_correctly_rounded_kernel(dtype):
    gold = torch.linspace(-3, 3, 101, dtype=torch.float64)
    out = gold.to(dtype)  # correctly rounded: the best a kernel in this dtype can do
    assert_close_to_gold(f"rounded {dtype}", out, out, gold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rel_error", [0.5, 0.1])
def test_a_result_off_by_a_tenth_of_its_scale_fails(dtype, rel_error):
    """With eager exact, the floor decides: 16 ulps x 8 of a bf16 output was 100% of the scale, so a kernel off by
    half its scale passed."""
    gold = torch.linspace(-3, 3, 101, dtype=torch.float64)
    eager = gold.to(dtype)
    wrong = eager.clone()
    wrong[7] += rel_error * 3.0
    with pytest.raises(AssertionError, match="kernel error"):
        assert_close_to_gold(f"wrong {dtype}", wrong, eager, gold)
