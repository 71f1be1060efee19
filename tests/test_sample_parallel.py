"""Several ranks on one batch of samples (autohc/dit/sample_parallel.py): CFG parallel and patch
parallel at 2 ranks against one process, on a random-weight DiT whose every layer does work
(adaLN and the final layer not zero), fp32 (max abs diff <= 1e-5) and bf16 autocast, stock torch
and autohc's kernels and fused ops; `autohc sample --parallel` end to end and its bad input."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp_mp

from autohc.dit.diffusion import GaussianDiffusion
from autohc.dit.model import DiT

ENV = {k: v for k, v in os.environ.items()
       if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
B, STEPS, CFG = 3, 4, 3.0
CASES = [(mode, prec, kernels) for mode in ("cfg", "patch") for prec in ("fp32", "bf16")
         for kernels in ("torch", "autohc")]


def random_dit(seed=0):
    """DiT-Ti/2 on 8 x 8 x 4 latents (16 tokens), 10 classes, every weight N(0, 0.05)."""
    torch.manual_seed(seed)
    m = DiT.from_name("DiT-Ti/2", input_size=8, in_channels=4, num_classes=10)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.eval()


def _sample(model, eps_fn, rows=range(B)):
    """(the first step's eps on fixed inputs, the samples of `rows`)."""
    x = torch.randn(len(rows), 4, 8, 8, generator=torch.Generator().manual_seed(9))
    first = eps_fn(x, torch.full((len(rows),), 999, dtype=torch.long))
    gens = [torch.Generator().manual_seed(100 + i) for i in rows]
    return first, GaussianDiffusion().sample(eps_fn, (len(rows), 4, 8, 8), sampler="ddim", steps=STEPS,
                                             clip=True, generators=gens)


def _context(kernels):
    import contextlib
    import autohc
    return autohc.installed(first_use_tuning=False) if kernels == "autohc" else contextlib.nullcontext()


def _ops(kernels):
    import autohc
    return autohc.ops if kernels == "autohc" else None


def one_process(prec, kernels):
    """(first eps, samples) of one process, and its own floor: the samples drawn one image a
    batch (a GEMM's blocking over the rows moves the last bits)."""
    from autohc.dit.sample import guided_eps
    from autohc.torch.frozen import frozen
    model = random_dit().use_fused_ops(_ops(kernels))
    arch = {"in_channels": 4, "class_dropout": 0.1}
    y = torch.tensor([1, 7, 3])
    with torch.no_grad(), _context(kernels), frozen(model):
        first, x = _sample(model, guided_eps(model, arch, y, CFG, prec))
        alone = torch.cat([_sample(model, guided_eps(model, arch, y[i:i + 1], CFG, prec), [i])[1] for i in range(B)])
    return first, x, (alone - x).abs().max().item()


def _member(rank, store_path, out_dir):
    import torch.distributed as tdist
    from autohc.dit import sample_parallel as sp
    from autohc.dit.sample import guided_eps
    from autohc.torch.frozen import frozen
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        arch = {"in_channels": 4, "class_dropout": 0.1, "num_classes": 10}
        y = torch.tensor([1, 7, 3])
        teams = {m: sp.form(m, 2, 2, rank) for m in ("cfg", "patch")}
        results = {}
        for mode, prec, kernels in CASES:
            model = random_dit().use_fused_ops(_ops(kernels))
            team = teams[mode]
            with torch.no_grad(), _context(kernels), frozen(model), sp.token_split(model, team):
                eps = (sp.cfg_eps(model, arch, y, CFG, prec, team) if mode == "cfg"
                       else guided_eps(model, arch, y, CFG, prec))
                results[f"{mode}-{prec}-{kernels}"] = _sample(model, eps)
            assert model.token_split is None and model.blocks[0].attn.token_split is None
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    where = tmp_path_factory.mktemp("teams")
    tmp_mp.spawn(_member, args=(str(where / "store"), str(where)), nprocs=2, join=True)
    return [torch.load(where / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.xdist_group("net")
@pytest.mark.parametrize("mode,prec,kernels", CASES)
def test_a_team_of_two_draws_the_one_process_samples(teams, mode, prec, kernels):
    """fp32: the model's eps within 1e-5 of one process's; the samples within twice one process's
    own floor (DDIM's first step divides by sqrt(alpha_bar_999) = 0.0064, so an eps rounding
    of 1e-7 moves x0 by 2e-5) or 5e-5. bf16: within its rounding."""
    first, ref, floor = one_process(prec, kernels)
    got = [t[f"{mode}-{prec}-{kernels}"] for t in teams]
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][0], got[1][0])  # the members agree
    assert ref.std() > 0.3 and ref.abs().max() <= 1.0 and torch.isfinite(ref).all()
    eps_diff = (got[0][0] - first).abs().max().item()
    diff = (got[0][1] - ref).abs().max().item()
    if prec == "fp32":
        assert eps_diff <= 1e-5 and floor <= 1e-4, (eps_diff, floor)
        assert diff <= max(2 * floor, 5e-5), (diff, floor)
    else:                                       # bf16: its rounding, compounded over the steps
        assert eps_diff <= 0.02 * first.abs().max().item(), eps_diff
        assert diff <= max(2 * floor, 0.05), (diff, floor)


def test_patch_parallel_attention_sees_every_token():
    """One member's queries over gathered K/V equal the full attention's rows (a fake team of
    two whose gather concatenates this rank's slice with the other's, taken from the full qkv)."""
    from autohc.dit.sample_parallel import Team, TokenSplit
    torch.manual_seed(3)
    qkv = torch.randn(2, 16, 3 * 12)
    heads = 3
    q, k, v = qkv.reshape(2, 16, 3, heads, 4).permute(2, 0, 3, 1, 4).unbind(0)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 16, 12)

    class Fake(TokenSplit):
        def all(self, t, dim):      # the other member's K/V slice, taken from the full qkv
            assert dim == 0 and t.shape == (8, 2, 24)           # token-major (T_local, B, 2D)
            other = (qkv[:, 8:, 12:] if self.team.member == 0 else qkv[:, :8, 12:]).transpose(0, 1)
            return torch.cat([t, other] if self.team.member == 0 else [other, t], dim=0)
    for member in (0, 1):
        split = Fake(Team("patch", 2, 2, member))
        local = split.local(qkv)
        assert local.shape[1] == 8
        torch.testing.assert_close(split.attention(local, heads), full[:, member * 8:(member + 1) * 8])


# ---- the command -------------------------------------------------------------------------

def _cli(*args, launcher=None, ranks=2, timeout=300):
    cmd = [sys.executable, "-m", "autohc.cli", *map(str, args)]
    if launcher == "torchrun":
        cmd = [shutil.which("torchrun"), "--nproc-per-node", str(ranks), "-m", "autohc.cli", *map(str, args)]
    elif launcher == "mpirun":
        cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *cmd]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The random DiT as a facebookresearch/DiT-style state dict (a latent model, no VAE named)."""
    p = tmp_path_factory.mktemp("rand") / "rand.pt"
    torch.save(random_dit().state_dict(), p)
    return p


SET = ["--num-samples", "8", "--per-batch", "4", "--sample-steps", "3", "--threads", "1", "--precision", "fp32"]


@pytest.fixture(scope="module")
def one_set(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "one.npz"
    r = _cli("sample", "--ckpt", ckpt, *SET, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.xdist_group("net")
@pytest.mark.parametrize("mode", ["cfg", "patch"])
def test_sample_parallel_under_torchrun_gives_the_one_process_set(ckpt, one_set, mode, tmp_path):
    r = _cli("sample", "--ckpt", ckpt, *SET, "--parallel", mode, "--out", tmp_path / "team.npz", "--json",
             launcher="torchrun")
    assert r.returncode == 0, r.stderr[-3000:]
    what = "CFG parallel" if mode == "cfg" else "patch parallel (2 token slices)"
    assert f"over 2 ranks (torchrun, {what}: 1 team of 2 ranks)" in r.stderr
    summary = json.loads(r.stdout)
    assert summary["parallel"] == ("cfg" if mode == "cfg" else "patch:2") and summary["drawn"] == 8
    with np.load(one_set) as a, np.load(tmp_path / "team.npz") as b:
        assert np.array_equal(a["labels"], b["labels"])
        assert np.abs(a["arr_0"].astype(int) - b["arr_0"]).max() <= 1


@pytest.mark.xdist_group("net")
def test_teams_combine_with_data_parallel_under_mpirun(ckpt, one_set, tmp_path):
    """4 ranks under mpirun with --parallel cfg: 2 teams of 2, taking the 2 batches round-robin."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (CI installs it: .ci/run)")
    r = _cli("sample", "--ckpt", ckpt, *SET, "--parallel", "cfg", "--out", tmp_path / "team.npz", "--json",
             launcher="mpirun", ranks=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "over 4 ranks (openmpi, CFG parallel: 2 teams of 2 ranks)" in r.stderr
    assert json.loads(r.stdout)["drawn"] == 8
    with np.load(one_set) as a, np.load(tmp_path / "team.npz") as b:
        assert np.array_equal(a["labels"], b["labels"])
        assert np.abs(a["arr_0"].astype(int) - b["arr_0"]).max() <= 1


def test_the_parallel_mode_is_a_setting_of_the_set(ckpt, tmp_path, capsys):
    """A set's shards drawn by teams are not continued by data parallel (their last bits differ)."""
    from autohc.dit.sample_set import Settings, Shards
    from autohc.cli import main
    out = tmp_path / "s.npz"
    r = _cli("sample", "--ckpt", ckpt, *SET, "--keep-shards", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "s.npz.parts" / "meta.json").read_text())
    assert meta["parallel"] == "data" and set(meta) == {"format", *Settings.__dataclass_fields__}
    del meta["parallel"]                        # a set from before the setting: data parallel
    (tmp_path / "s.npz.parts" / "meta.json").write_text(json.dumps(meta))
    Shards(out, 8, 4).check_meta(Settings(**{k: v for k, v in meta.items() if k != "format"}))
    meta["parallel"] = "patch:2"
    (tmp_path / "s.npz.parts" / "meta.json").write_text(json.dumps(meta))
    assert main(["sample", "--ckpt", str(ckpt), *SET, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel 'patch:2' there, 'data' here" in err, err


@pytest.mark.parametrize("extra,says", [
    (["--parallel", "cfg"], "--parallel cfg: 1 rank cannot form teams of 2"),
    (["--parallel", "cfg", "--cfg", "1"], "--parallel cfg: this set has no classifier-free guidance"),
    (["--parallel", "patch", "--parallel-ranks", "3"], "--parallel-ranks 3: patch parallel needs a divisor of "
                                                       "the model's 16 tokens"),
    (["--parallel-ranks", "2"], "--parallel-ranks 2: ranks share a batch only with --parallel cfg or patch"),
    (["--parallel", "cfg", "--parallel-ranks", "4"], "--parallel-ranks 4: CFG parallel puts the conditional"),
])
def test_bad_parallel_input_is_one_line_exit_2_nothing_written(ckpt, extra, says, tmp_path, capsys):
    from autohc.cli import main
    assert main(["sample", "--ckpt", str(ckpt), *SET, *extra, "--out", str(tmp_path / "s.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("autohc: ") and says in err, err
    assert not list(tmp_path.iterdir())


def test_a_grid_refuses_parallel(ckpt, tmp_path, capsys):
    from autohc.cli import main
    assert main(["sample", "--ckpt", str(ckpt), "--classes", "1", "--per-class", "1", "--parallel", "cfg",
                 "--out", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a grid" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.xdist_group("net")
def test_bench_sample_parallel_times_each_layout_against_one_process():
    from autohc.bench.sample_parallel import bench_sample_parallel
    r = bench_sample_parallel("DiT-Ti/2", 2, image_size=8, samples=2, warmup=1, rounds=1, threads=2,
                              precision="fp32", layouts=("cfg", "patch"))
    assert set(r["step_s"]) == {"one", "cfg", "patch"} and all(v > 0 for v in r["step_s"].values())
    assert all(len(v) == 2 for v in r["step_times"].values())
    assert set(r["speedups"]) == {"cfg vs one", "patch vs one"}
    assert all(d <= 1e-5 for d in r["max_rel_eps_diff"].values()), r["max_rel_eps_diff"]


@pytest.mark.parametrize("extra,says", [
    (["--parallel", "cfg", "--ranks", "3", "--threads", "3"], "CFG parallel runs on 2 ranks, not 3"),
    (["--parallel", "patch", "--threads", "3"], "3 threads do not split over 2 ranks"),
    (["--parallel", "cfg", "--modes", "autohc"], "--modes and --parallel are two benchmarks"),
])
def test_bench_sample_parallel_bad_input_is_one_line(extra, says, capsys):
    from autohc.cli import main
    assert main(["bench", "sample", "--model", "DiT-Ti/2", "--image-size", "8", *extra]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("autohc: note:")]
    assert len(err) == 1 and says in err[0], err      # (a note: more threads than CPUs)
