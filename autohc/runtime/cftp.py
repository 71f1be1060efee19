"""CFTP at model level (the DiT-HC paper's section 4.1): one process per socket or die, one
copy of the weights, gradients and optimizer state, and thread clusters (one per NUMA node of
the process's CPUs by default) that each own a slice of N of every GEMM.

    enable(clusters, threads)   every GEMM of the process splits N across `clusters` clusters
                                (JC ways = clusters, the rest of a cluster's threads split M)
    first_touch(tensors, ...)   re-home tensors so that each cluster's slice of rows (N for a
                                weight, its gradient and its AdamW moments) is first written by
                                a thread on that cluster's cores: on a NUMA machine its pages
                                then live on the cluster's node

Element-wise kernels already split their rows over the team in the plan's core order
(runtime/plan.py: compute cores ordered by node), so consecutive row blocks land on one
cluster. Messages are never needed: the clusters share the process's memory.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from ..kernels.gemm.params import panel_ring_depth
from . import plan as cpu_plan

if TYPE_CHECKING:
    import torch

_state: dict = {"clusters": None}


def default_clusters(p: cpu_plan.CpuPlan | None = None) -> int:
    """One cluster per NUMA node holding compute cores of this process."""
    return cpu_plan.nodes_spanned((p or cpu_plan.current()).compute)


def cluster_cores(clusters: int, p: cpu_plan.CpuPlan | None = None) -> list[tuple[int, ...]]:
    """The compute cores of each cluster: consecutive runs of the plan's compute cores (which
    are ordered by node, so one cluster per node when clusters = nodes)."""
    p = p or cpu_plan.current()
    cores = p.compute
    if not 1 <= clusters <= len(cores):
        raise ValueError(f"--cftp {clusters}: between 1 and the {len(cores)} compute cores")
    return [cores[len(cores) * c // clusters:len(cores) * (c + 1) // clusters] for c in range(clusters)]


def enable(clusters: int, threads: int) -> None:
    """Split every GEMM's N across `clusters` thread clusters of `threads // clusters` each."""
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
        raise ValueError(f"--cftp: a positive number of clusters, got {clusters!r}")
    if threads % clusters:
        raise ValueError(f"--cftp {clusters}: the {threads} threads do not split into {clusters} equal clusters")
    _state["clusters"] = clusters


def disable() -> None:
    _state["clusters"] = None


def clusters() -> int | None:
    return _state["clusters"]


def geometry(params):
    """GEMM parameters with the cluster-level N split (JC ways = clusters), where CFTP is on
    and the call's threads split evenly; the parameters as they are otherwise. A B panel ring
    that is the rule's for the old geometry (params.panel_ring_depth) becomes the rule's for
    the new one: own ways (one buffer) turned into clusters of several threads get two, so a
    thread packs panel p + 1 while the others compute p. Another depth (an arch entry's, a
    tuned one) is kept."""
    c = _state["clusters"]
    if c is None or params.threads % c or params.jc_ways == c and params.jr_ways == 1:
        return params
    ic = params.threads // c
    depth = params.depth
    if depth == panel_ring_depth(params.jc_ways, params.ic_ways, params.jr_ways):
        depth = panel_ring_depth(c, ic, 1)
    return dataclasses.replace(params, jc_ways=c, ic_ways=ic, jr_ways=1, depth=depth).validate()


def _slices(t: "torch.Tensor", clusters: int) -> list[slice]:
    n = t.shape[0] if t.dim() else 1
    return [slice(n * c // clusters, n * (c + 1) // clusters) for c in range(clusters)]


def rehome(t: "torch.Tensor", clusters: int, p: cpu_plan.CpuPlan | None = None) -> "torch.Tensor":
    """A copy of t whose row slices (dim 0: a weight's N) were first written by a thread of
    the owning cluster, each pinned to that cluster's first core. numpy copies: one thread
    each, so no other thread touches the pages first."""
    import torch
    cores = cluster_cores(clusters, p)
    src = t.detach()
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    if src.numel() == 0:
        return out
    a, b = src.reshape(src.shape[0], -1).numpy() if src.dim() else src.reshape(1).numpy(), \
        out.reshape(out.shape[0], -1).numpy() if out.dim() else out.reshape(1).numpy()
    errors: list[BaseException] = []

    def copy(rows: slice, core: int) -> None:
        try:
            cpu_plan.pin_this_thread(core)
            b[rows] = a[rows]
        except BaseException as e:      # reported on the caller's thread
            errors.append(e)
    workers = [threading.Thread(target=copy, args=(rows, cores[c][0]), name=f"autohc-cftp-{c}")
               for c, rows in enumerate(_slices(src, clusters))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return out


def first_touch(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer | None", clusters: int) -> int:
    """Re-home the model's parameters (and their gradients and the optimizer's state tensors,
    where they exist) by cluster. Returns the number of tensors moved. Values are unchanged."""
    import torch
    moved = 0
    for prm in model.parameters():
        prm.data = rehome(prm.data, clusters)       # .data: no autograd record
        moved += 1
        if prm.grad is not None:
            prm.grad = rehome(prm.grad, clusters)
            moved += 1
        state = optimizer.state.get(prm, {}) if optimizer is not None else {}
        for k, v in list(state.items()):
            if torch.is_tensor(v) and v.shape == prm.shape and v.dim() >= 1:
                state[k] = rehome(v, clusters)
                moved += 1
    return moved
