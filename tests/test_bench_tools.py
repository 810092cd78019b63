"""Benchmark plumbing that decides what a GPU timing means (runs on CPU)."""

import torch

from benchmarks.cold_reads import L2_MULTIPLE, MAX_COPIES, copies_needed, rotating


def test_rotation_reads_enough_copies_to_overflow_l2():
    cache = 50 << 20  # an H100's L2
    for rows, V in ((256, 33278), (256, 50257), (256, 128256), (32, 50257)):
        size = rows * V * 4
        n = copies_needed(size, cache)
        assert (n - 1) * size >= L2_MULTIPLE * cache  # read between two uses of one copy
        assert n == 1 + -(-L2_MULTIPLE * cache // size)  # and no more than that
    assert copies_needed(4 * 50257, cache) == MAX_COPIES  # B = 1: capped
    assert copies_needed(1 << 20, 0) == 1  # no cache (CPU): the input itself


def test_rotating_step_cycles_over_equal_copies():
    logits = torch.randn(3, 1000)
    seen = []
    run = rotating(seen.append, logits, cache_bytes=6 * logits.numel() * 4)  # 6 inputs' worth of L2
    assert run.copies == copies_needed(logits.numel() * 4, 6 * logits.numel() * 4) == 25
    for _ in range(2 * run.copies + 1):
        run()
    assert seen[0] is logits  # the input itself first, then its copies
    assert len({id(t) for t in seen}) == run.copies
    assert all(seen[i] is seen[i + run.copies] for i in range(run.copies + 1))
    assert all(torch.equal(t, logits) for t in seen)
    assert all(t.data_ptr() != logits.data_ptr() for t in seen[1:run.copies])
