"""Every Triton kernel compiles for an H100/H200 (sm_90) — checked on CPU machines too.

The interpreter runs the kernels' math in CI; this runs Triton's real compiler (ptxas ships
with Triton) on the launch variants the CUDA paths use, in a subprocess without
TRITON_INTERPRET, so a kernel that only works in the interpreter fails here.
"""

import os
import subprocess
import sys
from pathlib import Path


def test_every_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--arch", "90"],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 of the variants failed" in result.stdout


def test_sass_loop_statistics_parse_nvdisasm_output():
    """``compile_check --loops`` reads loops off nvdisasm's listing: a backward branch to a label
    spans the loop (forward branches inside it do not start one); opcodes are counted without
    their modifiers and predicates."""
    from kernels.compile_check import sass_loops

    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/               @P0 BRA `(.L_x_2) ;
        /*0030*/                   MUFU.EX2 R5, R4 ;
.L_x_2:
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
.L_x_3:
        /*0060*/                   BRA `(.L_x_3);
"""
    loops = sass_loops(listing)
    assert [(loop.start, loop.end, loop.size) for loop in loops] == [(0x60, 0x60, 1), (0x10, 0x50, 5)]
    assert loops[1].opcodes == {"LDG": 1, "BRA": 2, "MUFU": 1, "BAR": 1}
    assert "BAR 1" in loops[1].summary()
