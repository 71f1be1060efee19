"""Whether a training run fits in this machine's memory, found out before its first step.

A batch too large for the machine is otherwise found out by the kernel's OOM killer minutes into
a job (a bare "Killed", and on a shared node maybe someone else's process), or by a traceback
from an allocator. `autohc train` asks here first and refuses such a run in one line, with the
largest --batch that fits.

What a step adds to what the process already holds:
- the gradients and AdamW's two moments: 12 bytes a parameter (the moments are made by the first
  step), and with several ranks the gradients' all-reduce buffers, 4 more;
- the activations autograd saves for the backward, measured, not modelled: the model's training
  forward at batch 1 and 2 with a saved-tensor hook counting each storage once (the parameters
  left out), so the bytes an image are the difference of the two, on the code path the run takes
  (its precision, autohc's fused ops or not);
- what the forward saves whatever the batch (stock autocast's bf16 copies of the weights), from
  the same two, counted once;
- a margin for what lives only inside the backward (activation gradients, kernel workspace):
  TRANSIENT_SHARE of the activations and TRANSIENT_BYTES.
Against: psutil's available memory, or the room under the process's cgroup limit where that is
less (a Slurm job's --mem), shared by the ranks on this node. AutoMem (`--automem`) moves the
saved activations to its tier: to files (not counted), to bf16 copies (float32 ones counted at
half), to another NUMA node's memory (counted: it is the same machine's memory).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from . import precision
from .data import InputError

GRAD_AND_MOMENTS_BYTES = 12     # fp32 gradient, exp_avg, exp_avg_sq per parameter
ALLREDUCE_BYTES = 4             # a gradient bucket's copy per parameter, with several ranks
TRANSIENT_SHARE = 0.10          # of the saved activations, alive only inside the backward
TRANSIENT_BYTES = 256 << 20     # kernel workspace, the result pool, the allocator's slack
# the share of a saved float32 tensor and of any other that stays in this machine's memory, by
# AutoMem tier (runtime/tiers.py: the bf16 tier keeps a bfloat16 copy of float32 tensors)
AUTOMEM_KEPT = {None: (1.0, 1.0), "file": (0.0, 0.0), "bf16": (0.5, 1.0), "numa": (1.0, 1.0)}
# ranks on this node, from the launcher (torchrun, Open MPI, MPICH, Slurm)
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


class MemoryShortError(InputError):
    """The run as asked does not fit in the memory this process can have (exit 2, one line)."""


@dataclass(frozen=True)
class Estimate:
    per_image: int          # bytes of saved activations an image (its share kept in memory)
    activations: int        # for this rank's share of the batch
    constant: int           # saved for the backward whatever the batch
    state: int              # gradients, AdamW's moments, the all-reduce's buffers
    room: int               # bytes this rank may still take
    room_from: str          # where `room` comes from, in words

    @property
    def fixed(self) -> int:
        return self.state + self.constant + TRANSIENT_BYTES

    @property
    def needed(self) -> int:
        return self.fixed + int(self.activations * (1 + TRANSIENT_SHARE))


def saved_activation_bytes(model: torch.nn.Module, diffusion, shape: tuple[int, int, int], num_classes: int,
                           precision_name: str, batch: int, kept: tuple[float, float] = (1.0, 1.0)) -> int:
    """Bytes autograd saves for the backward of `model`'s training loss at `batch` (each storage
    once, the parameters' own left out), float32 storages counted at kept[0], others at kept[1].
    Nothing is kept: the graph is dropped unused."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, float] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.device.type == "cpu":
            seen[st.data_ptr()] = st.nbytes() * kept[0 if t.dtype == torch.float32 else 1]
        return t
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((batch, *shape), generator=gen)
    t = torch.randint(0, diffusion.num_timesteps, (batch,), generator=gen)
    y = torch.randint(0, num_classes, (batch,), generator=gen)
    # (fork_rng: the label dropout's draws would move the run's own random stream)
    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with precision.autocast(precision_name):
            loss = diffusion.training_loss(model, x, t, y, torch.randn(x.shape, generator=gen))
    del loss
    return int(sum(seen.values()))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path, names: tuple[str, ...]) -> int:
    """The page cache the kernel can take back (memory.stat), counted as room."""
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in names and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), or None without one."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if re.match(r"\d+:([^:]*,)?memory(,[^:]*)?:", ln)), None)
    tries = []
    if v2 is not None:      # (inside a cgroup namespace the process's own folder is the root)
        for base in (root / v2.lstrip("/"), root):
            tries.append((base / "memory.max", base / "memory.current", base / "memory.stat", ("inactive_file",)))
    if v1 is not None:
        for base in (root / "memory" / v1.lstrip("/"), root / "memory"):
            tries.append((base / "memory.limit_in_bytes", base / "memory.usage_in_bytes", base / "memory.stat",
                          ("total_inactive_file", "inactive_file")))
    for limit_path, usage_path, stat_path, names in tries:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is None or usage is None:
            continue
        if limit >= 1 << 60:            # "no limit" (v1 writes a huge number, v2 "max")
            return None
        return max(0, limit - usage + _inactive_file(stat_path, names))
    return None


def local_ranks(world: int, env=None) -> int:
    """Ranks of this job (of `world`) on this node, from the launcher's variables (1 without one,
    or in a job of one process: a Slurm allocation's tasks a node need not all be this job's)."""
    env = os.environ if env is None else env
    if world <= 1:
        return 1
    for name in LOCAL_SIZE_VARS:
        m = re.match(r"\s*(\d+)", env.get(name, ""))
        if m and int(m.group(1)) > 0:
            return min(int(m.group(1)), world)
    return 1


def room(world: int = 1) -> tuple[int, str]:
    """(bytes this rank may still take, where that figure comes from)."""
    avail, words = psutil.virtual_memory().available, "available"
    limited = cgroup_room()
    if limited is not None and limited < avail:
        avail, words = limited, "left under this job's memory limit (cgroup)"
    ranks = local_ranks(world)
    if ranks > 1:
        return avail // ranks, f"{words}, shared by {ranks} ranks on this node"
    return avail, words


def estimate(trainer) -> Estimate:
    """What `trainer`'s first steps will add to this process, and the room for it."""
    from ..tune import first_use
    cfg = trainer.cfg
    params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    state = params * (GRAD_AND_MOMENTS_BYTES + (ALLREDUCE_BYTES if cfg.world > 1 else 0))
    kept = AUTOMEM_KEPT.get(cfg.automem and cfg.automem.split(":")[0], (1.0, 1.0))
    per_image = constant = 0
    if any(kept):
        was = first_use.enabled()       # (the probe's batch-1 and -2 problems are not the run's)
        first_use.enable(False)
        try:
            one, two = (saved_activation_bytes(trainer.model, trainer.diffusion, trainer.data.shape,
                                               trainer.data.num_classes, trainer.precision, b, kept)
                        for b in (1, 2))
        finally:
            first_use.enable(was)
        per_image, constant = max(0, two - one), max(0, 2 * one - two)
    share = max(1, cfg.batch // cfg.world)
    have, words = room(cfg.world)
    return Estimate(per_image, share * per_image, constant, state, have, words)


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 1 << 30 else f"{n / 2**20:.0f} MB"


def check(trainer) -> Estimate:
    """The estimate, or MemoryShortError where the run needs more than the room (one line: the
    figures, the largest --batch that fits, the ways out)."""
    est = estimate(trainer)
    if est.needed <= est.room:
        return est
    cfg = trainer.cfg
    fits = 0
    if est.per_image:
        per_rank = int((est.room - est.fixed) / (est.per_image * (1 + TRANSIENT_SHARE)))
        fits = max(0, per_rank) * cfg.world
    what = (f"activations {_gb(est.activations)} at {est.per_image / 2**20:.0f} MB an image in "
            f"{trainer.precision}" if est.activations else "")
    parts = ", ".join(p for p in (what, f"gradients and AdamW's moments {_gb(est.state)}",
                                  f"{_gb(est.constant)} saved whatever the batch" if est.constant >= 1 << 20 else "")
                      if p)
    ways = ([f"--batch {fits} or less"] if fits >= cfg.world else []) + (
        ["--automem file (saved activations on disk)"] if est.activations else []) + [
        "a smaller --model", "--no-memory-check to start anyway"]
    raise MemoryShortError(
        f"--batch {cfg.batch} of {cfg.model} needs about {_gb(est.needed)} more memory ({parts}), and this "
        f"machine has {_gb(est.room)} {est.room_from}: use " + ", ".join(ways[:-1]) + f", or {ways[-1]}")
