"""Several runs of a training command in one torchrun launch: the process group the first run joins is
kept for the next ones (``train.distributed.close`` leaves it alone inside :func:`kept_group`) and left
at the end."""

from contextlib import contextmanager
from typing import Iterator

from train import distributed


@contextmanager
def kept_group() -> Iterator[None]:
    leave = distributed.close
    distributed.close = lambda: None
    try:
        yield
    finally:
        distributed.close = leave
        leave()
