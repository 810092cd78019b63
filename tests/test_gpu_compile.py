"""Every Triton kernel compiles for an H100/H200 (sm_90) — checked on CPU machines too.

The interpreter runs the kernels' math in CI; this runs Triton's real compiler (ptxas ships
with Triton) on the launch variants the CUDA paths use, in a subprocess without
TRITON_INTERPRET, so a kernel that only works in the interpreter fails here.

The fast set compiles one variant of each kernel with this environment's Triton; every variant
(4–6 minutes on 2 cores) is the slow test, which compiles with the Triton in the folder
``NMST_COMPILE_TRITON`` names when it is set (``.ci/run`` points it at the GPU machines' Triton).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# One launch variant of each kernel, the cheaper ones to compile: the one-launch step's draw and its
# top-k finish (the lanes' candidate lists), the row draw, the loss's three row kernels (softcap on) and
# the gradient's cast.
FAST_VARIANTS = ("scan_select nmst draw float32 splits=2", "scan_select nmst top_k=4 top_p=None float32 splits=2",
                 "row draw nmst float32 wide", "split_lse bf16 softcap", "split_softmax_grad bf16 softcap",
                 "split_statistics bf16 softcap", "scale_cast float32 -> bfloat16")


def _compile_check(ptx_dir: Path, *flags: str, triton_dir: str | None = None) -> str:
    """tools/compile_check.py's output, its run checked: every variant compiled, one PTX file each."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "tools/compile_check.py", "--arch", "90", "--ptx", str(ptx_dir), *flags],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 of the variants failed" in result.stdout
    compiled = result.stdout.count("\nok   ") + result.stdout.startswith("ok   ")
    ptx = list(ptx_dir.glob("*.ptx"))
    assert len(ptx) == compiled > 0  # one PTX file per variant (names are distinct)
    assert all(".entry" in path.read_text() for path in ptx)
    return result.stdout


def test_one_variant_of_each_kernel_compiles_for_sm90(tmp_path):
    out = _compile_check(tmp_path, *(arg for name in FAST_VARIANTS for arg in ("--only", name)))
    assert out.count("\nok   ") == len(FAST_VARIANTS)  # each name selected one variant


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
    triton_dir = os.environ.get("NMST_COMPILE_TRITON")
    if triton_dir:
        triton_dir = str((REPO / triton_dir).resolve())
        assert (Path(triton_dir) / "triton").is_dir(), f"NMST_COMPILE_TRITON={triton_dir} holds no triton package"
    out = _compile_check(tmp_path, triton_dir=triton_dir)
    if triton_dir:  # the run compiled with that Triton, not this environment's
        assert out.startswith("Triton ") and f"({Path(triton_dir) / 'triton'})" in out.splitlines()[0], out[:500]
