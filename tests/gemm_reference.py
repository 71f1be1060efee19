"""float64 reference for C := alpha * A @ B + beta * C and its K-scaled error bound."""
import numpy as np
import torch

U32 = 2.0 ** -24  # fp32 unit roundoff


def _f64(x):
    return torch.from_numpy(np.array(x, dtype=np.float64)) if isinstance(x, np.ndarray) \
        else x.double()


def reference(a, b, c0, alpha, beta):
    """(expected, bound) in float64; bound is the worst-case fp32 rounding error, scaled to K."""
    a64, b64 = _f64(a), _f64(b)
    K = a64.shape[1]
    prod = a64 @ b64
    mag = a64.abs() @ b64.abs()
    expected = alpha * prod
    scale = abs(alpha) * mag
    if beta != 0.0:
        c64 = _f64(c0)
        expected = expected + beta * c64
        scale = scale + abs(beta) * c64.abs()
    # Higham: |fl(sum) - sum| <= gamma_K * sum|a||b|; + alpha, beta and the final rounding
    bound = 2.0 * (K + 4) * U32 * scale + 1e-30
    return expected, bound


def check(result, a, b, c0, alpha, beta, what=""):
    expected, bound = reference(a, b, c0, alpha, beta)
    got = _f64(result)
    assert got.shape == expected.shape, what
    err = (got - expected).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        i, j = [int(x) for x in bad.nonzero()[0]]
        raise AssertionError(f"{what}: {int(bad.sum())} wrong elements, first at ({i},{j}): "
                             f"got {got[i, j].item()}, want {expected[i, j].item()} "
                             f"(bound {bound[i, j].item():.3g})")
