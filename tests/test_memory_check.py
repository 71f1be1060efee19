"""`autohc train`'s memory check (autohc/dit/memory_check.py): a run too large for the machine
is refused before its first step, in one line, with a --batch that fits."""
import re

import pytest
import torch

from autohc.cli import main
from autohc.dit import memory_check
from autohc.dit.diffusion import GaussianDiffusion
from autohc.dit.train import build_model
from cli_errors import one_line_exit_2

TRAIN = ["train", "--model", "DiT-Ti/8", "--data", "digits", "--steps", "1", "--no-progress",
         "--samples-per-class", "0", "--no-first-use-tuning", "--threads", "1"]


def test_saved_activations_grow_by_the_same_bytes_with_each_image():
    """The probe counts each saved storage once and leaves the parameters out: its bytes are
    linear in the batch, with nothing saved for a batch of none."""
    torch.manual_seed(0)
    model = build_model({"model": "DiT-Ti/8", "input_size": 8, "in_channels": 1, "num_classes": 10,
                         "class_dropout": 0.1, "learn_sigma": False}).train()
    diffusion = GaussianDiffusion()
    sizes = [memory_check.saved_activation_bytes(model, diffusion, (1, 8, 8), 10, "fp32", b) for b in (1, 2, 3)]
    assert sizes[0] > 0 and sizes[1] - sizes[0] == sizes[2] - sizes[1] > 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes[1] - sizes[0] < params          # (the weights would dwarf one tiny image's activations)


def test_a_run_that_does_not_fit_is_refused_and_the_batch_it_names_fits(tmp_path, capsys, monkeypatch):
    """With room for the model's state and about 20 images, --batch 1000 is one line and exit 2,
    nothing written; the --batch it names passes the same check and trains."""
    real_estimate = memory_check.estimate

    def estimate(trainer):
        monkeypatch.setattr(memory_check, "room", lambda world=1: (0, "none"))
        probe = real_estimate(trainer)
        room = probe.fixed + int(20.5 * probe.per_image * (1 + memory_check.TRANSIENT_SHARE))
        monkeypatch.setattr(memory_check, "room", lambda world=1: (room, "available (test)"))
        return real_estimate(trainer)
    monkeypatch.setattr(memory_check, "estimate", estimate)
    out = tmp_path / "run"
    err = one_line_exit_2(capsys, [*TRAIN, "--batch", "1000", "--out", str(out)], must_not_exist=out)
    assert err.startswith("autohc: --batch 1000 of DiT-Ti/8 needs about") and "available (test)" in err
    assert "--automem file" in err and "--no-memory-check" in err
    fits = int(re.search(r"use --batch (\d+) or less", err).group(1))
    assert fits == 20
    assert main([*TRAIN, "--batch", str(fits), "--out", str(out)]) == 0
    assert (out / "losses.csv").exists()


def test_no_memory_check_and_automem_skip_what_they_skip(tmp_path, capsys, monkeypatch):
    """--no-memory-check starts whatever the room, and the check leaves the run's losses as they
    are; under --automem the activations are not counted (they go to its tier), so only the
    parameters' state must fit."""
    steps = [*TRAIN[:TRAIN.index("--steps")], "--steps", "3", *TRAIN[TRAIN.index("--steps") + 2:]]
    assert main([*steps, "--batch", "8", "--out", str(tmp_path / "checked")]) == 0
    monkeypatch.setattr(memory_check, "room", lambda world=1: (0, "available (test)"))
    out = tmp_path / "a"
    assert main([*steps, "--batch", "8", "--out", str(out), "--no-memory-check"]) == 0
    assert (out / "losses.csv").read_text() == (tmp_path / "checked" / "losses.csv").read_text()
    err = one_line_exit_2(capsys, [*TRAIN, "--batch", "8", "--out", str(tmp_path / "b"), "--automem", "file"],
                          must_not_exist=tmp_path / "b")
    assert "activations" not in err and "--automem" not in err and "--batch 8 or less" not in err


@pytest.mark.parametrize("layout", ["v2", "v2-namespace", "v1", "none"])
def test_the_room_under_a_cgroup_limit(tmp_path, layout):
    """The limit less the usage, the reclaimable page cache counted as room; no limit: None."""
    proc = tmp_path / "cgroup"
    if layout.startswith("v2"):
        proc.write_text("0::/job_42/step_0\n")
        base = tmp_path / "fs" / ("job_42/step_0" if layout == "v2" else "")
        base.mkdir(parents=True, exist_ok=True)
        (base / "memory.max").write_text(f"{8 << 30}\n")
        (base / "memory.current").write_text(f"{5 << 30}\n")
        (base / "memory.stat").write_text(f"anon 123\ninactive_file {1 << 30}\n")
        assert memory_check.cgroup_room(proc, tmp_path / "fs") == 4 << 30
    elif layout == "v1":
        proc.write_text("5:cpu,cpuacct:/\n4:memory:/slurm/uid_0/job_7\n")
        base = tmp_path / "fs" / "memory" / "slurm/uid_0/job_7"
        base.mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text(f"{16 << 30}\n")
        (base / "memory.usage_in_bytes").write_text(f"{4 << 30}\n")
        (base / "memory.stat").write_text(f"total_inactive_file {2 << 30}\n")
        assert memory_check.cgroup_room(proc, tmp_path / "fs") == 14 << 30
    else:
        proc.write_text("4:memory:/\n")
        base = tmp_path / "fs" / "memory"
        base.mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        (base / "memory.usage_in_bytes").write_text(f"{4 << 30}\n")
        assert memory_check.cgroup_room(proc, tmp_path / "fs") is None


def test_ranks_on_this_node_from_each_launcher():
    """The room is shared by the job's ranks on the node; a job of one process has it alone
    (a Slurm allocation's other tasks need not be this job's)."""
    assert memory_check.local_ranks(8, {}) == 1
    assert memory_check.local_ranks(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert memory_check.local_ranks(8, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert memory_check.local_ranks(24, {"SLURM_NTASKS_PER_NODE": "8(x3)"}) == 8
    assert memory_check.local_ranks(1, {"SLURM_NTASKS_PER_NODE": "8"}) == 1
    assert memory_check.local_ranks(2, {"LOCAL_WORLD_SIZE": "4"}) == 2


def test_automem_tiers_count_what_stays_in_memory(tmp_path):
    """Saved activations sent to files are not counted, float32 ones sent to bf16 copies at half
    (an fp32 run's are float32), another NUMA node's memory in full (the same machine's)."""
    from autohc.dit.train import TrainConfig, Trainer

    def estimate(automem):
        cfg = TrainConfig(model="DiT-Ti/8", data="digits", steps=1, batch=8, out=str(tmp_path / "x"),
                          precision="fp32", automem=automem)
        return memory_check.estimate(Trainer(cfg))
    plain, half, none = estimate(None), estimate("bf16"), estimate("file")
    assert plain.per_image > 0 and none.per_image == 0 and none.activations == 0
    assert 0.45 * plain.per_image < half.per_image < 0.55 * plain.per_image     # (int and bool ones in full)
    assert plain.state == half.state == none.state


ONE_RANK_SHORT = """
import os, sys
from autohc.cli import main
from autohc.dit import memory_check
real = memory_check.room
if os.environ["RANK"] == "1":       # this rank's node has no room
    memory_check.room = lambda world=1: (0, "available (test)")
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.xdist_group("net")     # torchrun's default port (tests/test_dist.py)
def test_one_rank_without_room_stops_every_rank_before_the_first_step(tmp_path):
    """Under torchrun, a rank whose node has too little memory says so, the other says why it
    stops too, and neither starts: exit 2, no --out made."""
    import os
    import shutil
    import subprocess
    import sys
    script = tmp_path / "one_rank_short.py"
    script.write_text(ONE_RANK_SHORT)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([shutil.which("torchrun") or pytest.fail("torchrun not found"), "--nproc-per-node", "2",
                        str(script), *TRAIN, "--batch", "8", "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode != 0
    assert r.stderr.count("autohc: --batch 8 of DiT-Ti/8 needs about") == 1, r.stderr[-3000:]
    assert "autohc: rank 0: another rank has too little memory for this run" in r.stderr
    assert "exitcode  : 2" in r.stderr or "exit code 2" in r.stderr or "(exitcode: 2)" in r.stderr, r.stderr[-3000:]
    assert not out.exists()
