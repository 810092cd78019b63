"""The step workspace (``nmst_fast/kernels/workspace.py``): scratch and zero-at-rest slots kept between launches."""

import threading

import torch

from nmst_fast.kernels import workspace

from helpers import DEVICE

LAYOUT = (((3, 5), torch.float32), ((3, 5), torch.int32), ((3, 5, 4), torch.int64), ((7,), torch.float32))


def _byte_ranges(views):
    base = views[0].untyped_storage().data_ptr()
    return [(t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size()) for t in views]


def test_views_have_their_layout_aligned_and_disjoint():
    workspace.release()
    device = torch.device(DEVICE)
    sync, *scratch = workspace.step_buffers(device, 9, LAYOUT)
    assert sync.dtype == torch.int32 and sync.shape == (9,) and not bool(sync.any())
    for tensor, (shape, dtype) in zip(scratch, LAYOUT):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % 16 == 0
    ranges = sorted(_byte_ranges(scratch))
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    for i, tensor in enumerate(scratch):  # writing one view leaves the others alone
        tensor.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in scratch] == [1, 2, 3, 4] and not bool(sync.any())


def test_a_layout_seen_before_gets_the_same_views():
    workspace.release()
    device = torch.device(DEVICE)
    first = workspace.step_buffers(device, 4, LAYOUT)
    again = workspace.step_buffers(device, 4, LAYOUT)
    assert all(a is b for a, b in zip(first, again))
    other = workspace.step_buffers(device, 4, LAYOUT[:1])  # a smaller layout: the same memory, no growth
    assert other[1].data_ptr() == first[1].data_ptr()


def test_growth_keeps_zeros_and_only_the_part_that_grew_is_new():
    workspace.release()
    device = torch.device(DEVICE)
    sync, *_ = workspace.step_buffers(device, 4, LAYOUT)
    big_scratch = workspace.step_buffers(device, 4, (((1000, 10), torch.int64),))
    assert big_scratch[0].data_ptr() == sync.data_ptr()  # the sync part was big enough: kept
    many_rows = workspace.step_buffers(device, 5000, LAYOUT)
    assert many_rows[0].shape == (5000,) and not bool(many_rows[0].any())
    assert many_rows[1].untyped_storage().data_ptr() == big_scratch[1].untyped_storage().data_ptr()


def test_each_cpu_thread_has_its_own_workspace():
    workspace.release()
    device = torch.device("cpu")
    mine = workspace.step_buffers(device, 4, LAYOUT)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(workspace.step_buffers(device, 4, LAYOUT)))
    thread.start()
    thread.join()
    assert theirs[0][1].data_ptr() != mine[1].data_ptr() and theirs[0][0].data_ptr() != mine[0].data_ptr()
