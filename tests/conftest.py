import importlib
import os
import pkgutil
import random

import pytest
import torch

# Triton decides at decoration time whether kernels run in its interpreter, so this
# must be set before anything imports nmst_fast/kernels/. Without a GPU, CI runs every Triton
# kernel on CPU tensors this way (small shapes only: the interpreter is slow).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Decorate every kernel now: a test that unsets the variable (to check what needs it) must not be
    # the first to import a kernel module, which would then hold compiled kernels for the tests after it
    # on the same worker (which tests share a worker depends on xdist's scheduling).
    import nmst_fast.kernels

    for _module in pkgutil.iter_modules(nmst_fast.kernels.__path__):
        importlib.import_module(f"nmst_fast.kernels.{_module.name}")

    # tl.sort and tl.topk (the candidate lists) swap through xor_sum reductions, which the interpreter
    # runs one element at a time in Python (~95% of an interpreted candidate scan). Xor is associative
    # and commutative, so numpy's reduction gives the same bits; other reductions keep Triton's code.
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interpreter

    _xor_combine = getattr(tl.standard, "_xor_combine", None)
    _reduce = getattr(_interpreter, "ReduceOps", None)
    if _xor_combine is not None and _reduce is not None and hasattr(_reduce, "apply_impl"):
        _triton_apply_impl = _reduce.apply_impl

        def _apply_impl(self, input, *args, **kwargs):
            if getattr(self, "combine_fn", None) is _xor_combine and not args and not kwargs:
                try:
                    data, axis, keep_dims = input[0].handle.data, self.axis, self.keep_dims
                except (AttributeError, IndexError, TypeError):  # another Triton's internals: its own path
                    pass
                else:
                    return self.to_tensor(np.bitwise_xor.reduce(data, axis=axis, keepdims=keep_dims), input[0].dtype)
            return _triton_apply_impl(self, input, *args, **kwargs)

        _reduce.apply_impl = _apply_impl

# Under pytest-xdist (`-n auto`) each worker is a process with torch's default of one thread per
# core: on CI's 2 cores, 2 workers x 2 threads would oversubscribe the cores. Share them out.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


WORDS = "the river flows past stone and reed while bells ring out over the harbor".split()


@pytest.fixture
def corpus(tmp_path):
    """A WikiText-style directory (train / valid / test .txt) of random lines of 12-30 words."""
    rng = random.Random(3)
    data = tmp_path / "wikitext"
    data.mkdir()
    for split, n in (("train", 40), ("valid", 8), ("test", 8)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 30))) for _ in range(n)]
        (data / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return data


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Exit status 5 (no tests ran), e.g. every test asked for is slow and deselected by pyproject.toml's
    `-m 'not slow'`: say which marker expression chose nothing and how to run the slow tests."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        deselected = len(terminalreporter.stats.get("deselected", []))  # (under xdist the workers deselect)
        terminalreporter.write_line(
            f"no tests ran ({f'{deselected} deselected' if deselected else 'none selected'} by -m "
            f"{config.getoption('markexpr')!r}): -m slow runs the slow tests, -m 'slow or not slow' every test",
            red=True, bold=True)
