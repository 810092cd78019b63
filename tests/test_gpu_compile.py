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
    result = subprocess.run([sys.executable, "-m", "nmst_fast.kernels.compile_check", "--arch", "90"],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 of the variants failed" in result.stdout


def test_sass_loop_statistics_parse_nvdisasm_output():
    """``compile_check --loops`` reads loops off nvdisasm's listing: a backward branch to a label
    spans the loop (forward branches inside it do not start one); opcodes are counted without
    their modifiers and predicates."""
    from nmst_fast.kernels.compile_check import sass_loops

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


def test_finish_loads_follow_the_loaded_registers():
    """``compile_check --finish`` reads the one-launch step's tail off nvdisasm's listing: between the
    row's arrival (the first 32-bit atomic add) and the batch's count (the 64-bit one), a group of
    loads ends at the first instruction naming a register they write (a 64-bit load writes a pair),
    a load after that (or one whose address is loaded data) starts another, and fp64 / MUFU math
    issued while a group is in flight counts as under it; loads outside the finish do not count."""
    from nmst_fast.kernels.compile_check import FinishLoads, finish_loads

    def listing(*instructions: tuple[str, str]) -> str:
        return "\n".join(f"        /*{16 * i:04x}*/                   {op} {operands} ;"
                         for i, (op, operands) in enumerate(instructions))

    arrival = ("ATOMG.E.ADD.STRONG.GPU", "PT, R5, desc[UR4][R2.64+0xc], R5")
    count = ("ATOMG.E.ADD.64.STRONG.GPU", "PT, R4, desc[UR4][R4.64], R6")
    tail = [("LDG.E", "R1, desc[UR4][R2.64]"),  # before the arrival (eos's logit): not the finish's
            arrival,
            ("LDG.E.STRONG.GPU", "R10, desc[UR4][R12.64]"),
            ("IADD3", "R14, P0, R14, 0x4, RZ"),
            ("LDG.E.64", "R20, desc[UR4][R14.64]"),
            ("DFMA", "R30, R1, R34, R36"),  # the survival terms, from the value loaded before the arrival
            ("MUFU.LG2", "R38, R30"),
            ("FADD", "R40, R21, R1"),  # the pair's upper half: the first group ends
            ("DADD", "R42, R44, R46"),
            ("LDG.E", "R50, desc[UR4][R16.64]"),
            ("LDG.E", "R52, desc[UR4][R50.64]"),  # its address is the load before: a third round trip
            ("DMUL", "R54, R56, R58"),
            ("STG.E", "desc[UR4][R18.64], R52"),
            count,
            ("LDG.E", "R60, desc[UR4][R2.64]")]
    assert finish_loads(listing(*tail)) == FinishLoads(groups=3, math_under_loads=3)
    independent = tail[:10] + [("LDG.E", "R52, desc[UR4][R22.64]")] + tail[11:]
    assert finish_loads(listing(*independent)) == FinishLoads(groups=2, math_under_loads=3)
    assert finish_loads(listing(("LDG.E", "R1, desc[UR4][R2.64]"), ("DFMA", "R4, R1, R1, R1"))) is None


def test_one_launch_finish_loads_once_under_the_survival_terms():
    """The one-launch steps (greedy, sampling, top-k; NMST and ST) issue every load of their finish at
    once (the partials, the seed: one L2 round trip on the step's tail; the code before the
    nineteenth session had 3-5) and run the head's survival terms (logσ, log1mexp: ~200 fp64
    instructions) while those loads are in flight, eos's logit having been loaded before the row's
    arrival (before the twentieth session: none ran under them)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "nmst_fast.kernels.compile_check", "--finish", "--only", "scan_select"]
    result = subprocess.run(command,
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    finishes = {name.split(" (")[0][5:]: finish.split() for name, finish in zip(lines, lines[1:])
                if finish.strip().startswith("finish:")}
    with_head = {name: words for name, words in finishes.items() if " va " not in name}
    assert len(with_head) >= 10, result.stdout
    for name, words in with_head.items():
        groups, math_under = int(words[1]), int(words[4])
        assert groups == 1 and math_under >= 100, (name, " ".join(words))
