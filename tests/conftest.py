import os

import torch

# Triton decides at decoration time whether kernels run in its interpreter, so this
# must be set before anything imports nmst_fast/kernels/. Without a GPU, CI runs every Triton
# kernel on CPU tensors this way (small shapes only: the interpreter is slow).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n auto`) each worker is a process with torch's default of one thread per
# core: on CI's 2 cores, 2 workers x 2 threads would oversubscribe the cores. Share them out.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
