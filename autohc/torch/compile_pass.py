"""install()'s pass over torch.compile graphs: the fusions of autohc's own DiT for a user's
unmodified model.

Under torch.compile, Inductor writes its own loops for what surrounds the GEMMs. Its bf16
GELU(tanh) is one of them, slower than fc1's GEMM store and autohc's GELU backward
(docs/history.md, stop 83). So install() sets Inductor's pre-grad pass
(`torch._inductor.config.pre_grad_custom_pass`), which runs on Dynamo's graph before AOT
autograd traces it: every `F.gelu(F.linear(x, w, b), approximate="tanh")` whose Linear output
feeds nothing else (nn.Sequential(nn.Linear, nn.GELU("tanh"), ...) and its functional forms)
becomes one call of `autocast.linear_gelu_fn`, which decides as the graph is traced, by the
rule eager calls follow: under autocast bf16 with a bf16 back-end, fc1's GEMM with GELU in its
store (and GELU's backward on autohc's kernel); anywhere else the same two calls as before.

A pass the user had set runs after this one; uninstall() puts it back.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import autocast

_LINEAR = (torch._C._nn.linear, F.linear)
_GELU = (torch._C._nn.gelu, F.gelu)


def _call_args(node: torch.fx.Node, names: tuple[str, ...], defaults: tuple) -> list | None:
    """node's arguments by position, filling keywords and defaults (None: an unknown keyword)."""
    if set(node.kwargs) - set(names) or len(node.args) > len(names):
        return None
    out = list(node.args) + list(defaults[len(node.args):])
    for i, name in enumerate(names):
        if name in node.kwargs:
            out[i] = node.kwargs[name]
    return out


def _linear_under_tanh_gelu(node: torch.fx.Node):
    """(the Linear's node, (x, w, b)) where node is GELU(tanh) of a Linear that nothing else
    reads, else None."""
    if node.op != "call_function" or node.target not in _GELU:
        return None
    gelu = _call_args(node, ("input", "approximate"), (None, "none"))
    if gelu is None or gelu[1] != "tanh":
        return None
    lin = gelu[0]
    if not isinstance(lin, torch.fx.Node) or lin.op != "call_function" or lin.target not in _LINEAR \
            or len(lin.users) != 1:
        return None
    args = _call_args(lin, ("input", "weight", "bias"), (None, None, None))
    return None if args is None or args[1] is None else (lin, tuple(args))


def fuse_linear_gelu(graph: torch.fx.Graph) -> int:
    """Every GELU(tanh) of a Linear in graph into one autocast.linear_gelu_fn call; how many."""
    done = 0
    for node in list(graph.nodes):
        found = _linear_under_tanh_gelu(node)
        if found is None:
            continue
        lin, args = found
        with graph.inserting_before(node):
            fused = graph.call_function(autocast.linear_gelu_fn, args)
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(lin)
        done += 1
    return done


class FusionPass(CustomGraphPass):
    """fuse_linear_gelu, then the pass the user had set (if any). Its uuid (Inductor's cache
    key) is this file's and autocast.py's contents: the graphs it makes depend on nothing else
    (what linear_gelu_fn decides is traced into them under the state it met)."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_linear_gelu(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        if self.then is not None and then is None:
            return None     # (a pass without a uuid: Inductor bypasses its cache, as it would)
        return (get_hash_for_files((__file__, autocast.__file__)), then)


def set_pass() -> object:
    """Put FusionPass in Inductor's pre-grad slot; returns what was there (for restore_pass)."""
    import torch._inductor.config as inductor
    before = inductor.pre_grad_custom_pass
    if not isinstance(before, FusionPass):
        inductor.pre_grad_custom_pass = FusionPass(before)
    return before


def restore_pass(before: object) -> None:
    """Inductor's pre-grad slot as it was before set_pass (left alone if the user changed it)."""
    import torch._inductor.config as inductor
    if isinstance(inductor.pre_grad_custom_pass, FusionPass):
        inductor.pre_grad_custom_pass = before
