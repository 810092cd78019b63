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


def test_finish_load_groups_count_loads_separated_by_math():
    """``compile_check --finish`` reads the one-launch step's tail off nvdisasm's listing: between the
    row's arrival (the first 32-bit atomic add) and the batch's count (the 64-bit one), a load after
    fp64 or special-function math starts a new group; loads before the arrival or after the count,
    and integer work between loads, do not."""
    from kernels.compile_check import finish_load_groups

    def listing(*opcodes: str) -> str:
        return "\n".join(f"        /*{16 * i:04x}*/                   {op} R2, R4 ;" for i, op in enumerate(opcodes))

    tail = ["LDG.E R1", "ATOMG.E.ADD.STRONG.GPU", "LDG.E.STRONG.GPU", "IADD3", "LDG.E",
            "DFMA", "MUFU.LG2", "LDG.E.64", "DADD", "STG.E.64", "ATOMG.E.ADD.64.STRONG.GPU", "LDG.E"]
    assert finish_load_groups(listing(*tail)) == 2
    assert finish_load_groups(listing(*[op for op in tail if op != "LDG.E.64"])) == 1
    assert finish_load_groups(listing("LDG.E", "DFMA", "STG.E")) is None  # no finish: not a one-launch step


def test_one_launch_finish_loads_in_one_group():
    """The one-launch steps (greedy, sampling, top-k; NMST) issue every load of their finish at once:
    the partials, eos's logit, the seed. A load placed after the head's float64 math waits for it,
    each such group an L2 round trip on the step's tail (the code before this check had 3-5)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--finish", "--only", "scan_select nmst"],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    groups = [line.split()[1] for line in result.stdout.splitlines() if line.strip().startswith("finish:")]
    assert len(groups) >= 5 and set(groups) == {"1"}, result.stdout
