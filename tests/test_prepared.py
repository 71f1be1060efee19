"""Prepared calls (autohc/torch/prepared.py): a functional mm or addmm met again under install()
runs the route its first call left. The routed calls must give the general path's bits, and a
route must never outlive what it was decided under (the registry, the threads, the shapes and
strides of the operands)."""
import pytest
import torch
import torch.nn.functional as F

import autohc
from autohc.kernels.gemm.kernel import KernelError, default_kernel_params
from autohc.torch import dispatch, prepared, served
from autohc.tune import registry


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_REGISTRY", str(tmp_path / "registry.json"))
    autohc.uninstall()
    yield
    autohc.uninstall()


def _close(a, b, k):
    tol = 4 * (k + 4) * 2.0 ** -24
    return torch.allclose(a, b, rtol=tol * 4, atol=tol * max(1.0, b.abs().max().item()))


def _cases():
    """(name, function of fresh inputs) for the forms a Linear and its backward call: addmm with
    a 1-D bias, a (1, N) bias, alpha and beta, beta 0, a full-matrix inp (not routed to the
    bound kernel), mm NN, NT, TN, a strided A, M = 1, and a problem too small to serve."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)
    x, w, b = r(37, 65), r(129, 65), r(129)
    x3, big, c, dy, w2 = r(2, 37, 65), r(80, 200), r(37, 129), r(37, 50), r(67, 40)
    return [
        ("addmm bias", lambda: torch.addmm(b, x, w.t())),
        ("linear 3-D", lambda: F.linear(x3, w, b)),
        ("addmm (1, N) bias, alpha, beta", lambda: torch.addmm(b.view(1, -1), x, w.t(), beta=0.5, alpha=2.0)),
        ("addmm beta 0", lambda: torch.addmm(b, x, w.t(), beta=0)),
        ("addmm matrix inp", lambda: torch.addmm(c, x, w.t())),
        ("mm NN", lambda: x @ w.t().contiguous()),
        ("mm TN", lambda: x.t() @ dy),
        ("mm strided A", lambda: big[::2, ::3] @ w2),
        ("mm M 1", lambda: x[:1] @ w.t()),
        ("mm tiny (ATen)", lambda: w2[:4, :4] @ w2[4:8, :4]),
    ]


@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0] for c in _cases()])
def test_routed_calls_give_the_general_paths_bits(case):
    name, make = _cases()[case]
    ref = make()                                    # ATen
    autohc.install(first_use_tuning=False)
    hits = prepared.stats["hits"]
    first = make()                                  # the general path, which leaves the route
    again = [make() for _ in range(3)]              # the route
    # (an addmm whose inp is a whole matrix is decided on each call: copied into C first)
    assert prepared.stats["hits"] - hits == (0 if "matrix inp" in name else 3), name
    for y in again:
        assert torch.equal(y, first), name
    assert _close(first, ref, 200), name


def test_routes_count_the_calls_as_the_general_path_does():
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)
    tiny = torch.randn(4, 4)
    autohc.install(first_use_tuning=False)
    for _ in range(4):
        F.linear(x, w, b)
        tiny @ tiny
    before = dict(served.stats)
    for _ in range(5):
        F.linear(x, w, b)
        tiny @ tiny
    assert served.stats["autohc"] - before["autohc"] == 5
    assert served.stats["aten"] - before["aten"] == 5


def test_a_route_is_not_taken_by_other_strides_or_shapes():
    """The same shapes with another layout, and another M, each take their own route."""
    torch.manual_seed(0)
    w = torch.randn(48, 72)
    autohc.install(first_use_tuning=False)
    for _ in range(3):
        x = torch.randn(40, 72)
        assert _close(x @ w.t(), (x.double() @ w.t().double()).float(), 72)
        xt = torch.randn(72, 40).t()                # same shape, column-major
        assert _close(xt @ w.t(), (xt.double() @ w.t().double()).float(), 72)
        x2 = torch.randn(41, 72)
        assert _close(x2 @ w.t(), (x2.double() @ w.t().double()).float(), 72)


def test_a_registry_change_ends_the_routes():
    """A problem routed to autohc's kernel, then recorded as ATen's (first-use tuning's verdict):
    the next call goes to ATen; the entry removed, it comes back to autohc."""
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)
    autohc.install(first_use_tuning=False)
    for _ in range(3):
        F.linear(x, w, b)
    params = default_kernel_params(dispatch.kernel_threads())
    layout = registry.layout_of(*x.stride(), *w.t().stride())
    M, K, N = registry.linear_dims(layout, 64, 96, 80)
    registry.record("gemm", layout, K, N, M, dispatch.kernel_threads(), params, 1.0, 2.0, aten_faster=True)
    before = dict(served.stats)
    y = F.linear(x, w, b)
    F.linear(x, w, b)
    assert served.stats["aten"] - before["aten"] == 2 and served.stats["autohc"] == before["autohc"]
    assert torch.allclose(y, torch.addmm(b, x, w.t()))


def test_a_thread_change_ends_the_routes():
    x, w = torch.randn(64, 96), torch.randn(96, 80)
    autohc.install(threads=1, first_use_tuning=False)
    for _ in range(3):
        one = x @ w
    autohc.install(threads=2, first_use_tuning=False)
    seen = []
    real = dispatch.prepared_gemm_into

    def spy(a, b, out, alpha, beta, threads, bias=None, dtype="fp32"):
        seen.append(threads)
        return real(a, b, out, alpha, beta, threads, bias, dtype)
    dispatch.prepared_gemm_into = spy
    try:
        two = x @ w
    finally:
        dispatch.prepared_gemm_into = real
    assert seen == [2]
    assert _close(two, one, 96)


def test_a_kernel_that_fails_on_its_route_falls_back_to_the_general_path(monkeypatch):
    """A bound kernel that raises (a pool that cannot start threads, out of memory for its
    panels) sends that call to the general path, which reports it once and runs ATen's."""
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)

    def failing(*args, **kw):
        def run(*ptrs):
            raise KernelError("the worker pool cannot start threads")
        return run
    monkeypatch.setattr(dispatch, "prepared_gemm_into", failing)
    autohc.install(first_use_tuning=False)
    F.linear(x, w, b)                               # the general path; leaves the failing route
    y = F.linear(x, w, b)                           # the route fails: the general path's result
    assert torch.equal(y, F.linear(x, w, b))
    assert _close(y, torch.addmm(b, x, w.t()), 96)


def test_out_forms_are_routed_and_an_aliased_out_never_is():
    """mm.out and addmm.out (what inductor calls into buffers of its own) take the route while
    out is apart from the inputs; an out of the same shape and strides that shares the inputs'
    storage, or their bytes through another storage (two numpy views of one array), takes the
    general path (ATen's kernel, or autohc's on copies): the result is still a @ b."""
    import numpy as np
    _exact = lambda a, b: torch.from_numpy(a.double().numpy() @ b.double().numpy()).float()     # (no torch GEMM)
    g = torch.Generator().manual_seed(11)
    b, bias = torch.randn(130, 90, generator=g), torch.randn(90, generator=g)
    autohc.install(first_use_tuning=False)
    hits = prepared.stats["hits"]
    for _ in range(3):
        a, out = torch.randn(70, 130, generator=g), torch.empty(70, 90)
        want = _exact(a, b)
        assert _close(torch.mm(a, b, out=out), want, 130)
        assert _close(torch.addmm(bias, a, b, out=out), want + bias, 130)
    assert prepared.stats["hits"] - hits == 4
    buf = torch.randn(70 * 130 + 70 * 90, generator=g)
    a, out = buf[:9100].view(70, 130), buf[9100:].view(70, 90)
    want = _exact(a, b)
    before = dict(served.stats)
    got = torch.mm(a, b, out=out)                       # one storage: ATen's kernel
    assert served.stats["aten"] - before["aten"] == 1 and _close(got, want, 130)
    arr = np.random.default_rng(0).standard_normal(20000).astype(np.float32)
    a = torch.from_numpy(arr)[:9100].view(70, 130)
    want = _exact(a, b)
    out = torch.from_numpy(arr[4000:])[:6300].view(70, 90)     # another storage on a's bytes
    assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    hits = prepared.stats["hits"]
    assert _close(torch.mm(a, b, out=out), want, 130)
    assert prepared.stats["hits"] - hits == 1           # (the route was found, and declined)


def test_a_compiled_model_runs_its_gemms_on_routes():
    """torch.compile's graph calls mm.out / addmm.out with its own buffers: from the second
    step on they take their routes, forward and backward, with the first step's results."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(128, 64))
    x = torch.randn(32, 64)
    autohc.install(first_use_tuning=False)
    compiled = torch.compile(model)
    grads, outs = [], []
    for step in range(3):
        if step == 1:
            hits = prepared.stats["hits"]
        model.zero_grad()
        y = compiled(x)
        y.sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert prepared.stats["hits"] - hits >= 2 * 5       # 2 addmm forward, 3 mm backward, a step
    for y, g in zip(outs[1:], grads[1:]):
        assert torch.equal(y, outs[0]) and all(torch.equal(a, b) for a, b in zip(g, grads[0]))
