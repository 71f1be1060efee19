"""Data-parallel processes: who this process is (rank discovery from the launcher), the
process group (torch.distributed, gloo), and the gradient all-reduce on its own thread.

Discovery reads, in this order (HF accelerate's): torchrun's RANK / WORLD_SIZE / LOCAL_RANK,
Open MPI's OMPI_COMM_WORLD_*, MPICH / Intel MPI's PMI_RANK / PMI_SIZE / MPI_LOCALRANKID, then
Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID. The rendezvous address is MASTER_ADDR /
MASTER_PORT when set; under an MPI launcher with mpi4py, rank 0's address and a free port are
broadcast over MPI; else this host (one node).

The all-reduce hook (`CommHook`, a DDP communication hook) hands each gradient bucket to one
communication thread, pinned to the CPU plan's communication core (runtime/plan.py), which
runs mpi4py's Allreduce when an MPI launcher started the job and gloo's otherwise, and
completes the torch Future that DDP waits on. Compute threads never run the collective.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

from . import plan as cpu_plan
from . import settings

DEFAULT_TIMEOUT_S = 120      # a dead rank is noticed within this (torch's default is 30 min)


class LaunchError(RuntimeError):
    """The launcher's environment is inconsistent or the rendezvous failed (one clear line)."""


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    local_rank: int
    launcher: str                   # torchrun | mpi (openmpi / mpich) | slurm | none
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def uses_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


# (launcher, rank, world, local rank) variables, in the order they are tried
SOURCES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    v = env.get(name, "")
    try:
        return int(v)
    except ValueError:
        raise LaunchError(f"{launcher} launch: {name}={v!r} is not an integer") from None


def discover(env: Mapping[str, str] | None = None) -> Launch:
    """This process's place in the job, from the launcher's environment (world 1 if none)."""
    env = os.environ if env is None else env
    for launcher, rk, ws, lr in SOURCES:
        if rk in env and ws in env:
            rank, world = _int(env, rk, launcher), _int(env, ws, launcher)
            local = _int(env, lr, launcher) if lr in env else rank
            if world < 1 or not 0 <= rank < world:
                raise LaunchError(f"{launcher} launch: rank {rank} is not within world size {world}")
            port = env.get("MASTER_PORT")
            if port is not None and not port.isdigit():
                raise LaunchError(f"MASTER_PORT={port!r} is not a port number")
            addr = env.get("MASTER_ADDR") or (env.get("SLURM_LAUNCH_NODE_IPADDR") if launcher == "slurm" else None)
            return Launch(rank, world, local, launcher, addr, int(port) if port else None)
    return Launch(0, 1, 0, "none")


def timeout_s() -> int:
    return settings.non_negative_int("AUTOHC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S,
                                     "seconds a collective may wait for the other ranks") or DEFAULT_TIMEOUT_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi_rendezvous(launch: Launch) -> tuple[str, int]:
    """Rank 0's address and a free port, broadcast over MPI (no MASTER_ADDR needed)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.world or comm.Get_rank() != launch.rank:
        raise LaunchError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the launcher's "
                          f"environment rank {launch.rank} of {launch.world}")
    mine = (launch.master_addr or socket.gethostbyname(socket.gethostname()),
            launch.master_port or free_port()) if launch.rank == 0 else None
    return comm.bcast(mine, root=0)


def mpi4py_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def comm_over_mpi(launch: Launch | None = None) -> bool:
    """Collectives of the communication thread over MPI: an MPI launcher and mpi4py."""
    return (launch or discover()).uses_mpi and mpi4py_available()


def join_gloo(**kwargs) -> None:
    """torch.distributed.init_process_group("gloo", **kwargs), with torch.distributed.nn imported
    first: its collectives take `group=group.WORLD` as a default argument, evaluated on its first
    import (torch._dynamo, which install() loads, imports it). Imported after the group exists,
    that default holds the group past destroy_process_group, so gloo's worker threads outlive it
    and may release a last collective's tensors while the interpreter shuts down
    (std::terminate). Imported first, the default is None."""
    import torch.distributed as dist
    try:
        import torch.distributed.nn  # noqa: F401
    except ImportError:             # a torch built without it has no such default to hold
        pass
    dist.init_process_group("gloo", **kwargs)


def init(launch: Launch | None = None) -> Launch:
    """Join the job's gloo process group (a no-op for world 1). LaunchError on a bad
    environment or a rendezvous that does not complete within the timeout."""
    import torch.distributed as dist
    launch = launch or discover()
    if launch.world == 1 or dist.is_initialized():
        return launch
    addr, port = launch.master_addr, launch.master_port
    if comm_over_mpi(launch):
        addr, port = _mpi_rendezvous(launch)
    addr, port = addr or "127.0.0.1", port or 29500
    timeout = datetime.timedelta(seconds=timeout_s())
    try:
        store = _restart_store(addr, port, launch.world, timeout)
        if store is not None:
            join_gloo(store=store, rank=launch.rank, world_size=launch.world, timeout=timeout)
        else:
            join_gloo(init_method=f"tcp://{addr}:{port}", rank=launch.rank, world_size=launch.world,
                      timeout=timeout)
    except (RuntimeError, ValueError, OSError) as e:
        first = first_line(e)
        raise LaunchError(f"rank {launch.rank} of {launch.world} could not join the process group "
                          f"at {addr}:{port} ({launch.launcher}): {first}") from None
    return Launch(launch.rank, launch.world, launch.local_rank, launch.launcher, addr, port)


def _restart_store(addr: str, port: int, world: int, timeout):
    """Under torchrun's agent store, this attempt's own key space in it. torchrun's static
    rendezvous (its default) keeps one store across `--max-restarts` restarts, so a restarted
    group would read the dead attempt's addresses and never connect; the attempt's number
    (TORCHELASTIC_RESTART_COUNT) as a prefix keeps each attempt's keys apart. None elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import PrefixStore, TCPStore
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = TCPStore(addr, port, world, is_master=False, timeout=timeout)
    return PrefixStore(f"autohc/attempt_{attempt}", client)


def first_line(e: BaseException) -> str:
    """An error's first line (its type where it says nothing): gloo's errors run to many."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def peer_failure(launch: Launch, what: str, e: BaseException) -> str:
    """The one line a rank prints when a collective of `what` failed under it."""
    return (f"rank {launch.rank} of {launch.world}: {what} failed (another rank died or hung?): "
            f"{first_line(e)}")


def shutdown() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def average(value: float) -> float:
    """The mean of a float over the ranks (the logged loss of a data-parallel step)."""
    return average_with_flags(value, ())[0]


def average_with_flags(value: float, flags) -> list:
    """[mean of value over the ranks, then for each flag: whether any rank set it], in one
    all-reduce (a training step's loss and its stop flags: every rank sees the same)."""
    import torch
    import torch.distributed as dist
    flags = [bool(f) for f in flags]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value, *flags]
    t = torch.tensor([value, *map(float, flags)], dtype=torch.float64)
    dist.all_reduce(t)
    return [float(t[0].item()) / dist.get_world_size(), *(bool(x > 0) for x in t[1:].tolist())]


class CommHook:
    """A DDP communication hook: each bucket's all-reduce (sum, then / world) runs on one
    communication thread pinned to the CPU plan's communication core; DDP gets a Future.

    use_mpi: mpi4py's Allreduce (the job was started by an MPI launcher); else gloo, on a
    process group of its own so that it never interleaves with the main thread's collectives."""

    def __init__(self, use_mpi: bool, core: int | None = None):
        import torch.distributed as dist
        self.world = dist.get_world_size()
        self.use_mpi = use_mpi
        self.core = core if core is not None else _comm_core()
        self.group = None if use_mpi else dist.new_group(backend="gloo")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="autohc-comm",
                                        initializer=cpu_plan.pin_this_thread, initargs=(self.core,))
        if use_mpi:
            from mpi4py import MPI
            self._mpi, self._comm = MPI, MPI.COMM_WORLD
        self.bucket_bytes: list[int] = []          # every bucket handed over, in order
        self._lock = threading.Lock()

    def _allreduce(self, buf, fut) -> None:
        import torch.distributed as dist
        try:
            if self.use_mpi:
                self._comm.Allreduce(self._mpi.IN_PLACE, buf.numpy(), op=self._mpi.SUM)
            else:
                dist.all_reduce(buf, group=self.group)
            buf.div_(self.world)
            fut.set_result(buf)
        except Exception as e:          # the backward waiting on it raises this
            fut.set_exception(e)

    def hook(self, state, bucket):
        """The function DDP calls per bucket (register_comm_hook(None, comm_hook.hook))."""
        import torch
        fut = torch.futures.Future()
        buf = bucket.buffer()
        with self._lock:
            self.bucket_bytes.append(buf.numel() * buf.element_size())
        self._pool.submit(self._allreduce, buf, fut)
        return fut

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _comm_core() -> int | None:
    p = cpu_plan.current()
    return p.comm[0] if p.comm else (p.compute[-1] if p.compute else None)
