import os

import torch

# Without a GPU, Triton kernels (ours and the baselines', such as Liger-Kernel's) run in Triton's
# interpreter, as in tests/. Triton decides this when a kernel is decorated: set it before any import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
