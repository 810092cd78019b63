"""The step workspace (``nmst_fast/kernels/workspace.py``): buffers and zero-at-rest slots kept between launches."""

import threading

import torch

from nmst_fast.kernels import workspace

from helpers import DEVICE

LAYOUT = (((3, 5), torch.float32), ((3, 5), torch.int32), ((3, 5, 4), torch.int64), ((7,), torch.float32))


def test_buffers_have_their_layout_and_zeroed_sync():
    workspace.release()
    sync, *scratch = workspace.step_buffers(torch.device(DEVICE), 9, LAYOUT)
    assert sync.dtype == torch.int32 and sync.shape == (9,) and not bool(sync.any())
    for tensor, (shape, dtype) in zip(scratch, LAYOUT):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    for i, tensor in enumerate(scratch):  # writing one buffer leaves the others alone
        tensor.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in scratch] == [1, 2, 3, 4] and not bool(sync.any())


def test_a_layout_seen_before_gets_the_same_buffers_and_others_their_own():
    workspace.release()
    device = torch.device(DEVICE)
    first = workspace.step_buffers(device, 4, LAYOUT)
    assert all(a is b for a, b in zip(first, workspace.step_buffers(device, 4, LAYOUT)))
    other = workspace.step_buffers(device, 5, LAYOUT[:1])
    assert other[0].shape == (5,) and not bool(other[0].any())
    assert {t.data_ptr() for t in other}.isdisjoint(t.data_ptr() for t in first)


def test_the_cache_starts_over_after_max_layouts():
    workspace.release()
    device = torch.device(DEVICE)
    first = workspace.step_buffers(device, 1, LAYOUT)
    for slots in range(2, workspace._MAX_LAYOUTS + 1):
        workspace.step_buffers(device, slots, LAYOUT)
    assert workspace.step_buffers(device, 1, LAYOUT)[0] is first[0]  # 64 layouts: all kept
    workspace.step_buffers(device, workspace._MAX_LAYOUTS + 1, LAYOUT)  # the 65th starts over
    assert len(workspace._BUFFERS[workspace.stream_key(device)]) == 1
    assert workspace.step_buffers(device, 1, LAYOUT)[0] is not first[0]


def test_each_cpu_thread_has_its_own_buffers():
    workspace.release()
    device = torch.device("cpu")
    mine = workspace.step_buffers(device, 4, LAYOUT)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(workspace.step_buffers(device, 4, LAYOUT)))
    thread.start()
    thread.join()
    assert theirs[0][1].data_ptr() != mine[1].data_ptr() and theirs[0][0].data_ptr() != mine[0].data_ptr()
