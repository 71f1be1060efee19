"""Quality check on digits (`autohc eval`): a classifier trained on the real 8x8 digits
(scikit-learn MLP, one hidden layer) labels generated samples. Reported: the share classified
as the class asked for, and the Fréchet distance between real and generated samples in the
classifier's hidden-layer feature space (with, for scale, the distance between two halves of
the real digits)."""
from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=1)
def digits_classifier():
    """(classifier, held-out accuracy), trained on 1437 of the 1797 digits (fixed split)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.data / 16.0, d.target, test_size=0.2, random_state=0,
                                          stratify=d.target)
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=600, random_state=0).fit(xtr, ytr)
    return clf, float(clf.score(xte, yte))


def features(clf, x01: np.ndarray) -> np.ndarray:
    """The classifier's hidden-layer (ReLU) activations of (N, 64) inputs in [0, 1]."""
    return np.maximum(x01 @ clf.coefs_[0] + clf.intercepts_[0], 0.0)


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    import warnings
    from scipy import linalg
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    with warnings.catch_warnings():     # dead ReLU units make the covariances singular
        warnings.simplefilter("ignore")
        covmean, _ = linalg.sqrtm(s1 @ s2, disp=False)
    if not np.isfinite(covmean).all():          # near-singular: regularise as the FID code does
        off = np.eye(len(s1)) * 1e-6
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            covmean, _ = linalg.sqrtm((s1 + off) @ (s2 + off), disp=False)
    covmean = covmean.real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def evaluate_digits(samples, labels) -> dict:
    """samples: (N, 1, 8, 8) in [-1, 1] (torch or numpy); labels: the classes asked for."""
    from sklearn.datasets import load_digits
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 4 or x.shape[1:] != (1, 8, 8):
        raise ValueError(f"digits evaluation wants (N, 1, 8, 8) samples, got {x.shape}")
    y = np.asarray(labels)
    x01 = np.clip((x.reshape(len(x), 64) + 1) / 2, 0, 1)
    clf, acc = digits_classifier()
    pred = clf.predict(x01)
    real = load_digits().data / 16.0
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(real))
    f_real, f_gen = features(clf, real), features(clf, x01)
    half = len(real) // 2
    per_class = {int(c): float((pred[y == c] == c).mean()) for c in np.unique(y)}
    return {"samples": int(len(x)), "class_match": float((pred == y).mean()), "per_class": per_class,
            "frechet": frechet(f_real, f_gen),
            "frechet_real_halves": frechet(f_real[perm[:half]], f_real[perm[half:]]),
            "classifier_test_accuracy": acc}
