"""Data-parallel runs on torch.distributed: one process per device, launched by ``torchrun``.

    torchrun --standalone --nproc_per_node 2 -m train                 # one machine, 2 processes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m train ...

The training commands call :func:`init` first: without torchrun's environment (``WORLD_SIZE`` unset or
1) they run as one process and nothing here communicates. Under torchrun every rank reads the same data
and builds the same model from the same seed; each takes a contiguous share of every global batch
(:func:`share`), and the loss is normalized by the global count of supervised tokens, so N processes
make the update one process makes on the same global batch. Rank 0 alone writes files; a step that
only rank 0 takes (claiming the output directory) reports its error to every rank (:func:`on_main`),
and every collective has a timeout, so a failed rank ends the run instead of leaving the others waiting.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

if dist.is_available():
    # Imported before any process group exists, on purpose. torch.distributed.nn.functional binds
    # ``group.WORLD`` as a default argument of its functions when it is first imported, and
    # torch._dynamo imports it (DDP's constructor and the chunked loss import torch._dynamo). Imported
    # after init_process_group, those defaults keep the default group alive for the whole process:
    # destroy_process_group then no longer ends gloo's worker threads, and a worker still releasing
    # the last collective's tensors takes the GIL while the interpreter shuts down. Python ends such a
    # thread with pthread_exit, whose unwinding through gloo's noexcept work destructor calls
    # std::terminate ("terminate called without an active exception"): an abort (exit code -6) of a
    # run that had already written its results. Imported first, the defaults hold None, and leaving
    # the group joins its threads (:func:`close`).
    import torch.distributed.nn.functional  # noqa: F401

T = TypeVar("T")
DEFAULT_TIMEOUT_MINUTES = 30.0


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``size`` (0 of 1 without torchrun)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files and prints its progress."""
        return self.rank == 0


def init(device: str, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> tuple[World, str]:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA) and return (world, the
    device this rank uses: ``cuda:LOCAL_RANK`` for a CUDA device). Without torchrun: (World(), device).

    ``timeout_minutes`` bounds every collective: a rank that died or hangs ends the run with an error."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(), device
    if not timeout_minutes > 0:
        raise ValueError(f"the collective timeout must be positive, got {timeout_minutes} minutes")
    if torch.device(device).type == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        _import_world_defaults()
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    return World(dist.get_rank(), dist.get_world_size()), device


def _import_world_defaults() -> None:
    """Import, before the process group exists, the installed libraries that bind ``group.WORLD`` as a
    default argument when first imported (as torch.distributed.nn.functional, imported at the top, does):
    DeepSpeed's communication module, which accelerate imports inside ``save_pretrained`` (rank 0's
    save, after the group exists). Imported later, such defaults keep the group, and its gloo threads,
    alive past :func:`close`."""
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed.comm  # noqa: F401


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace, check: Callable[[argparse.Namespace], None],
           run: Callable[[World], T]) -> T:
    """A training command's frame: ``check`` the arguments (a ValueError ends in ``parser.error``,
    before any process group is joined), join torchrun's world (:func:`init`, which also sets
    ``args.device`` to this rank's device), ``run``, and leave the group whatever happens."""
    try:
        check(args)
    except ValueError as err:
        parser.error(str(err))
    world, args.device = init(args.device, args.dist_timeout)  # one process without torchrun
    try:
        return run(world)
    finally:
        close()


def close() -> None:
    """Leave the process group (if this process joined one), so that its gloo threads end here, before
    the interpreter shuts down (see the import at the top). What still holds the group is let go first:
    DTensor's caches (:func:`drop_device_mesh_caches`), then the run's own objects that only reference
    cycles keep (a model under FSDP2 and its device meshes), which a garbage collection frees."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    drop_device_mesh_caches()
    gc.collect()
    dist.destroy_process_group()


def drop_device_mesh_caches() -> None:
    """Empty the caches of torch.distributed that keep device meshes, each of which keeps its process
    group, so that leaving the group frees it (and ends its gloo threads). DTensor, which FSDP2's
    ``fully_shard`` runs on, caches per op and mesh: its sharding propagation (in Python, and in C++ on
    its fast path), the ops' output metadata, the mesh's topology for redistribution costs, and its
    redistribution planners (keyed by a weak reference to the mesh, but holding the mesh). The
    ``functools.lru_cache`` ones are found among the live objects of torch.distributed's modules, so
    that such a cache a later torch adds is emptied too; the C++ cache and the planners' have their own
    calls. ``tests/distributed/hf_train_ranks.py`` checks that no gloo thread outlives an FSDP2 run."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor ran: nothing cached
        return
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which deprecated proxies (dist.reduce_op) warn on
        if type(obj) is functools._lru_cache_wrapper and \
                str(getattr(obj, "__module__", "")).startswith("torch.distributed"):
            obj.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if hasattr(redistribute, "clear_redistribute_planner_cache"):
        redistribute.clear_redistribute_planner_cache()


def replicate(module: torch.nn.Module, world: World) -> torch.nn.Module:
    """``module`` under DDP over ``world`` (its gradients averaged over the ranks in backward), on the
    device its parameters are on; ``module`` itself with one process."""
    if world.size == 1:
        return module
    device = next(module.parameters()).device
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)


def share(items: Sequence[T], world: World) -> Sequence[T]:
    """This rank's contiguous share of ``items``: sizes differ by at most one, and may be 0."""
    n = len(items)
    return items[world.rank * n // world.size:(world.rank + 1) * n // world.size]


def all_sum(values: Sequence[float] | torch.Tensor, world: World) -> torch.Tensor:
    """The float64 sum over the ranks of ``values`` (one tensor, one all-reduce); the values
    themselves with one process."""
    total = torch.as_tensor(values, dtype=torch.float64).clone()
    if world.size > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        moved = total.to(backend_device)
        dist.all_reduce(moved)
        total = moved.cpu()
    return total


def gather(obj: Any, world: World) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if world.size == 1:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def on_main(fn: Callable[[], T], world: World) -> T:
    """Run ``fn`` on rank 0 alone and give every rank its outcome: its return value (picklable), or its
    ValueError / FileNotFoundError / OSError raised on every rank, so a refused output directory stops
    all of them and none is left waiting."""
    outcome: list[Any] = [None, None]  # (result, (error type, message))
    if world.is_main:
        try:
            outcome[0] = fn()
        except (ValueError, FileNotFoundError, OSError) as err:
            if world.size == 1:
                raise
            outcome[1] = (type(err).__name__, str(err))
    if world.size > 1:
        dist.broadcast_object_list(outcome, src=0)
        if outcome[1] is not None:
            kind, message = outcome[1]
            raise {"FileNotFoundError": FileNotFoundError, "OSError": OSError}.get(kind, ValueError)(message)
    return outcome[0]


def barrier(world: World) -> None:
    """Wait for every rank (e.g. for rank 0's files)."""
    if world.size > 1:
        dist.barrier()


def shard(model, world: World, fsdp: bool):
    """The module a training step calls: ``model`` itself with one process; under torchrun DDP over it,
    or (``fsdp``) ``model`` sharded in place with FSDP2: ``fully_shard`` on every decoder block (the
    classes the model lists in ``_no_split_modules``), on an untied output layer, and on the root."""
    if world.size == 1 or not fsdp:
        return replicate(model, world)
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    output = model.get_output_embeddings()
    if output.weight is not model.get_input_embeddings().weight:  # a tied one belongs to the root's unit
        fully_shard(output)
    fully_shard(model)
    return model


def full_state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts whole and on the CPU, whether the model is plain, under DDP or
    sharded (a collective then: every rank calls it; rank 0 receives them)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=full_state_options(cpu_offload=True))
