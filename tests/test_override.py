"""autohc.install(): unmodified torch code runs its GEMMs on autohc, forward and backward,
with ATen's results (within fp32 rounding) and ATen's behaviour for everything else."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohc
from autohc.torch import dispatch as override
from autohc.torch import served
from autohc.torch.threads import kernel_threads


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


def counts():
    return dict(served.stats)


def close(a, b, k):
    tol = 4 * (k + 4) * 2.0 ** -24
    return torch.allclose(a, b, rtol=tol * 4, atol=tol * max(1.0, b.abs().max().item()))


def test_linear_forward_and_backward_run_on_autohc():
    torch.manual_seed(0)
    lin = nn.Linear(96, 80)
    x = torch.randn(4, 33, 96, requires_grad=True)
    y_ref = lin(x)
    y_ref.square().mean().backward()
    gx, gw, gb = x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()
    x.grad = None
    lin.zero_grad()
    before = counts()
    with autohc.installed():
        y = lin(x)
        y.square().mean().backward()
    after = counts()
    assert after["autohc"] - before["autohc"] >= 3        # forward NT, dX NN, dW TN
    assert close(y, y_ref, 96) and close(x.grad, gx, 80) and close(lin.weight.grad, gw, 132)
    assert torch.allclose(lin.bias.grad, gb)
    assert not autohc.is_installed()


def test_install_owns_the_threads_and_uninstall_gives_them_back(monkeypatch):
    monkeypatch.setenv("AUTOHC_TEAM", "pool")               # autohc's own threads, and
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)     # libgomp's default: a long spin
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    seen = []
    real = override.gemm_into
    monkeypatch.setattr(override, "gemm_into", lambda *a: seen.append(a[-1]) or real(*a))
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        autohc.install()                    # kernels: torch's 2; torch itself: 1 (no spinning pool)
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
        a @ b
        autohc.install(threads=1)           # a second install changes the kernel threads only
        torch.mm(a, b)
        autohc.uninstall()
        assert torch.get_num_threads() == 2 and kernel_threads() == 2
        autohc.install(threads=3, torch_threads=None)
        assert torch.get_num_threads() == 2
        torch.mm(a, b)
        autohc.uninstall()
    finally:
        torch.set_num_threads(old)
    assert seen == [2, 1, 3]
    with pytest.raises(ValueError, match="torch_threads"):
        autohc.install(torch_threads=0)
    autohc.uninstall()
    torch.mm(a, b)
    assert len(seen) == 3
    with pytest.raises(ValueError):
        autohc.install(threads=0)


def test_install_keeps_torch_threads_on_the_shared_team(monkeypatch):
    """AUTOHC_TEAM=omp (the default): autohc's kernels run on torch's OpenMP threads, so
    install() leaves torch all its threads, whatever libgomp's spin, and says nothing."""
    monkeypatch.delenv("AUTOHC_TEAM", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with autohc.installed():
                assert torch.get_num_threads() == 2
                torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        assert not [w for w in said if "thread" in str(w.message)]
        assert torch.get_num_threads() == 2
    finally:
        autohc.uninstall()
        torch.set_num_threads(old)


def test_install_says_once_why_torch_gets_one_thread(monkeypatch):
    """AUTOHC_TEAM=pool, with libgomp's long spin: install() gives torch's own ops (and what
    torch.compile compiles meanwhile) one thread: it says so once per process, with the fix,
    and not where the user chose the threads or torch's workers wait briefly."""
    from autohc.torch import dispatch
    monkeypatch.setenv("AUTOHC_TEAM", "pool")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setitem(dispatch._state, "told_one_thread", False)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("GOMP_SPINCOUNT", "10000")            # waits briefly: keeps 2, no word
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with autohc.installed():
                assert torch.get_num_threads() == 2
            with autohc.installed(torch_threads=1):             # asked for: no word either
                assert torch.get_num_threads() == 1
            monkeypatch.delenv("GOMP_SPINCOUNT")
            for _ in range(2):
                with autohc.installed():
                    assert torch.get_num_threads() == 1
        hints = [w for w in said if "GOMP_SPINCOUNT=10000" in str(w.message)]
        assert len(hints) == 1 and "instead of 2" in str(hints[0].message)
        assert issubclass(hints[0].category, RuntimeWarning)
    finally:
        autohc.uninstall()
        torch.set_num_threads(old)


@pytest.mark.parametrize("op", ["mm", "matmul", "addmm", "F.linear", "bmm", "baddbmm", "addmm_beta0"])
def test_ops_match_aten(op):
    torch.manual_seed(1)
    a, b, c = torch.randn(70, 130), torch.randn(130, 90), torch.randn(90)
    A, B, C = torch.randn(3, 130, 140), torch.randn(3, 140, 150), torch.randn(1, 130, 150)
    fns = {
        "mm": lambda: torch.mm(a, b),
        "matmul": lambda: a @ b,
        "addmm": lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        "addmm_beta0": lambda: torch.addmm(torch.full((70, 90), float("nan")), a, b, beta=0),
        "F.linear": lambda: F.linear(a, b.t(), c),
        "bmm": lambda: torch.bmm(A, B),
        "baddbmm": lambda: torch.baddbmm(C, A, B, beta=-1.0, alpha=0.5),
    }
    ref = fns[op]()
    before = counts()["autohc"]
    with autohc.installed():
        got = fns[op]()
    assert counts()["autohc"] > before
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert close(got, ref, 140)


@pytest.mark.parametrize("case", ["float64", "int64", "complex64", "zero-size", "tiny", "float16"])
def test_fallback_is_aten_bit_for_bit(case):
    torch.manual_seed(2)
    mk = {
        "float64": lambda: (torch.randn(50, 60, dtype=torch.float64), torch.randn(60, 40, dtype=torch.float64)),
        "int64": lambda: (torch.randint(-5, 5, (50, 60)), torch.randint(-5, 5, (60, 40))),
        "complex64": lambda: (torch.randn(50, 60, dtype=torch.complex64), torch.randn(60, 40, dtype=torch.complex64)),
        "zero-size": lambda: (torch.randn(0, 60), torch.randn(60, 40)),
        "tiny": lambda: (torch.randn(3, 4), torch.randn(4, 5)),
        "float16": lambda: (torch.randn(50, 60).half(), torch.randn(60, 40).half()),
    }[case]
    a, b = mk()
    ref = a @ b
    before = counts()
    with autohc.installed():
        got = a @ b
    assert counts()["autohc"] == before["autohc"]
    assert torch.equal(got, ref)


def test_errors_are_atens():
    a, b = torch.randn(3, 4), torch.randn(5, 6)
    with pytest.raises(RuntimeError) as ref:
        a @ b
    with autohc.installed(), pytest.raises(RuntimeError) as got:
        a @ b
    assert type(got.value) is type(ref.value)
    with autohc.installed(), pytest.raises(RuntimeError):
        torch.mm(torch.randn(40, 40), torch.randn(40, 40, dtype=torch.float64))


def test_gradcheck_float64_through_the_fallback():
    lin = nn.Linear(6, 5).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with autohc.installed():
        assert torch.autograd.gradcheck(lambda t: lin(t).tanh(), (x,))


def test_torch_compile_same_results():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    ref = model(x)
    with autohc.installed():
        compiled = torch.compile(model, backend="aot_eager")
        got = compiled(x)
        eager = model(x)
    assert close(got, ref, 128) and close(eager, ref, 128)


class TinyTransformer(nn.Module):
    def __init__(self, d=64, heads=4, n_cls=10):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(self.ln(h))
        return self.head(h.mean(1))


def train(install: bool, steps: int = 5):
    torch.manual_seed(4)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(steps, 16, 32, 16)
    labels = torch.randint(0, 10, (steps, 16))
    losses, grads = [], None
    with autohc.installed() if install else contextlib.nullcontext():
        for i in range(steps):
            loss = F.cross_entropy(model(data[i]), labels[i])
            opt.zero_grad()
            loss.backward()
            if i == 0:
                grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            losses.append(loss.item())
    return losses, grads


def test_training_a_small_transformer_gives_the_same_losses():
    """Same seed, 5 AdamW steps, with and without install(): losses agree to 1e-5 relative
    and the first step's gradients to fp32 rounding."""
    before = counts()["autohc"]
    l_auto, g_auto = train(True)
    assert counts()["autohc"] - before >= 5 * 6
    l_ref, g_ref = train(False)
    for a, b in zip(l_auto, l_ref):
        assert abs(a - b) <= 1e-5 * abs(b)
    for a, b in zip(g_auto, g_ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_opcheck_on_every_overridden_op():
    a, b, c = torch.randn(70, 130), torch.randn(130, 90), torch.randn(90)
    A, B = torch.randn(3, 130, 140), torch.randn(3, 140, 150)
    with autohc.installed():
        torch.library.opcheck(torch.ops.aten.mm.default, (a, b))
        torch.library.opcheck(torch.ops.aten.addmm.default, (c, a, b), {"beta": 0.5, "alpha": 2.0})
        torch.library.opcheck(torch.ops.aten.bmm.default, (A, B))
        torch.library.opcheck(torch.ops.aten.baddbmm.default, (torch.randn(3, 130, 150), A, B))


def test_torch_compile_inductor_runs_its_gemms_on_autohc():
    """Inductor calls mm.out / addmm.out with buffers of its own: those reach autohc, forward
    and backward, with the eager results."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    ref = model(x)
    ref.sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    before = counts()["autohc"]
    with autohc.installed():
        got = torch.compile(model)(x)
        got.sum().backward()
    assert counts()["autohc"] - before >= 5          # 2 addmm forward, 3 mm backward
    assert close(got, ref, 128)
    for p, w in zip(model.parameters(), want):
        assert close(p.grad, w, 128)


@pytest.mark.parametrize("case", ["fits", "resize", "overlap", "addmm", "addmm_beta0", "bmm", "baddbmm"])
def test_out_forms(case):
    """torch.mm(a, b, out=...) and friends: served where out is a fitting row-major buffer,
    ATen's own kernel (resizing, overlap rules) otherwise; the same numbers either way."""
    torch.manual_seed(7)
    a, b, c = torch.randn(70, 130), torch.randn(130, 90), torch.randn(90)
    A, B = torch.randn(3, 130, 140), torch.randn(3, 140, 150)     # over bmm's 128^3 floor

    def run():
        if case == "fits":
            return torch.mm(a, b, out=torch.empty(70, 90))
        if case == "resize":
            return torch.mm(a, b, out=torch.empty(0))
        if case == "overlap":
            buf = torch.randn(200, 130)
            return torch.mm(buf[:70], b[:, :90].contiguous()[:130], out=buf[70:140, :90])
        if case == "addmm":
            return torch.addmm(c, a, b, beta=0.5, alpha=2.0, out=torch.empty(70, 90))
        if case == "addmm_beta0":
            return torch.addmm(c, a, b, beta=0, out=torch.full((70, 90), float("nan")))
        if case == "bmm":
            return torch.bmm(A, B, out=torch.empty(3, 130, 150))
        return torch.baddbmm(torch.randn(3, 130, 150), A, B, alpha=0.5, out=torch.empty(3, 130, 150))
    torch.manual_seed(8)
    want = run().clone()
    before = counts()
    with autohc.installed():
        torch.manual_seed(8)
        got = run()
    served = counts()["autohc"] - before["autohc"]
    assert served == (0 if case in ("resize", "overlap") else 1)
    assert close(got, want, 130)


@pytest.mark.parametrize("case", ["transposed", "broadcast_batch", "sliced", "M1", "attention_grad"])
def test_bmm_batched_layouts_match_aten(case):
    """bmm/baddbmm run as one batched C call: every batch stride and per-matrix layout."""
    torch.manual_seed(3)
    A, B = torch.randn(5, 130, 140), torch.randn(5, 140, 150)
    if case == "transposed":
        args = (A.transpose(1, 2).contiguous().transpose(1, 2), B.transpose(1, 2).contiguous().transpose(1, 2))
    elif case == "broadcast_batch":
        args = (A[:1].expand(5, -1, -1), B)
    elif case == "sliced":
        big = torch.randn(5, 140, 300)
        args = (A, big[:, :, 7:157])
    elif case == "M1":
        args = (torch.randn(4, 1, 20000), torch.randn(4, 20000, 130))
    if case != "attention_grad":
        ref = torch.ops.aten.bmm.out(*args, out=args[0].new_empty(0))
        ref2 = torch.baddbmm(torch.ones(1, ref.shape[1], ref.shape[2]), *args, beta=0.5, alpha=-2.0)
        with autohc.installed():
            got, got2 = torch.bmm(*args), torch.baddbmm(torch.ones(1, ref.shape[1], ref.shape[2]),
                                                         *args, beta=0.5, alpha=-2.0)
        assert close(got, ref, args[0].shape[2]) and close(got2, ref2, args[0].shape[2])
        return
    q, k, v = (torch.randn(24, 256, 64, requires_grad=True) for _ in range(3))

    def attn():
        for t in (q, k, v):
            t.grad = None
        out = torch.softmax(q @ k.transpose(1, 2) * 0.125, -1) @ v
        out.backward(torch.ones_like(out))
        return out.detach(), [t.grad.clone() for t in (q, k, v)]

    ref, gref = attn()
    before = counts()["autohc"]
    with autohc.installed():
        got, g = attn()
    assert counts()["autohc"] > before
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_no_compiler_falls_back_to_aten_with_one_warning(tmp_path):
    """CC=/nonexistent and an empty cache: a small model under install() trains forward and
    backward with the same losses as stock torch, with one warning; autohc.matmul called
    directly still raises one clear line."""
    script = textwrap.dedent("""
        import json, warnings, torch, autohc
        def train(installed):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"),
                                        torch.nn.LayerNorm(128), torch.nn.Linear(128, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
            losses = []
            for _ in range(4):
                with autohc.installed() if installed else warnings.catch_warnings():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                losses.append(loss.item())
            return losses
        stock = train(False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mine = train(True)
        msgs = [str(m.message) for m in w if "autohc" in str(m.message)
                and "GOMP_SPINCOUNT" not in str(m.message)]     # install()'s thread hint
        try:
            autohc.matmul(torch.randn(4, 4), torch.randn(4, 4))
            err = None
        except autohc.CompilerNotFoundError as e:
            err = str(e)
        print(json.dumps({"stock": stock, "mine": mine, "warnings": msgs, "error": err}))
    """)
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path / "cache"), "CC": "/nonexistent/gcc"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # all of it on ATen: the same numbers up to the order of float32 reductions (torch's own
    # thread count differs while installed)
    assert r["mine"] == pytest.approx(r["stock"], rel=1e-5)
    assert len(r["warnings"]) == 1 and "runs on ATen" in r["warnings"][0], r["warnings"]
    assert r["error"] and "C compiler" in r["error"] and "\n" not in r["error"]


def test_install_does_not_compute_on_a_core_the_plan_keeps_for_helpers(monkeypatch):
    """AUTOHC_MEMORY_CORES / AUTOHC_COMM_CORES keep a core for a helper thread: the kernels'
    default thread count leaves it alone, unless the plan shares it (too few cores)."""
    from autohc.runtime import plan
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for kept, want in ((plan.CpuPlan((0, 1, 2), memory=(3,)), 3),
                           (plan.CpuPlan((0, 1), comm=(2,), memory=(3,)), 2),
                           (plan.CpuPlan((0, 1, 2, 3), memory=(3,), shared=True), 4),
                           (plan.CpuPlan((0, 1, 2, 3)), 4)):
            monkeypatch.setattr(plan, "current", lambda kept=kept: kept)
            autohc.install(torch_threads=None)
            assert kernel_threads() == want, kept
            autohc.install(threads=4, torch_threads=None)     # asked for: as asked
            assert kernel_threads() == 4
            autohc.uninstall()
    finally:
        autohc.uninstall()
        torch.set_num_threads(old)


def test_install_keeps_torchs_threads_where_its_workers_wait_briefly(monkeypatch):
    """AUTOHC_TEAM=pool: torch keeps its threads only where its workers wait briefly."""
    monkeypatch.setenv("AUTOHC_TEAM", "pool")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for env, want in (({"GOMP_SPINCOUNT": "10000"}, 2), ({"OMP_WAIT_POLICY": "passive"}, 2),
                          ({"GOMP_SPINCOUNT": "300000"}, 1), ({}, 1)):
            for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
                monkeypatch.delenv(k, raising=False)
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            with autohc.installed():
                assert torch.get_num_threads() == want, env
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def test_train_asks_for_the_short_spin_before_torch_loads():
    """`autohc train|sample|eval`, `bench parallel|memory` and `bench step --short-spin` set
    GOMP_SPINCOUNT before torch is imported (libgomp reads it then), unless the user chose a wait policy or
    --no-autohc."""
    code = ("import os, sys; from autohc.cli import main; "
            "from autohc.runtime import omp; import autohc.cli as c; "
            "c.build_parser = lambda: sys.exit(0 if os.environ.get('GOMP_SPINCOUNT') == "
            "str(omp.SHORT_SPIN) and 'torch' not in sys.modules else 3); main(sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = lambda *a, **kw: subprocess.run([sys.executable, "-c", code, *a], env={**env, **kw},  # noqa: E731
                                          capture_output=True, text=True, timeout=120).returncode
    assert run("train", "--data", "digits") == 0
    assert run("bench", "memory") == 0 and run("bench", "parallel") == 0  # autohc training only
    assert run("bench", "step") == 3                    # stock torch as a user's script runs it
    assert run("bench", "step", "--short-spin") == 0
    assert run("bench", "gemm") == 3                    # its own wait policy (bench.PASSIVE_ENV)
    assert run("train", "--no-autohc") == 3
    assert run("eval", OMP_WAIT_POLICY="ACTIVE") == 3


BF16_HW = served.bf16_served()


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_linears_run_on_autohc_bf16_kernels():
    """Under torch.autocast bf16 the Linears' addmm/mm (forward NT with the bias, dX NN, dW TN)
    are served by the bf16 kernels writing bf16 C; results as stock autocast's within bf16
    rounding; gradients of the fp32 parameters fp32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(96, 200), nn.GELU(), nn.Linear(200, 96))
    x = torch.randn(3, 41, 96, requires_grad=True)

    def step():
        x.grad = None
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(x)
        y.float().square().mean().backward()
        return [y.detach().float(), x.grad.clone(), net[0].weight.grad.clone(), net[2].bias.grad.clone()]

    ref = step()
    with autohc.installed():
        before = counts()
        got = step()
        after = counts()
    assert after["autohc"] - before["autohc"] == 6          # 2 forward, 2 x (dX, dW) backward
    assert after["aten"] == before["aten"]
    assert got[0].dtype == torch.float32 and net[0].weight.grad.dtype == torch.float32
    for r, g in zip(ref, got):
        assert ((r - g).abs().max() / r.abs().max()).item() < 2e-2


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_bf16_gemms_autohc_does_not_take_go_to_aten_unchanged():
    """A bf16 addmm whose inp is not one row (a full matrix), a bf16 bmm, mixed dtypes and
    tiny products are ATen's: the same result as without install()."""
    torch.manual_seed(1)
    a, b = torch.randn(40, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    full = torch.randn(40, 48).bfloat16()
    cases = [lambda: torch.addmm(full, a, b), lambda: torch.bmm(a[None], b[None]),
             lambda: torch.mm(a[:4, :4], b[:4, :4]), lambda: torch.addmm(full[0], a, b, beta=0.5, alpha=2)]
    refs = [f() for f in cases]
    with autohc.installed():
        before = counts()
        for f, r in zip(cases[:3], refs):
            assert torch.equal(f(), r)
        after = counts()
        assert after["autohc"] == before["autohc"] and after["aten"] - before["aten"] == 3
        got = cases[3]()                  # a row bias with beta/alpha: served, bf16 rounding
        assert counts()["autohc"] == after["autohc"] + 1
    assert ((got.float() - refs[3].float()).abs().max() / refs[3].float().abs().max()).item() < 2e-2
    with pytest.raises(RuntimeError):     # ATen's own error for a shape mismatch, unchanged
        with autohc.installed():
            torch.mm(a, a)
    with pytest.raises(RuntimeError, match="same dtype"):   # ATen's: an fp32 inp to bf16 addmm
        with autohc.installed():
            torch.addmm(full[0].float(), a, b)


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_under_torch_compile_reaches_the_bf16_kernels():
    """torch.compile of an autocast region calls mm/addmm `.out` (or the functional forms) on
    bf16 buffers: served too, with stock autocast's result within bf16 rounding."""
    torch.manual_seed(2)
    lin = nn.Linear(128, 256)
    x = torch.randn(64, 128)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.relu(lin(x))
    with torch.no_grad():
        ref = f(x)
        with autohc.installed():
            before = counts()
            got = torch.compile(f)(x)
            after = counts()
    assert after["autohc"] > before["autohc"]
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2


def _saved_dtypes_and_shapes(fn):
    """(dtype, shape) of every tensor autograd saves while fn() runs its forward."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_linear_runs_on_its_fp32_weight_without_a_bf16_copy():
    """Under autocast and install(), a Linear reads its fp32 weight in the bf16 kernels (rounded
    while packed): no bf16 copy of W is made or saved for the backward, dW is written in fp32
    (not rounded to bf16 first). Checked against a float64 reference of the bf16-rounded
    operands: y, dX and db within their one bf16 rounding, dW within fp32 sums over K = 123 rows."""
    torch.manual_seed(3)
    lin = nn.Linear(70, 45)                       # ragged: K 70, N 45, M 3 x 41 = 123
    x = torch.randn(3, 41, 70, requires_grad=True)

    def step(net):
        x.grad = None
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, saved = _saved_dtypes_and_shapes(lambda: net(x))
        y.float().square().sum().backward()       # dY = 2y, in bf16
        return y, saved, x.grad.clone(), net.weight.grad.clone(), net.bias.grad.clone()

    y_s, saved_s, gx_s, gw_s, gb_s = step(lin)            # stock autocast
    with autohc.installed():
        before = counts()
        y, saved, gx, gw, gb = step(lin)
        after = counts()
    assert after["autohc"] - before["autohc"] == 3 and after["aten"] == before["aten"]
    # stock keeps a bf16 copy of W for the backward; autohc saves W itself (fp32)
    w_shapes = lambda saved, dtype: [s for d, s in saved if d == dtype and sorted(s) == [45, 70]]
    assert w_shapes(saved_s, torch.bfloat16)
    assert not w_shapes(saved, torch.bfloat16) and w_shapes(saved, torch.float32) == [(45, 70)]
    assert y.dtype == torch.bfloat16 and y.shape == (3, 41, 45)
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32

    x16, w16 = x.detach().bfloat16().double(), lin.weight.detach().bfloat16().double()
    ref_y = x16 @ w16.T + lin.bias.detach().double()
    bf16_ulp = 2.0 ** -8
    assert ((y.double() - ref_y).abs() <= bf16_ulp * ref_y.abs() + 1e-6).all()
    dy = (2 * y.float()).bfloat16().double().reshape(-1, 45)
    ref_gx = (dy @ w16).reshape(x.shape)
    assert ((gx.double() - ref_gx).abs() <= bf16_ulp * ref_gx.abs().max()).all()
    ref_gw = dy.T @ x16.reshape(-1, 70)
    fp32_tol = 4 * (123 + 4) * 2.0 ** -24 * (dy.abs().T @ x16.abs().reshape(-1, 70))
    assert ((gw.double() - ref_gw).abs() <= fp32_tol + 1e-12).all()
    # stock rounds dW to bf16: autohc's is nearer the exact sums than that rounding allows
    assert (gw_s.double() - ref_gw).abs().max() > (gw.double() - ref_gw).abs().max()
    ref_gb = dy.sum(0)
    assert ((gb.double() - ref_gb).abs() <= bf16_ulp * ref_gb.abs().max()).all()
    for a, r in ((y, y_s), (gx, gx_s), (gw, gw_s)):
        assert ((a.float() - r.float()).abs().max() / r.float().abs().max()).item() < 2e-2


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_linear_it_does_not_serve_is_stock_autocasts():
    """A bf16 weight, a 1-D input, a tiny product and an fp16 autocast region go to autocast's
    own kernel (captured at install): stock's result bit for bit; a frozen weight and no bias
    are served, with only the gradients asked for."""
    torch.manual_seed(4)
    x = torch.randn(40, 64)

    def run(w, b, inp, dtype=torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            return F.linear(inp, w, b)
    w, b = torch.randn(48, 64), torch.randn(48)
    cases = [(w.bfloat16(), b.bfloat16(), x), (w, b, x[0]), (w[:4, :4], b[:4], x[:4, :4]),
             (w, b, x, torch.float16)]
    refs = [run(*c) for c in cases]
    with autohc.installed():
        for c, r in zip(cases, refs):
            got = run(*c)
            assert got.dtype == r.dtype and torch.equal(got.float(), r.float())
        frozen = nn.Linear(64, 48, bias=False).requires_grad_(False)
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = frozen(xg)
        assert "autohc_linear_fp32w" in y.grad_fn.name()
        y.sum().backward()                      # dY expanded from a scalar (zero strides)
    ref = torch.ones(40, 48).bfloat16().double() @ frozen.weight.bfloat16().double()
    assert frozen.weight.grad is None
    assert ((xg.grad.double() - ref).abs() <= 2.0 ** -8 * ref.abs().max()).all()


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_linear_on_fp32_weights_trains_under_torch_compile():
    """torch.compile traces install()'s autocast Linear into its graph (the custom op and its
    fake): a compiled training step gives eager's loss and gradients within bf16 rounding."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 96))
    x = torch.randn(2, 50, 96)

    def loss_of(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()
    with autohc.installed():
        net.zero_grad()
        loss_of(net).backward()
        ref = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        loss = loss_of(torch.compile(net))
        loss.backward()
    assert abs(loss.item() - loss_of(net).item()) <= 2e-2 * abs(loss.item())
    for r, p in zip(ref, net.parameters()):
        assert ((p.grad - r).abs().max() / r.abs().max()).item() < 2e-2


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_autocast_linear_results_come_from_the_result_pool(monkeypatch):
    """y, dX and dW of a Linear under autocast are kernel results like the fp32 path's: blocks of
    the result pool, so that a step's outputs land in pages written in the step before, not in
    memory the kernel faults in page by page; the second step takes the first one's blocks."""
    from autohc.runtime import memory
    pool = memory.BufferPool(256 << 20)
    monkeypatch.setattr(memory, "pool", pool)
    torch.manual_seed(6)
    lin = nn.Linear(512, 1024)            # y 1024 x 1024 bf16 2 MB, dX 1 MB, dW fp32 2 MB
    x = torch.randn(1024, 512, requires_grad=True)

    def step():
        x.grad, lin.weight.grad, lin.bias.grad = None, None, None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.float().square().sum().backward()
        return [t.clone() for t in (y.float(), x.grad, lin.weight.grad)]
    ref = step()                                    # stock autocast
    with autohc.installed():
        first = step()                              # (copies: the step's own results die)
        misses = pool.misses
        assert misses >= 3 and pool.hits == 0       # y, dX, dW: new blocks
        second = step()
        assert pool.misses == misses and pool.hits >= 3
    for a, b, r in zip(first, second, ref):
        assert torch.equal(a, b)
        assert ((a - r).abs().max() / r.abs().max()).item() < 2e-2


@pytest.mark.skipif(not BF16_HW, reason="no bf16 back-end on this CPU: autocast stays on oneDNN")
def test_opcheck_on_the_autocast_linear_ops():
    from autohc.torch import autocast
    x = torch.randn(37, 70).bfloat16()
    w, b = torch.randn(45, 70, requires_grad=True), torch.randn(45, requires_grad=True)
    torch.library.opcheck(autocast.linear_fp32w, (x, w, b))
    torch.library.opcheck(autocast.linear_fp32w, (x.requires_grad_(), w, None))
    dy = torch.randn(37, 45).bfloat16()
    torch.library.opcheck(autocast.linear_fp32w_backward, (dy, x.detach(), w.detach(), True, True, False))
    # results of 1 MB and up are result-pool blocks (a bf16 one a view of a float32 block)
    x = torch.randn(1024, 512).bfloat16()
    w, b = torch.randn(1024, 512, requires_grad=True), torch.randn(1024, requires_grad=True)
    torch.library.opcheck(autocast.linear_fp32w, (x, w, b))
    dy = torch.randn(1024, 1024).bfloat16()
    torch.library.opcheck(autocast.linear_fp32w_backward, (dy, x, w.detach(), True, True, True))
