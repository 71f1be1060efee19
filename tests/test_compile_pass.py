"""install()'s pass over torch.compile graphs (autohc/torch/compile_pass.py): GELU(tanh) of a
Linear becomes autohc's fc1 + GELU kernel in a user's unmodified model."""
import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import autohc
from autohc.torch import autocast, compile_pass, served


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


class Shapes(nn.Module):
    """The pattern in its forms, and the near misses the pass must leave alone."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8))
        self.exact = nn.Sequential(nn.Linear(8, 8), nn.GELU())          # erf GELU: not fused
        self.shared = nn.Linear(8, 8)                                   # its output read twice
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        a = self.mlp(x)
        b = self.exact(x)
        h = self.shared(x)
        c = F.gelu(h, approximate="tanh") + h
        d = F.gelu(input=F.linear(x, self.w), approximate="tanh")       # keywords, no bias
        e = F.gelu(torch.relu(x), approximate="tanh")                   # not of a Linear
        return a + b + c + d + e


def _functions(gm: torch.fx.GraphModule):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _dynamo_graph(model, *args) -> tuple[torch.fx.GraphModule, list]:
    """The graph Dynamo hands its backend (what Inductor's pre-grad pass sees), and its inputs."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def test_the_pass_fuses_tanh_gelu_of_a_linear_read_once_and_nothing_else():
    torch.manual_seed(0)
    model = Shapes()
    x = torch.randn(3, 8)
    gm, inputs = _dynamo_graph(model, x)
    ref = gm(*inputs)
    assert compile_pass.fuse_linear_gelu(gm.graph) == 2     # mlp, and d's functional form
    gm.recompile()
    targets = _functions(gm)
    assert targets.count(autocast.linear_gelu_fn) == 2
    assert sum(t in compile_pass._GELU for t in targets) == 3     # exact, c and e kept
    assert sum(t in compile_pass._LINEAR for t in targets) == 3   # mlp's second, exact's, shared's
    # outside autocast and install(), linear_gelu_fn is the two calls it replaced
    got = gm(*inputs)
    assert len(got) == len(ref) == 1 and torch.equal(got[0], ref[0])


def test_install_sets_the_pass_chains_the_users_and_uninstall_restores_it():
    import torch._inductor.config as inductor
    seen = []

    def users_pass(graph):
        seen.append(graph)
    inductor.pre_grad_custom_pass = users_pass
    try:
        autohc.install()
        p = inductor.pre_grad_custom_pass
        assert isinstance(p, compile_pass.FusionPass) and p.then is users_pass
        assert p.uuid() is None     # the user's pass has no uuid: Inductor bypasses its cache
        g = torch.fx.Graph()
        p(g)
        assert seen == [g]
        autohc.install()            # again: not wrapped twice
        assert inductor.pre_grad_custom_pass is p
        autohc.uninstall()
        assert inductor.pre_grad_custom_pass is users_pass
    finally:
        inductor.pre_grad_custom_pass = None
    autohc.install()
    assert inductor.pre_grad_custom_pass.uuid() is not None     # (its own: cached graphs keyed by it)
    autohc.uninstall()
    assert inductor.pre_grad_custom_pass is None


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_compiled_user_mlp_under_autocast_runs_fc1_and_gelu_as_one_kernel():
    """A user's MLP (nn.Sequential of Linear, GELU(tanh), Linear) compiled under install() and
    autocast bf16: the graph calls autohc's fc1 + GELU op forward and GELU's backward on autohc's
    kernel; loss and gradients as eager install()'s within bf16 rounding."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(96, 384), nn.GELU(approximate="tanh"), nn.Linear(384, 96))
    x = torch.randn(2, 64, 96)

    def loss_of(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()
    with autohc.installed():
        net.zero_grad()
        ref_loss = loss_of(net)
        ref_loss.backward()
        ref = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        compiled = torch.compile(net)
        with torch.profiler.profile() as prof:
            loss = loss_of(compiled)
            loss.backward()
    names = {e.name for e in prof.events()}
    assert "autohc::linear_gelu_fp32w_train" in names and "autohc::gelu_tanh_backward" in names
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    for r, p in zip(ref, net.parameters()):
        assert ((p.grad - r).abs().max() / r.abs().max()).item() < 2e-2
