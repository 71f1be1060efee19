"""Several ranks on one batch of samples (xDiT's CFG parallel and sequence parallel, on CPU
ranks over torch.distributed's gloo group), combinable with data parallel over batches.

The world is cut into teams of `degree` consecutive ranks; a team draws one batch together and
the teams take batches round-robin (data parallel). Every member of a team holds the same x at
every step: the noise comes from the images' own generators, so each member draws it itself,
and the sampler's fp32 update runs on every member on the same eps.

- cfg (degree 2): member 0 runs the conditional half of the guided batch, member 1 the
  unconditional one (the null class); their eps are exchanged each step and both form
  uncond + s (cond - uncond), as DiT.forward_with_cfg does on the doubled batch.
- patch (degree P): the tokens are split in P contiguous slices; each member runs every
  block on its slice, gathering the other slices' keys and values for attention (sequence
  parallel with gathered K/V); the final layer's tokens are gathered for unpatchify.
  Guidance stays the doubled batch on every member.

A GEMM's blocking over its rows changes the last bits of fp32, so a team's samples equal the
one-process samples up to rounding (fp32: about 1e-6), not bit for bit; the mode is therefore a
setting of a sample set.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import InputError

MODES = ("data", "cfg", "patch")


@dataclass(frozen=True)
class Team:
    """This rank's place: `teams` teams of `degree` ranks; this rank is `member` of team `team`."""
    mode: str
    degree: int
    world: int
    rank: int
    group: object = None        # the team's torch.distributed group (None: a team of one)

    @property
    def teams(self) -> int:
        return self.world // self.degree

    @property
    def team(self) -> int:
        return self.rank // self.degree

    @property
    def member(self) -> int:
        return self.rank % self.degree

    @property
    def leader(self) -> int:
        """The global rank of this team's member 0 (it loads and writes the team's shards)."""
        return self.team * self.degree

    def label(self) -> str:
        """The set's setting: 'data', 'cfg' or 'patch:P' (what changes the last bits)."""
        return f"patch:{self.degree}" if self.mode == "patch" else self.mode

    def describe(self) -> str:
        if self.mode == "data":
            return ""
        what = "CFG parallel" if self.mode == "cfg" else f"patch parallel ({self.degree} token slices)"
        return f", {what}: {self.teams} team{'s' * (self.teams > 1)} of {self.degree} ranks"


def check(mode: str, degree: int | None, world: int, tokens: int, guided: bool) -> int:
    """The team size for --parallel MODE [--parallel-ranks N] on `world` ranks, for a model of
    `tokens` tokens; InputError (one line) where it cannot run."""
    if mode not in MODES:
        raise InputError(f"--parallel {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "data":
        if degree not in (None, 1):
            raise InputError(f"--parallel-ranks {degree}: ranks share a batch only with --parallel cfg or patch")
        return 1
    size = degree or 2
    if mode == "cfg":
        if size != 2:
            raise InputError(f"--parallel-ranks {size}: CFG parallel puts the conditional and unconditional "
                             "halves on 2 ranks")
        if not guided:
            raise InputError("--parallel cfg: this set has no classifier-free guidance (--cfg 1, or a model "
                             "without label dropout): nothing to split; use --parallel data or patch")
    else:
        if size < 2 or tokens % size:
            raise InputError(f"--parallel-ranks {size}: patch parallel needs a divisor of the model's "
                             f"{tokens} tokens, at least 2")
    if world % size:
        raise InputError(f"--parallel {mode}: {world} rank{'s' * (world > 1)} cannot form teams of {size} "
                         f"(launch a multiple of {size} ranks: torchrun, mpirun or srun)")
    return size


def parse(label: str) -> tuple[str, int]:
    """(mode, degree) of a set's `parallel` setting (Team.label)."""
    mode, _, degree = label.partition(":")
    return mode, int(degree) if degree else 2 if mode == "cfg" else 1


def form(mode: str, degree: int, world: int, rank: int) -> Team:
    """The teams, their process groups created (a collective: every rank calls it)."""
    group = None
    if degree > 1:
        import torch.distributed as tdist
        for t in range(world // degree):        # every rank creates every group, in order
            g = tdist.new_group(list(range(t * degree, (t + 1) * degree)))
            if t == rank // degree:
                group = g
    return Team(mode, degree, world, rank, group)


def from_leader(team: Team, value: int) -> int:
    """The team leader's `value` on every member."""
    if team.degree == 1:
        return value
    import torch.distributed as tdist
    t = torch.tensor([value], dtype=torch.int64)
    tdist.broadcast(t, src=team.leader, group=team.group)
    return int(t.item())


def _gather(team: Team, t: torch.Tensor, dim: int) -> torch.Tensor:
    """The members' `t` concatenated along dim, in member order: one all_gather_single
    along the first dim (`dim` moved there; the result a view with `dim` back in place)."""
    import torch.distributed as tdist
    wire = t.movedim(dim, 0).contiguous()
    out = torch.empty((team.degree * wire.shape[0], *wire.shape[1:]), dtype=wire.dtype)
    tdist.all_gather_single(out, wire, group=team.group)
    return out.movedim(0, dim)


class TokenSplit:
    """Patch parallel inside DiT.forward: this member's slice of the tokens (local), the
    attention of its queries over every member's keys and values, and the gather at the end."""

    def __init__(self, team: Team, fused=None):
        self.team = team
        self.fused = fused

    def local(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1] // self.team.degree
        return x[:, self.team.member * n:(self.team.member + 1) * n]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T_local, C) -> (B, T_all, C), the members' token slices in order."""
        return self.all(x, 1)

    def all(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return _gather(self.team, t, dim)

    def attention(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, T_local, 3D) -> (B, T_local, D): the local queries over all T keys and values."""
        B, T, D3 = qkv.shape
        D, hd = D3 // 3, D3 // 3 // heads
        # gathered token-major, (T_all, B, 2D): k and v are strided views of it, no copy
        kv = self.all(qkv[..., D:].transpose(0, 1), 0)
        k, v = kv.view(kv.shape[0], B, 2, heads, hd).permute(2, 1, 3, 0, 4).unbind(0)
        q = qkv[..., :D].reshape(B, T, heads, hd).transpose(1, 2)
        return self._attend(q, k, v).transpose(1, 2).reshape(B, T, D)

    def _attend(self, q, k, v):
        if self.fused is None:          # stock: torch's SDPA (its CPU flash kernel)
            return F.scaled_dot_product_attention(q, k, v)
        from ..ops import attention     # the model on autohc's fused ops: their attention op, not the dispatcher
        return attention(q, k, v)


@contextlib.contextmanager
def token_split(model, team: Team):
    """The model's forward on this member's tokens while inside (patch parallel)."""
    from .model import Attention
    if team.mode != "patch":
        yield model
        return
    split = TokenSplit(team, getattr(model.blocks[0], "fused", None) if len(model.blocks) else None)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    model.token_split = split
    for a in attns:
        a.token_split = split
    try:
        yield model
    finally:
        model.token_split = None
        for a in attns:
            a.token_split = None


def cfg_eps(model, arch: dict, y: torch.Tensor, cfg: float, precision: str, team: Team):
    """eps_fn(x, t) of CFG parallel: this member's half of the guided batch, the two halves'
    eps exchanged, the guided eps (fp32) on both."""
    from .precision import autocast
    C = arch["in_channels"]
    labels = y if team.member == 0 else torch.full_like(y, arch["num_classes"])

    def eps_fn(x, t):
        with autocast(precision):
            out = model(x, t, labels)
        cond, uncond = _gather(team, out[:, :C].float(), 0).chunk(2)
        return uncond + cfg * (cond - uncond)
    return eps_fn
