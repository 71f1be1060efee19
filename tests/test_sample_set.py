"""`autohc sample --num N --out SET.npz`: a sample set in the ADM suite's format, bit-identical for
any number of ranks (torchrun, mpirun), resumable from its shards after kill -9 or a stop signal,
refusing other settings and bad input in one line (autohc/dit/sample_set.py)."""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from autohc.cli import main

# a subprocess here is one process, not a rank of the launcher that may have started pytest
ENV = {k: v for k, v in os.environ.items()
       if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
FAST = ["--sample-steps", "3", "--threads", "1"]
# the set that is stopped, killed and torn: 8 batches of 2, each long enough to stop within the
# run; on stock torch kernels (what is tested is the shards, and autohc's kernels take a second
# or two to load in each process)
SET16 = ["--num", "16", "--per-batch", "2", "--sample-steps", "15", "--no-autohc"]
SLOW = [*SET16, "--threads", "1"]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "autohc.cli", *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 4-step DiT-Ti/8 on digits; under pytest-xdist one for both workers, built under a lock in
    the folder their base temp folders share (pytest removes it with old runs)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        where = tmp_path_factory.getbasetemp().parent / "sample-set-ckpt"
        where.mkdir(exist_ok=True)
    else:
        where = tmp_path_factory.mktemp("ckpt")
    run = where / "run"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run / "done").exists():
            r = _cli("train", "--model", "DiT-Ti/8", "--data", "digits", "--batch", "16", "--steps", "4",
                     "--threads", "1", "--no-progress", "--samples-per-class", "0", "--out", run, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            (run / "done").write_text("")
    return run


def _load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _same(a, b):
    assert a.keys() == b.keys() == {"arr_0", "labels"}
    assert np.array_equal(a["labels"], b["labels"]) and np.array_equal(a["arr_0"], b["arr_0"])


@pytest.fixture(scope="module")
def set64(ckpt, tmp_path_factory):
    """64 images in batches of 6, one process."""
    out = tmp_path_factory.mktemp("set64") / "s.npz"
    r = _cli("sample", "--ckpt", ckpt, "--num", 64, "--per-batch", 6, *FAST, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return _load(out)


@pytest.fixture(scope="module")
def ref(ckpt, tmp_path_factory):
    """The SLOW set uninterrupted, its shards kept: (arrays, the shard folder)."""
    out = tmp_path_factory.mktemp("ref") / "s.npz"
    r = _cli("sample", "--ckpt", ckpt, *SLOW, "--keep-shards", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return _load(out), out.with_name("s.npz.parts")


def test_one_process_set_in_the_adm_format_whatever_the_per_batch(ckpt, set64, tmp_path):
    from autohc.dit.sample_set import labels_and_generators
    a = set64
    assert a["arr_0"].shape == (64, 8, 8, 1) and a["arr_0"].dtype == np.uint8
    assert a["labels"].dtype == np.int64 and a["labels"].shape == (64,)
    y, _ = labels_and_generators(range(64), 0, list(range(10)))      # labels: a function of (seed, i)
    assert np.array_equal(a["labels"], y.numpy()) and len(set(a["labels"].tolist())) > 5
    assert 0 < a["arr_0"].std() and a["arr_0"].max() > a["arr_0"].min()
    # the first 20 of the set in other batches (image i depends on (seed, i), not on --num)
    out = tmp_path / "b4.npz"
    r = _cli("sample", "--ckpt", ckpt, "--num", 20, "--per-batch", 4, *FAST, "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["drawn"] == 20 and summary["shape"] == [8, 8, 1] and summary["per_batch"] == 4
    assert not out.with_name("b4.npz.parts").exists()                # shards removed at the end
    b = _load(out)
    # other batches: the same images up to a GEMM's blocking over the batch (the last bits of fp32)
    assert np.array_equal(a["labels"][:20], b["labels"])
    assert np.abs(a["arr_0"][:20].astype(int) - b["arr_0"]).max() <= 1
    assert (a["arr_0"][:20] != b["arr_0"]).mean() < 0.01


@pytest.mark.xdist_group("net")
def test_two_ranks_under_torchrun_give_the_one_process_set(ckpt, set64, tmp_path):
    torchrun = shutil.which("torchrun") or pytest.fail("torchrun not found (it ships with torch)")
    out = tmp_path / "s.npz"
    # --num-samples: torchrun itself takes --num (for --numa-binding)
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "autohc.cli", "sample", "--ckpt", str(ckpt),
                        "--num-samples", "64", "--per-batch", "6", *FAST, "--out", str(out)],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "over 2 ranks (torchrun)" in r.stderr
    _same(_load(out), set64)


@pytest.mark.xdist_group("net")
def test_two_ranks_under_mpirun_give_the_one_process_set(ckpt, set64, tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI is not installed (CI installs it: .ci/run)")
    out = tmp_path / "s.npz"
    r = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                        "autohc.cli", "sample", "--ckpt", str(ckpt), "--num", "64", "--per-batch", "6", *FAST,
                        "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "over 2 ranks (openmpi)" in r.stderr
    _same(_load(out), set64)


def _start_and_wait_for_shards(ckpt, out, shards: int):
    p = subprocess.Popen([sys.executable, "-m", "autohc.cli", "sample", "--ckpt", str(ckpt), *SLOW,
                          "--out", str(out)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parts = out.with_name(out.name + ".parts")
    deadline = time.monotonic() + 240
    while len(list(parts.glob("batch-*.npz"))) < shards:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no shards written"
        time.sleep(0.01)
    return p, parts


def test_kill_9_then_the_same_command_finishes_the_set(ckpt, ref, tmp_path):
    out = tmp_path / "s.npz"
    p, parts = _start_and_wait_for_shards(ckpt, out, 2)
    p.kill()
    p.communicate()
    assert p.returncode == -signal.SIGKILL and not out.exists()
    kept = len(list(parts.glob("batch-*.npz")))
    assert 2 <= kept < 8
    r = _cli("sample", "--ckpt", ckpt, *SLOW, "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["from_shards"] == 2 * kept and summary["drawn"] == 16 - 2 * kept
    assert f"{2 * kept} images already there" in r.stderr
    _same(_load(out), ref[0])                   # every index once, as the uninterrupted run
    assert not parts.exists()


def test_a_torn_shard_is_drawn_again(ckpt, ref, tmp_path):
    out = tmp_path / "s.npz"
    parts = out.with_name("s.npz.parts")
    shutil.copytree(ref[1], parts)
    torn = parts / "batch-00000003.npz"
    torn.write_bytes(torn.read_bytes()[:100])
    r = _cli("sample", "--ckpt", ckpt, *SLOW, "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"warning: {torn} does not load" in r.stderr and "drawing batch 3 again" in r.stderr
    assert json.loads(r.stdout)["drawn"] == 2
    _same(_load(out), ref[0])


def test_sigterm_stops_with_exit_75_and_the_same_command_continues(ckpt, ref, tmp_path):
    out = tmp_path / "s.npz"
    p, parts = _start_and_wait_for_shards(ckpt, out, 1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-3000:]
    line = [ln for ln in err.splitlines() if "SIGTERM" in ln]
    assert len(line) == 1 and re.fullmatch(
        rf"autohc sample: SIGTERM at image (\d+) of 16: stopping; shards kept in {re.escape(str(parts))}; "
        "the same command continues", line[0]), err
    at = int(re.search(r"at image (\d+)", line[0]).group(1))
    assert at == 2 * len(list(parts.glob("batch-*.npz"))) and 2 <= at < 16
    assert not out.exists() and not list(parts.glob(".*.tmp"))
    r = _cli("sample", "--ckpt", ckpt, *SLOW, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    _same(_load(out), ref[0])


def _tree(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_other_settings_into_the_same_out_are_refused(ckpt, ref, tmp_path, capsys):
    out = tmp_path / "s.npz"
    parts = out.with_name("s.npz.parts")
    shutil.copytree(ref[1], parts)
    before = sorted(p.name for p in tmp_path.iterdir()), _tree(parts)
    for extra, setting in ((["--per-batch", "4"], "per_batch 2 there, 4 here"), (["--seed", "1"], "seed 0 there"),
                           (["--cfg", "3"], "cfg 2.0 there, 3.0 here"),
                           (["--sampler", "ddpm"], "sampler 'ddim' there")):
        # in this process (no --threads: its threads stay as they were); the last option wins
        assert main(["sample", "--ckpt", str(ckpt), *SET16, *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"autohc: {parts} holds shards of another sample set ({setting}"), err
    assert (sorted(p.name for p in tmp_path.iterdir()), _tree(parts)) == before


def _no_dropout_ckpt(ckpt, path):
    """The checkpoint's EMA weights as if trained without label dropout: no null class."""
    state = torch.load(next(ckpt.glob("ckpt-*.pt")), weights_only=True)
    ema = state["ema"]
    ema["y_embedder.embedding_table.weight"] = ema["y_embedder.embedding_table.weight"][:10]
    torch.save({"format": state["format"], "arch": {**state["arch"], "class_dropout": 0.0},
                "step": state["step"], "model": ema, "ema": ema}, path)
    return path


@pytest.mark.parametrize("case", ["num 0", "per-batch 0", "cfg without label dropout", "class 10",
                                  "out under a file", "png out", "per-class"])
def test_bad_input_is_one_line_exit_2_nothing_written(case, ckpt, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = tmp_path / "s.npz"
    if case == "cfg without label dropout":
        ckpt = _no_dropout_ckpt(ckpt, tmp_path / "c.pt")
    args = {"num 0": ["--num", "0"], "per-batch 0": ["--num", "4", "--per-batch", "0"],
            "cfg without label dropout": ["--num", "4", "--cfg", "3"],
            "class 10": ["--num", "4", "--classes", "3", "10"],
            "out under a file": ["--num", "4", "--out", blocker / "s.npz"],
            "png out": ["--num", "4", "--out", tmp_path / "s.png"],
            "per-class": ["--num", "4", "--per-class", "2"]}[case]
    argv = ["sample", "--ckpt", str(ckpt), "--sample-steps", "2", "--out", str(out), *map(str, args)]
    listing = sorted(p.name for p in tmp_path.iterdir())
    try:
        rc = main(argv)
    except SystemExit as e:             # argparse
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    want = {"num 0": "argument --num/--num-samples: expected an integer >= 1, got 0",
            "per-batch 0": "argument --per-batch: expected an integer >= 1, got 0",
            "cfg without label dropout": "trained without label dropout (class_dropout 0): it has no null class",
            "class 10": "--classes 10: out of range: this model has classes 0..9",
            "out under a file": "is a file, not a folder",
            "png out": "a sample set (--num) is a .npz",
            "per-class": "--per-class is for the PNG grid"}[case]
    assert want in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == listing and blocker.read_text() == "x"


def test_a_set_from_a_model_without_label_dropout_defaults_to_no_guidance(ckpt, tmp_path, capsys, monkeypatch):
    from autohc.dit.sample import load_model
    from autohc.tune import first_use
    told, expect = [], first_use.expect_calls

    def told_calls(calls):
        told.append(calls)
        return expect(calls)
    monkeypatch.setattr(first_use, "expect_calls", told_calls)
    out = tmp_path / "s.npz"
    assert main(["sample", "--ckpt", str(_no_dropout_ckpt(ckpt, tmp_path / "c.pt")), "--num", "3", "--no-autohc",
                 "--sample-steps", "2", "--classes", "2", "5", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cfg"] == 1.0
    assert set(_load(out)["labels"].tolist()) <= {2, 5}
    # first-use tuning told the set's length: one batch of 2 steps, through each of the model's blocks
    assert told == [2 * len(load_model(ckpt, ema=True)[0].blocks)]


# ------------------------------------------------- kill -9 of one rank under a launcher

# the SLOW set over 2 ranks; --num-samples: torchrun itself takes --num (for --numa-binding)
SLOW_RANKS = ["--num-samples" if a == "--num" else a for a in SLOW]


def _launcher(which):
    if which == "torchrun":
        torchrun = shutil.which("torchrun") or pytest.fail("torchrun not found (it ships with torch)")
        return [torchrun, "--nproc-per-node", "2", "-m", "autohc.cli"], "RANK"
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI is not installed (CI installs it: .ci/run)")
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
            "autohc.cli"], "OMPI_COMM_WORLD_RANK"


def _rank_process(launcher, rank_var: str, rank: int, deadline: float):
    """The worker of `rank` under the launcher: a descendant running autohc.cli sample whose
    environment names it (torchrun's RANK, Open MPI's OMPI_COMM_WORLD_RANK)."""
    while True:
        assert launcher.poll() is None, "the launcher ended before its ranks started"
        assert time.monotonic() < deadline, "no rank processes"
        for c in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "autohc.cli" in c.cmdline() and "sample" in c.cmdline() \
                        and c.environ().get(rank_var) == str(rank):
                    return c
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        time.sleep(0.05)


@pytest.mark.xdist_group("net")
@pytest.mark.parametrize("which, victim", [("torchrun", 1), ("mpirun", 0)])
def test_kill_9_of_one_rank_then_the_same_command_finishes_the_set(which, victim, ckpt, ref, tmp_path):
    """One rank SIGKILLed mid-set: the launcher tears the job down (nonzero, within a bounded
    time, no rank left behind), OUT is not written; the same command again draws the rest and
    gives the one-process set, every index once. (torchrun: rank 1 dies; mpirun: rank 0, which
    also hosts gloo's store.)"""
    launcher, rank_var = _launcher(which)
    out = tmp_path / "s.npz"
    parts = out.with_name("s.npz.parts")
    cmd = [*launcher, "sample", "--ckpt", str(ckpt), *SLOW_RANKS, "--out", str(out), "--json"]
    log = tmp_path / "first.err"
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        rank = _rank_process(p, rank_var, victim, deadline)
        while len(list(parts.glob("batch-*.npz"))) < 2:      # batches 0 and 1: both ranks at work
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no shards written: " + log.read_text()[-3000:]
            time.sleep(0.01)
        ranks = [c for c in psutil.Process(p.pid).children(recursive=True) if "autohc.cli" in c.cmdline()]
        assert len(ranks) == 2 and rank in ranks, ranks
        rank.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        try:
            rc = p.wait(timeout=120)            # the survivor must not hang in a collective
        except subprocess.TimeoutExpired:
            alive = [f"{c.pid} {c.status()}" for c in ranks if c.is_running()]
            pytest.fail(f"{which} still running 120 s after rank {victim} was killed (ranks alive: {alive}): "
                        + log.read_text()[-3000:])
        teardown = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    first = log.read_text()
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks left behind by {which}: {alive}"
    print(f"{which}: exit {rc} {teardown:.1f} s after rank {victim}'s kill -9")
    assert rc != 0 and not out.exists(), first[-3000:]
    if which == "torchrun":     # the survivor noticed (mpirun may kill it before it says so)
        assert f"rank {1 - victim} of 2: sampling failed (another rank died or hung?)" in first, first[-3000:]
    kept = len(list(parts.glob("batch-*.npz")))
    assert 2 <= kept < 8, first[-3000:]

    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"over 2 ranks ({'torchrun' if which == 'torchrun' else 'openmpi'})" in r.stderr
    summary = json.loads(r.stdout)                  # rank 0's; the other rank prints nothing
    assert summary["world"] == 2 and summary["from_shards"] == 2 * kept > 0
    assert summary["drawn"] == 16 - 2 * kept
    _same(_load(out), ref[0])                       # every index once, as the uninterrupted run
    assert not parts.exists()
