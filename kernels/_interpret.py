"""Make Triton's CPU interpreter usable however the process was started.

`TRITON_INTERPRET=1` runs kernels on CPU through numpy, which is how the test suite checks kernels on a machine
without a GPU. Triton 3.9 reads the variable when `@triton.jit` *decorates* a function, not when a kernel is
launched: every function decorated while the variable was unset (Triton's own `tl.sum`, `tl.max`,
`tl.cumsum`, ... at `import triton`, and our kernels at import of their module) is compiled-only and raises
"Cannot call @triton.jit'd outside of the scope of a kernel" inside the interpreter. Other libraries import
Triton early (`import transformers` does), so in one pytest process the variable is often set too late.

`use_interpreter(module_globals)` fixes that at launch time: when the variable asks for the interpreter, it
swaps every compiled-only `JITFunction` in `triton.language.standard` and in the caller's module for an
interpreted copy (once; cheap afterwards). It never runs unless the interpreter was asked for, so GPU runs
are untouched.

It also holds the two helpers every kernel file shares:
- `use_triton(module_globals, *tensors)`: whether to launch the Triton kernels (all tensors on CUDA, or the
  interpreter asked for; then the caller's kernels are made interpretable first) or fall back to the
  pure-torch reference;
- `new_output(shape, device, dtype)`: an output buffer for a kernel to fill. When `POISON_OUTPUTS` is set
  (the tests set it) the buffer starts as NaN (floating dtypes) or -7 (integer dtypes, a value no kernel
  here writes), so an element a kernel forgets to write fails the comparison with the reference.
"""
from __future__ import annotations

import os

import torch


class _Absent:
    """Stands in for `triton` where it has no wheels (macOS, Windows): decorators leave a function as it is, any
    attribute is another stand-in, and use_triton() is False, so every public op runs its pure-torch reference."""

    cdiv = staticmethod(lambda a, b: -(-a // b))  # the two pure helpers the shape checks use
    next_power_of_2 = staticmethod(lambda n: 1 << max(0, int(n) - 1).bit_length())

    def __getattr__(self, name):
        return _Absent()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Absent()


try:
    import triton
    import triton.language as tl
    import triton.testing  # noqa: F401 - triton.testing.do_bench for the benchmarks
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    HAVE_TRITON = True
except ImportError:
    triton = tl = _Absent()
    InterpretedFunction = JITFunction = type("NoTriton", (), {})
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "POISON_OUTPUTS", "interpreter_requested", "new_output", "tl", "triton", "use_interpreter",
           "use_triton"]

POISON_OUTPUTS = False  # tests set True: outputs start as NaN / -7, so an element a kernel forgets to write fails


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _swap(namespace: dict) -> None:
    for name, obj in list(namespace.items()):
        if isinstance(obj, JITFunction):
            namespace[name] = InterpretedFunction(obj.fn)


def use_interpreter(module_globals: dict) -> None:
    """Swap compiled-only Triton functions for interpreted ones (stdlib and the given module)."""
    if not interpreter_requested():
        return
    std = tl.standard
    if any(isinstance(v, JITFunction) for v in vars(std).values()):
        _swap(vars(std))
        # `tl.sum` etc. are re-exported names: point them at the interpreted copies too.
        for name, obj in vars(std).items():
            if isinstance(obj, InterpretedFunction) and isinstance(getattr(tl, name, None), JITFunction):
                setattr(tl, name, obj)
    _swap(module_globals)


def use_triton(module_globals: dict, *tensors: torch.Tensor) -> bool:
    """True when the kernels of the module with these globals should run on these tensors (see the docstring);
    always False without Triton."""
    if not HAVE_TRITON:
        return False
    if all(t.is_cuda for t in tensors):
        return True
    if interpreter_requested():
        use_interpreter(module_globals)
        return True
    return False


def new_output(shape, device, dtype: torch.dtype = torch.float32, fill: float | int | None = None) -> torch.Tensor:
    """An output buffer: uninitialised (or `fill`), or poisoned when POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        if dtype.is_floating_point:  # made in fp32 and cast, so that fp8 buffers get NaN too
            return torch.full(shape, float("nan"), device=device, dtype=torch.float32).to(dtype)
        return torch.full(shape, -7, device=device, dtype=dtype)
    if fill is None:
        return torch.empty(shape, device=device, dtype=dtype)
    return torch.full(shape, fill, device=device, dtype=dtype)
