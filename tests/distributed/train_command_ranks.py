"""Run under torchrun (gloo): ``python -m train`` twice on one --out in one process group, for the test
of the command under torchrun (tests/test_train_ddp.py) with one launch instead of two.

    torchrun --standalone --nproc_per_node 2 tests/distributed/train_command_ranks.py OUT -- TRAIN_FLAGS...

The first run trains into OUT; rank 0 then keeps its results as OUT/first-results.json and its
checkpoints' modification times as OUT/first-checkpoints.json; the second,
on the same OUT, must resume every finished run. The process group the first run joins is kept for
the second (kept_group.py).
"""

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from kept_group import kept_group  # this script's folder leads sys.path

from train.__main__ import main as train


def main() -> None:
    out, flags = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    with kept_group():
        train(["--out", str(out), *flags])
        if dist.get_rank() == 0:
            shutil.copyfile(out / "results.json", out / "first-results.json")
            stamps = {str(path.relative_to(out)): path.stat().st_mtime_ns for path in out.glob("*/checkpoint.pt")}
            (out / "first-checkpoints.json").write_text(json.dumps(stamps))
        dist.barrier()
        train(["--out", str(out), *flags])


if __name__ == "__main__":
    main()
