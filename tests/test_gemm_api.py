"""autohc.matmul: what it takes, what it refuses (clearly, before writing), and its layouts."""
import threading

import numpy as np
import pytest
import torch

import autohc
import autohc.kernels.gemm.matmul as gemm_mod
from autohc.hw import cpu
from autohc.kernels.gemm.params import INSTANCE_FIELDS, default_params

from gemm_reference import check

P1 = default_params(cpu.best_isa(), 1)


@pytest.mark.parametrize("layout", ["NN", "NT", "TN"])
@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_training_layouts_are_not_copied(layout, lib, monkeypatch):
    """Forward X@W.T (NT), dX = dY@W (NN), dW = dY.T@X (TN): strides only, no copy."""
    def no_copy(*_):
        raise AssertionError("autohc.matmul copied an operand")
    monkeypatch.setattr(gemm_mod, "_copy", no_copy)
    M, K, N = 67, 45, 33
    x, w, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    a, b = {"NT": (x, w.t()), "NN": (dy, w), "TN": (dy.t(), x)}[layout]
    if lib == "numpy":
        a, b = a.numpy(), b.numpy()
    out = autohc.matmul(a, b, params=P1)
    check(out, a, b, None, 1.0, 0.0, layout)
    assert type(out) is type(a)


def test_accumulate_into_out_like_gradients():
    dy, x = torch.randn(50, 20), torch.randn(50, 30)
    grad = torch.randn(20, 30)
    g0 = grad.clone()
    autohc.matmul(dy.t(), x, out=grad, beta=1.0, params=P1)
    check(grad, dy.t(), x, g0, 1.0, 1.0)


def test_default_threads_and_explicit_threads():
    a, b = torch.randn(100, 70), torch.randn(70, 90)
    for threads in (None, 1, 2):
        check(autohc.matmul(a, b, threads=threads), a, b, None, 1.0, 0.0, f"threads={threads}")


def test_zero_sizes():
    for M, K, N in [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)]:
        a, b = torch.randn(M, K), torch.randn(K, N)
        out = autohc.matmul(a, b)
        assert out.shape == (M, N)
        assert torch.equal(out, torch.zeros(M, N))
    c = torch.full((3, 4), 2.0)
    autohc.matmul(torch.randn(3, 0), torch.randn(0, 4), out=c, beta=0.5)
    assert torch.equal(c, torch.ones(3, 4))


def test_out_aliasing_an_input_still_gives_a_at_b():
    a = torch.randn(16, 16)
    b = torch.randn(16, 16)
    expect = a.double() @ b.double()
    autohc.matmul(a, b, out=a)
    assert torch.allclose(a.double(), expect, atol=1e-4)


def test_concurrent_callers_share_a_kernel_safely():
    a, b = torch.randn(200, 150), torch.randn(150, 170)
    ref = a.double() @ b.double()
    errors = []

    def worker():
        try:
            for _ in range(20):
                out = autohc.matmul(a, b, threads=2)
                assert torch.allclose(out.double(), ref, atol=1e-3)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ts = [threading.Thread(target=worker) for _ in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors


def test_kernels_of_other_blocks_and_ways_are_instances_of_one_library():
    """kc, mc, nc and the thread ways are run-time values of an instance: kernels that differ
    only in them share one compiled library and run side by side, each with its own buffers."""
    import dataclasses
    from autohc.kernels.gemm.kernel import get_kernel
    base = default_params(cpu.best_isa(), 2)
    variants = [base, dataclasses.replace(base, kc=64, mc=4 * base.mr, nc=2 * base.nr),
                dataclasses.replace(base, jc_ways=1, ic_ways=1, jr_ways=2, depth=3),
                dataclasses.replace(base, jc_ways=1, ic_ways=1, jr_ways=1, depth=1)]
    kernels = [get_kernel(p.validate()) for p in variants]
    assert len({k.library.path for k in kernels}) == 1 and len({p.symbol for p in variants}) == 4
    a, b = torch.randn(203, 150), torch.randn(150, 171)
    errors = []

    def worker(p):
        try:
            for _ in range(5):              # interleaved with the other instances' calls
                check(autohc.matmul(a, b, params=p), a, b, None, 1.0, 0.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ts = [threading.Thread(target=worker, args=(p,)) for p in variants]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    for k in kernels:                       # buffers freed (a tuner's losers): the next call makes them again
        k.trim()
        k.trim()
    for p in variants[:2]:
        check(autohc.matmul(a, b, params=p), a, b, None, 1.0, 0.0)
    lib, fn = kernels[0].library, base.library_symbol
    new = getattr(lib.lib, f"{fn}_new")
    assert new(*base.instance_args()) != lib.ffi.NULL
    for bad in [dict(kc=0), dict(mc=base.mr + 1), dict(nc=base.nr - 1), dict(jc_ways=0), dict(jc_ways=300),
                dict(depth=4)]:          # (what validate() refuses; C checks it again)
        args = dict(zip(INSTANCE_FIELDS, base.instance_args()))
        assert new(*{**args, **bad}.values()) == lib.ffi.NULL, bad


@pytest.mark.parametrize("args, kwargs, exc, message", [
    ((torch.randn(3, 4), torch.randn(5, 6)), {}, ValueError, "do not multiply"),
    ((torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)), {}, TypeError, "float32"),
    ((torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 2, dtype=torch.int32)), {}, TypeError, "float32"),
    ((torch.randn(3, 4, dtype=torch.complex64), torch.randn(4, 2)), {}, TypeError, "float32"),
    ((torch.randn(2, 3, 4), torch.randn(4, 2)), {}, ValueError, "2-D"),
    ((torch.randn(4), torch.randn(4, 2)), {}, ValueError, "2-D"),
    ((torch.randn(3, 4), np.ones((4, 2), np.float32)), {}, TypeError, "do not mix"),
    (([[1.0]], [[2.0]]), {}, TypeError, "torch.Tensor or numpy.ndarray"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"beta": 1.0}, ValueError, "needs out="),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"out": torch.empty(2, 3)}, ValueError, "expected"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"out": torch.empty(3, 2, dtype=torch.float64)}, TypeError, "float32"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"alpha": 1j}, TypeError, "real number"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"alpha": "2"}, TypeError, "real number"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"threads": 0}, ValueError, "threads"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"threads": 1.5}, ValueError, "threads"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"params": {"mr": 6}}, TypeError, "GemmParams"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"threads": 2, "params": P1}, ValueError, "params run"),
    ((torch.randn(3, 4, requires_grad=True), torch.randn(4, 2)), {}, TypeError, "autograd"),
    ((torch.randn(3, 4), torch.randn(4, 2)), {"out": torch.empty(1, 2).expand(3, 2)}, ValueError, "zero stride"),
])
def test_bad_inputs_raise_clear_errors(args, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        autohc.matmul(*args, **kwargs)


def test_bad_input_leaves_out_untouched():
    out = torch.full((3, 2), 7.0)
    with pytest.raises(TypeError):
        autohc.matmul(torch.randn(3, 4), torch.randn(4, 2), out=out, alpha=None)
    assert torch.equal(out, torch.full((3, 2), 7.0))


def test_params_are_validated_on_every_call_until_they_pass():
    """matmul(params=...) validates a params object once (it is frozen); one that fails is
    checked again on every call, and none runs."""
    import dataclasses
    from autohc.kernels.gemm.params import ParamError
    good = gemm_mod.default_kernel_params(1)
    bad = dataclasses.replace(good, nr=good.nr + 1)     # (replace does not validate)
    a, b = torch.randn(9, 7), torch.randn(7, 5)
    out = torch.full((9, 5), 7.0)
    for _ in range(2):
        with pytest.raises(ParamError):
            autohc.matmul(a, b, out=out, params=bad)
        assert torch.equal(out, torch.full((9, 5), 7.0))
    for _ in range(2):
        check(autohc.matmul(a, b, out=out, params=good), a, b, None, 1.0, 0.0)


def test_requires_grad_allowed_under_no_grad():
    a = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        out = autohc.matmul(a, torch.randn(4, 2))
    assert out.shape == (3, 2) and not out.requires_grad


def test_misaligned_numpy_rejected():
    raw = np.zeros(4 * 12 + 1, np.uint8)[1:].view(np.float32).reshape(3, 4)
    assert not raw.flags.aligned
    with pytest.raises(ValueError, match="aligned"):
        autohc.matmul(raw, np.ones((4, 2), np.float32))


def test_fork_after_use_gets_a_fresh_pool():
    """DataLoader workers fork: a child must not wait on the parent's threads."""
    import os
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ref = autohc.matmul(a, b, threads=2).numpy().copy()
    pid = os.fork()
    if pid == 0:  # child: no torch math here (libgomp itself is not fork-safe)
        try:
            out = autohc.matmul(a, b, threads=2)
            os._exit(0 if np.array_equal(out.numpy(), ref) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
