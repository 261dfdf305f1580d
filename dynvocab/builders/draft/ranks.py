"""The processes of one ``train-draft`` run: one (the default) or several under ``torchrun`` (torch.distributed).

Under ``torchrun --nproc_per_node N [--nnodes M …]`` the environment names this process's rank and the world size;
:func:`joined` starts the process group (NCCL on GPUs, gloo on CPU) and hands out a :class:`Ranks`. With no
``torchrun`` (or a world of one) it starts nothing and every collective below is a no-op, so the single-process
path is the one it always was.

What runs where: every rank computes the features of its own shards (shard i on rank ``i % world``) and trains on
its share of every global batch; rank 0 alone writes the manifest, the checkpoints and the head, draws the
progress bar and runs the held-out evaluation. A failure rank 0 detects for everyone (a refused cache) is shared
through :meth:`Ranks.on_main`, so every rank stops with the same one-line error instead of waiting on a collective.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch

from dynvocab.errors import DynvocabError

T = TypeVar("T")


def env_rank() -> int:
    """This process's rank as ``torchrun`` sets it (0 outside torchrun): the CLI reads it before any group exists."""
    return int(os.environ.get("RANK", "0"))


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run (rank, world size, rank on its node) and the few collectives it uses."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes shared files and reports."""
        return self.rank == 0

    def device(self, device: str) -> str:
        """``cuda`` under torchrun means this rank's own GPU (``cuda:LOCAL_RANK``)."""
        if self.world > 1 and device == "cuda":
            return f"cuda:{self.local}"
        return device

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` (one dtype) over the ranks, in place: one flat all-reduce."""
        if self.world == 1 or not tensors:
            return
        flat = _wire(torch.cat([t.reshape(-1) for t in tensors]))
        torch.distributed.all_reduce(flat)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank, in place."""
        if self.world == 1:
            return
        for t in tensors:
            wire = _wire(t)
            torch.distributed.broadcast(wire, src=0)
            if wire is not t:
                t.copy_(wire)

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0, its result (a picklable value) given to every rank; a :class:`DynvocabError` it
        raises is raised on every rank with the same message."""
        if self.world == 1:
            return fn()
        box: list = [None]
        failure = None
        if self.main:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # the others stop too, with the same line, instead of waiting for rank 0
                failure = exc
                line = str(exc) if isinstance(exc, DynvocabError) else f"rank 0 failed: {type(exc).__name__}: {exc}"
                box[0] = ("error", line)
        torch.distributed.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        status, value = box[0]
        if status == "error":
            raise DynvocabError(value)
        return value


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the process group's backend can send it (NCCL: on this rank's GPU)."""
    if torch.distributed.get_backend() == "nccl" and not t.is_cuda:
        return t.cuda()
    return t


@contextlib.contextmanager
def joined(device: str) -> Iterator[Ranks]:
    """The run's :class:`Ranks`: a process group already started by the caller, else one started from the
    ``torchrun`` environment (and ended on the way out), else a single process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        yield Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
        return
    if env_world() == 1:
        yield Ranks()
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if gpu else "gloo")
    try:
        yield Ranks(dist.get_rank(), dist.get_world_size(), local)
    finally:
        dist.destroy_process_group()
