"""The vocabulary-parallel loss on 3 gloo ranks under torchrun, and on a group of 2 of them, equals one
process on the whole weight (tests/distributed/vocab_parallel_ranks.py checks every head, reduction
and backend), with the gradient filter too; a rank's bad input stops every rank with its error; bad
arguments are refused before any collective."""

import re

import pytest
import torch

from nmst_fast import linear_nmst_loss

from helpers import torchrun


def _torchrun(ranks: int, *flags: str):
    return torchrun("vocab_parallel_ranks.py", ranks, *flags)


def test_vocab_parallel_equals_one_process():
    run = _torchrun(3)  # three shards over the whole group, then two over a group of ranks 0 and 1
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for ranks in (3, 2):
        for rank in range(ranks):
            assert f"rank {rank}/{ranks}: 18 cases equal to one process" in run.stdout


@pytest.mark.slow  # 18 s of torchrun; the filter's one-process tests are in the fast set (tests/test_grad_filter.py)
def test_the_gradient_filter_on_shards_equals_one_process():
    run = _torchrun(3, "--grad-filter")  # shards of whole filter blocks: each one's blocks are one process's
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    least = []
    for rank in range(3):  # searched, not split into lines: the ranks' prints interleave (text and newline apart)
        found = re.search(rf"rank {rank}/3: 12 filtered cases equal to one process, least kept share (\d\.\d+)",
                          run.stdout)
        assert found, run.stdout[-3000:]
        least.append(float(found.group(1)))
    assert min(least) < 1  # the filter did skip blocks


@pytest.mark.parametrize("flags, error", [(("--fail-rank", "1"), "weight contains NaN or inf"),
                                          pytest.param(("--overlap",), "must tile", marks=pytest.mark.slow)])
def test_a_bad_rank_stops_every_rank_with_its_error(flags, error):
    run = _torchrun(3, *flags)
    assert run.returncode != 0
    for rank in range(3):  # every rank raised it: none was left waiting in a collective
        assert f"[rank{rank}]: ValueError" in run.stderr and error in run.stderr, run.stderr[-4000:]


def test_vocab_parallel_arguments_are_checked_before_any_collective():
    hidden, weight, targets = torch.randn(2, 4, 8), torch.randn(5, 8), torch.randint(0, 5, (2, 4))
    group = object()  # never used: each check fires before a collective would
    with pytest.raises(ValueError, match="vocab_start"):
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=group)
    with pytest.raises(TypeError, match="vocab_start"):
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=group, vocab_start=1.0)
    with pytest.raises(ValueError, match="vocab_start"):
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=group, vocab_start=-1)
    with pytest.raises(ValueError, match="not initialized"):
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=group, vocab_start=0)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_group_and_its_refusals(one_rank):
    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(2, 4, 8, generator=gen), torch.randn(5, 8, generator=gen)
    targets = torch.randint(0, 5, (2, 4), generator=gen)
    plain = linear_nmst_loss(hidden, weight, targets, eos_index=4, eps=0.1)
    split = linear_nmst_loss(hidden, weight, targets, eos_index=4, eps=0.1, process_group=one_rank, vocab_start=0)
    torch.testing.assert_close(split, plain)
    with pytest.raises(ValueError, match="reference"):
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=one_rank, vocab_start=0,
                         impl="reference")
    with pytest.raises(ValueError, match="non-eos row"):
        linear_nmst_loss(hidden, weight[4:], targets, eos_index=4, process_group=one_rank, vocab_start=4)
    with pytest.raises(ValueError, match="tile"):  # one rank holding rows 1..5 leaves row 0 out
        linear_nmst_loss(hidden, weight, targets, eos_index=4, process_group=one_rank, vocab_start=1)
    with pytest.raises(ValueError, match="eos_index"):
        linear_nmst_loss(hidden, weight, targets, eos_index=5, process_group=one_rank, vocab_start=0)
