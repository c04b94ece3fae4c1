"""This process's tensor-parallel group, the layout modules are built for, and the collectives.

Two separate things: the *layout* (rank, size) that sharded modules read when they are constructed
(`tensor_parallel_layout`, default rank 0 of 1), and the *group* this process joined, over which the
collectives run. A module built for size 1 never calls a collective, so a single-rank engine works in any
process and never imports torch.distributed. At size > 1 there is one group per process: NCCL on CUDA
(gloo on CPU) for tensors, plus a gloo group over which rank 0 broadcasts each step's plain inputs.
"""

import contextlib
import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 300


@dataclass(slots=True)
class TensorParallelState:
    """rank and size of the group; control_group is the gloo group for plain-data broadcasts."""

    rank: int = 0
    size: int = 1
    control_group: Any = None
    initialized: bool = False


_state = TensorParallelState()
_layout = [0, 1]  # rank, size that modules built now are sharded for


def get_tp_rank() -> int:
    """The rank modules being constructed are sharded for."""
    return _layout[0]


def get_tp_size() -> int:
    """The number of ranks modules being constructed are sharded over."""
    return _layout[1]


def get_group_size() -> int:
    """Processes in the group this process joined (1 when it joined none)."""
    return _state.size


@contextlib.contextmanager
def tensor_parallel_layout(rank: int, size: int):
    """Modules constructed inside are built as rank `rank` of `size` (the model runner; tests of slicing)."""
    previous = list(_layout)
    _layout[:] = [rank, size]
    try:
        yield
    finally:
        _layout[:] = previous


def open_rendezvous(port: int = 0, host: str = "127.0.0.1", timeout_s: float = INIT_TIMEOUT_S):
    """Rank 0, before starting the workers: listen for the group's rendezvous on host:port, a torch TCPStore
    whose `.port` the workers must be given. Port 0 takes a free one from the OS; the socket stays bound
    from here on, so two groups starting at once can never pick the same port."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def init_tensor_parallel(rank: int, size: int, device: torch.device, port: int, host: str = "127.0.0.1",
                         timeout_s: float = INIT_TIMEOUT_S, store=None) -> None:
    """Join the group of `size` processes rendezvousing at host:port (blocks until all have joined).

    Rank 0 passes the store it opened with open_rendezvous; the other ranks connect to host:port.
    """
    import torch.distributed as dist

    if _state.initialized or dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group: one tensor-parallel engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _state.rank, _state.size, _state.control_group, _state.initialized = rank, size, control, True
    logger.info("tensor-parallel rank %d of %d (%s) on %s, rendezvous port %d", rank, size, backend, device,
                store.port)


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent); the process can then join another."""
    if not _state.initialized:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.size, _state.control_group, _state.initialized = 0, 1, None, False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place; x itself outside a group."""
    if _state.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., size * n], rank-major along the last dim."""
    if _state.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    if x.is_cuda:
        gathered = torch.empty((_state.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x)
        parts = gathered.unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(_state.size)]
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (pickled over the gloo control group)."""
    if _state.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_state.control_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks that fit on every GPU)."""
    if _state.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control_group)
    return int(t.item())
