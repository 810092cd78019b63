import os

import torch

# Triton decides at decoration time whether kernels run in its interpreter, so this
# must be set before anything imports kernels/. Without a GPU, CI runs every Triton
# kernel on CPU tensors this way (small shapes only: the interpreter is slow).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
