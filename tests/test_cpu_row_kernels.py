"""The C++ CPU row kernel (nmst_fast/kernels/cpu) against a float64 reference: the tempered logsumexp
over every column but one, on odd widths, any skipped column, per-row temperatures, extreme and
non-finite logits, strided rows; its build, and what happens when the build fails."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from nmst_fast.kernels import cpu

from helpers import slow

# The kernel's error on L: its float32 steps (z − max, the scale, exp2, the partial sums) on the terms
# that carry the sum, a few float32 ulps of the order-one quantities (the reference is exact to 1e-15).
ATOL = 4e-6


def kernels():
    ops = cpu.row_kernels()
    assert ops is not None, "the CPU row kernels did not build (see the warning logged above)"
    return ops


def reference(rows: torch.Tensor, skip: int, inverse) -> torch.Tensor:
    """float64 logsumexp over every column but ``skip`` of rows · inverse (per row)."""
    z = rows.double()
    if inverse is not None:
        z = z * inverse.double()[:, None]
    z = torch.cat([z[:, :skip], z[:, skip + 1:]], dim=1)
    return torch.logsumexp(z, dim=1)


def check(rows: torch.Tensor, skip: int, inverse=None) -> None:
    got = kernels().non_eos_lse(rows, skip, inverse)
    want = reference(rows, skip, inverse)
    assert got.dtype == torch.float64 and got.shape == want.shape
    finite = want.isfinite()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num())
    torch.testing.assert_close(got[finite], want[finite], atol=ATOL, rtol=1e-7)


@pytest.mark.parametrize("V", [2, 3, 15, 16, 17, 63, 64, 65, 127, 1000, 4099, 50257])
def test_every_width_and_skipped_column(V):
    gen = torch.Generator().manual_seed(V)
    rows = torch.randn(5, V, generator=gen) * 4
    for skip in sorted({0, 1 % V, V // 2, V - 2, V - 1}):
        check(rows, skip)


@pytest.mark.parametrize("seed", range(4))
def test_per_row_temperatures(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    A, V = 7, int(torch.randint(100, 3000, (), generator=gen))
    rows = torch.randn(A, V, generator=gen) * 5
    temperatures = torch.rand(A, generator=gen, dtype=torch.float64) * 3 + 0.05
    check(rows, int(torch.randint(0, V, (), generator=gen)), 1.0 / temperatures)


@pytest.mark.parametrize("scale,offset", [(1.0, 1e4), (1.0, -1e4), (1e3, 0.0), (30.0, 80.0), (1e-6, 0.0)])
def test_extreme_logits(scale, offset):
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(4, 3001, generator=gen) * scale + offset
    check(rows, 5)
    check(rows, 5, torch.tensor([1.0, 10.0, 0.1, 3.0], dtype=torch.float64))


def test_non_finite_logits():
    V = 200
    rows = torch.randn(8, V)
    rows[0, 10:] = -math.inf  # banned tokens: the rest renormalise
    rows[1, :] = -math.inf  # no finite non-eos logit: -inf
    rows[2, :] = -math.inf
    rows[2, 3] = 5.0  # the only finite logit is the skipped one: -inf
    rows[3, 150] = math.inf  # +inf
    rows[4, 1] = math.nan  # NaN before the skipped column
    rows[5, 190] = math.nan  # NaN after it
    rows[6, 3] = math.nan  # NaN in the skipped column is not read
    rows[7, 4] = -math.inf
    got = kernels().non_eos_lse(rows, 3, None)
    assert got[1] == -math.inf and got[2] == -math.inf and got[3] == math.inf
    assert got[4].isnan() and got[5].isnan() and not got[6].isnan()
    check(rows, 3)


def test_strided_rows_and_an_empty_table():
    table = torch.randn(9, 700) * 3
    check(table[::3], 11)  # row stride 3 × 700
    check(table[:, 50:650], 0)  # a column slice: row stride 700, width 600
    assert kernels().non_eos_lse(torch.empty(0, 10), 2, None).shape == (0,)


def test_bad_arguments_are_refused():
    ops = kernels()
    with pytest.raises(RuntimeError, match="unit column stride"):
        ops.non_eos_lse(torch.randn(10, 4).t(), 0, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.non_eos_lse(torch.randn(3, 4, dtype=torch.float64), 0, None)
    with pytest.raises(RuntimeError, match="skip"):
        ops.non_eos_lse(torch.randn(3, 4), 4, None)
    with pytest.raises(RuntimeError, match="inverse"):
        ops.non_eos_lse(torch.randn(3, 4), 0, torch.ones(3))
    logits = torch.randn(3, 4)
    before = logits.clone()
    args = (torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64), None, 1e-5, 200.0)
    with pytest.raises(RuntimeError, match="row index 3 outside"):
        ops.write_eos_column(logits, torch.tensor([0, 3]), 1, *args)
    with pytest.raises(RuntimeError, match="steps"):
        ops.write_eos_column(logits, torch.tensor([0, 1]), 1, args[0], torch.ones(2, dtype=torch.int32), None, 0.1, 1.0)
    assert torch.equal(logits, before)  # refused before anything is written


def test_a_failed_build_is_logged_and_leaves_torch_ops(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'nmst_fast_cpu': c++: not found")

    cpu.native_module.cache_clear()
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    try:
        with caplog.at_level(logging.WARNING, logger="nmst_fast"):
            assert cpu.row_kernels() is None
        assert "could not be built" in caplog.text and "c++: not found" in caplog.text
        monkeypatch.setenv(cpu.DISABLE_ENV, "0")
        cpu.native_module.cache_clear()
        assert cpu.row_kernels() is None
    finally:
        cpu.native_module.cache_clear()


def test_the_first_build_on_a_machine_says_so_and_how_long_it_took(monkeypatch, caplog):
    built = object()
    cpu.native_module.cache_clear()
    monkeypatch.setattr(cpu, "build", lambda capability: built)
    try:
        monkeypatch.setattr(cpu, "_built_before", lambda capability: False)
        with caplog.at_level(logging.WARNING, logger="nmst_fast"):
            assert cpu.native_module() is built
        assert "building the CPU kernels" in caplog.text and "the CPU kernels are built (" in caplog.text
        caplog.clear()
        cpu.native_module.cache_clear()
        monkeypatch.setattr(cpu, "_built_before", lambda capability: True)
        with caplog.at_level(logging.WARNING, logger="nmst_fast"):
            assert cpu.native_module() is built
        assert caplog.text == ""  # a build already there: nothing to say
    finally:
        cpu.native_module.cache_clear()


def test_a_lock_file_a_killed_build_left_does_not_stall_the_next_build(tmp_path, monkeypatch):
    """torch's builder waits without end for its lock file to go; one a killed build left (here: made by hand) is
    cleared under the kernels' own lock, which the build holds while torch's builder runs."""
    import fcntl

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpu._build_directory("DEFAULT")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").touch()
    built = object()

    def load(**kwargs):
        assert not (directory / "lock").exists()
        with open(directory / "nmst_fast.lock") as other:  # another process's try: the lock is held
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return built

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu.build("DEFAULT") is built
    with open(directory / "nmst_fast.lock") as other:  # released once the build returns
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_build_flags_follow_torchs_capability():
    assert "-mavx512f" in cpu.build_flags("AVX512") and "-DCPU_CAPABILITY_AVX512" in cpu.build_flags("AVX512")
    assert "-mavx2" in cpu.build_flags("AVX2") and not any("avx512" in f for f in cpu.build_flags("AVX2"))
    assert cpu.build_flags("SVE256") == ["-O3", "-ffp-contract=off", "-fopenmp", "-DCPU_CAPABILITY=DEFAULT"]


# Each build registers the same op namespace, so every other capability is built in its own process.
@pytest.mark.parametrize("capability", [slow("AVX2"), slow("DEFAULT")])
def test_the_other_capabilities_build_and_agree(capability):
    if capability == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.fail("this machine cannot run the AVX2 build; run this test where torch reports AVX2 or AVX512")
    script = textwrap.dedent(f"""
        import math, torch
        from nmst_fast.kernels import cpu
        module = cpu.build({capability!r})
        ops = torch.ops.nmst_fast_cpu
        gen = torch.Generator().manual_seed(3)
        for V in (5, 17, 1000, 50257):
            rows = torch.randn(6, V, generator=gen) * 4
            rows[0, 1] = -math.inf
            inverse = torch.rand(6, generator=gen, dtype=torch.float64) + 0.2
            for skip in (0, V // 2, V - 1):
                z = rows.double() * inverse[:, None]
                want = torch.logsumexp(torch.cat([z[:, :skip], z[:, skip + 1:]], 1), 1)
                torch.testing.assert_close(ops.non_eos_lse(rows, skip, inverse), want, atol={ATOL}, rtol=1e-7)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # the loss's row pass
            z = (torch.randn(300, 45, generator=gen, dtype=torch.float64) * 3).to(dtype)
            lse, row_max = ops.chunk_lse(z, 7, 0.0)
            y = torch.cat([z[:7], z[8:]]).double()
            torch.testing.assert_close(lse, torch.logsumexp(y, 0), atol=4e-6, rtol=0)
            coef = torch.rand(45, dtype=torch.float64, generator=gen)
            dz = z.clone()
            ops.chunk_grad_(dz, lse, coef, 7, torch.full((45,), -1), torch.zeros(45, dtype=torch.float64), 0.0)
            want = coef * torch.exp(z.double() - lse)
            want[7] = 0
            torch.testing.assert_close(dz.double(), want, rtol=2**-7, atol=1e-7)  # float16: its subnormals
        w = torch.randn(70, 37, generator=gen).bfloat16()  # the transpose's 16 x 16 blocks and its edges
        assert torch.equal(ops.transpose_rows(w), w.t())
        # The selection kernel (its vector paths: the band of top-p's boundary, the walks): on a peaked row, every
        # draw in the float64 reference's support, each token's count within 5 sigma of the reference's.
        import nmst_fast
        from nmst_fast.reference import truncated_distribution
        V, eos, draws = 32000, 31000, 20000
        row = (torch.randn(V, generator=gen) - 1.1 * (torch.randperm(V, generator=gen).double() + 1).log().float()
               + 8)
        row[eos] = -3.0
        log_p = nmst_fast.nmst_log_probs(row.double()[None], eos_index=eos, eps=1e-3, head="nmst",
                                         steps=torch.tensor([40]))[0]
        for top_k, top_p, min_p in ((0, 0.9, 0), (0, 0.5, 0), (40, 0.95, 0), (0, None, 0), (1, None, 0),
                                    (0, None, 0.05), (40, 0.95, 0.05)):
            tokens, _, _, bad = module.select_rows(row.expand(draws, V), V, 0, eos, 1e-3, 1.0, None, 40, None, top_k,
                                                   top_p - 1e-12 if top_p else 2.0, min_p, gen)
            assert bad == -1
            want = truncated_distribution(log_p[None], top_k or None, top_p, min_p or None)[0]
            counts = torch.bincount(tokens, minlength=V).double()
            case = (top_k, top_p, min_p)
            assert bool((want[counts > 0] > 0).all()), case
            assert bool(((counts - draws * want).abs() <= 5 * (draws * want).sqrt() + 3).all()), case
        print("agree")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "agree" in done.stdout, done.stdout + done.stderr
