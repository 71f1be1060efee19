"""Frozen bf16 weights (autohc.frozen), sampling precision and `autohc bench sample`."""
import pytest
import torch

import autohc
from autohc.torch import frozen as frozen_mod
from autohc.torch import served


def _bf16_linear(lin, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return lin(x).float()


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_frozen_equals_unfrozen_and_edits_are_repacked():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    x = torch.randn(64, 96)
    with autohc.installed(first_use_tuning=False):
        plain = _bf16_linear(lin, x)
        with autohc.frozen(lin):
            copies = frozen_mod.stats["copies"]
            a = _bf16_linear(lin, x)
            b = _bf16_linear(lin, x)
            assert frozen_mod.stats["copies"] == copies + 1      # rounded once, served twice
            assert torch.equal(a, plain) and torch.equal(b, plain)
            with torch.no_grad():
                lin.weight.mul_(2)                              # an edit: never served stale
            c = _bf16_linear(lin, x)
            assert frozen_mod.stats["copies"] == copies + 2
        again = _bf16_linear(lin, x)
    assert torch.equal(c, again) and not torch.equal(c, plain)
    assert not frozen_mod._weights                              # freed at the block's end


def test_frozen_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        with autohc.frozen(torch.zeros(3)):
            pass


def test_guided_eps_bf16_returns_fp32_close_to_fp32():
    from autohc.bench.sample import random_weights
    from autohc.bench.step import synthetic_model
    from autohc.dit.sample import guided_eps
    arch = {"in_channels": 4, "class_dropout": 0.1}
    m = random_weights(synthetic_model("DiT-Ti/8", 16)).eval()
    x, t, y = torch.randn(2, 4, 16, 16), torch.tensor([10, 900]), torch.tensor([1, 2])
    with torch.no_grad():
        e32 = guided_eps(m, arch, y, 4.0, "fp32")(x, t)
        e16 = guided_eps(m, arch, y, 4.0, "bf16")(x, t)
    assert e16.dtype == torch.float32 and e16.shape == e32.shape
    assert float((e16 - e32).abs().max()) <= 5e-2 * float(e32.abs().max())
    assert not torch.equal(e16, e32)


def test_bench_sample_tiny_model():
    from autohc.bench.sample import bench_sample
    r = bench_sample("DiT-Ti/8", 2, image_size=16, samples=2, warmup=1, sample_steps=10,
                     modes=["diffusers", "diffusers-bf16", "autohc", "autohc-bf16"], first_use_tuning=False)
    assert set(r["step_s"]) == {"diffusers", "diffusers-bf16", "autohc", "autohc-bf16"}
    for m, s in r["step_s"].items():
        assert s > 0 and r["s_per_image"][m] == pytest.approx(s * 10 / 2)
    assert r["eps_reference"]["autohc-bf16"] == "autohc"
    assert r["max_rel_eps_diff"]["autohc-bf16"] < 0.1
    assert r["max_rel_eps_diff"]["diffusers-bf16"] < 0.1
    # the two fp32 models differ only by diffusers' timestep embedding: close, not equal
    assert 0 < r["max_rel_eps_diff"]["autohc"] < 0.2
    assert r["max_rel_eps_diff"]["diffusers"] is None


def test_bench_sample_bad_mode():
    from autohc.bench.sample import bench_sample
    with pytest.raises(ValueError, match="unknown modes"):
        bench_sample("DiT-Ti/8", 1, modes=["nope"])


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_frozen_packed_weights_equal_unfrozen_and_edits_are_repacked():
    """frozen(packed=True): each weight packed once into its kernel's panels, the forward the
    same bits as unfrozen (M past the skinny paths: the packed path reads the packing), an
    in-place edit packed again, never served stale; without packed=True nothing is packed."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(160, 200)
    x = torch.randn(300, 160)
    with autohc.installed(first_use_tuning=False):
        plain = _bf16_linear(lin, x)
        packs = frozen_mod.stats["packs"]
        with autohc.frozen(lin):
            assert torch.equal(_bf16_linear(lin, x), plain)
        assert frozen_mod.stats["packs"] == packs                # not asked for
        with autohc.frozen(lin, packed=True):
            a = _bf16_linear(lin, x)
            b = _bf16_linear(lin, x)
            took = frozen_mod.stats["packs"] - packs
            assert took <= 1 and torch.equal(a, plain) and torch.equal(b, plain)
            with torch.no_grad():
                lin.weight.mul_(-3)
            c = _bf16_linear(lin, x)
            assert frozen_mod.stats["packs"] - packs == 2 * took
        again = _bf16_linear(lin, x)
    assert torch.equal(c, again) and not torch.equal(c, plain)
    with pytest.raises(TypeError, match="packed"):
        with autohc.frozen(lin, packed="yes"):
            pass
