"""DTensor inputs (a tensor-parallel plan, or an FSDP2-sharded weight read outside its module's call)
are refused with a clear error before the fused op runs: inside it they failed unreadably."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from nmst_fast import linear_nmst_loss


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
@pytest.mark.parametrize("name", ["hidden", "weight", "bias", "targets"])
def test_dtensor_inputs_are_refused_before_the_op(mesh, name, placement):
    gen = torch.Generator().manual_seed(0)
    tensors = dict(hidden=torch.randn(2, 3, 8, generator=gen), weight=torch.randn(11, 8, generator=gen),
                   bias=torch.randn(11, generator=gen), targets=torch.randint(0, 11, (2, 3), generator=gen))
    tensors[name] = distribute_tensor(tensors[name], mesh, [placement])
    for impl in ("chunked", "reference"):
        with pytest.raises(TypeError, match=f"{name} is a DTensor"):
            linear_nmst_loss(tensors["hidden"], tensors["weight"], tensors["targets"], bias=tensors["bias"],
                             eos_index=10, impl=impl)
    plain = {k: v.full_tensor() if k == name else v for k, v in tensors.items()}  # what the message suggests
    loss = linear_nmst_loss(plain["hidden"], plain["weight"], plain["targets"], bias=plain["bias"], eos_index=10)
    assert torch.isfinite(loss)
