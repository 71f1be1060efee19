"""A training run on a batch cluster: stop signals (SIGTERM, the job's own signal, a second one),
the ranks agreeing on the stop step, --requeue, resume without a flag change (--resume auto),
elastic restarts (torchrun --max-restarts), checkpoints that cannot be written. Real processes:
the tiny DiT-Ti/8 on digits, fp32, one thread a rank."""
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from autohc.dit import checkpoint
from autohc.runtime import preempt

# launches take torchrun's default port: with the other launches on one xdist worker
pytestmark = pytest.mark.xdist_group("net")

STEPS, CKPT = 30, 10      # a stop lands after the checkpoint of step CKPT and before step STEPS
BASE = ["-m", "autohc.cli", "train", "--model", "DiT-Ti/8", "--data", "digits", "--batch", "16",
        "--threads", "1", "--no-progress", "--samples-per-class", "0", "--no-first-use-tuning"]
TRAIN = [*BASE, "--steps", str(STEPS), "--ckpt-every", str(CKPT)]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(extra)
    return env


def _torchrun(*more):
    exe = shutil.which("torchrun") or pytest.fail("torchrun not found (it ships with torch)")
    return [exe, "--nproc-per-node", "2", *more]


def _mpirun():
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.skip("Open MPI is not installed (CI installs it: .ci/run)")
    pytest.importorskip("mpi4py")
    return [exe, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable]


def _run(cmd, out, env=None, **kw):
    return subprocess.run([*cmd, *TRAIN, "--out", str(out)], env=env or _env(), capture_output=True,
                          text=True, timeout=600, **kw)


def _final(out):
    return checkpoint.load(checkpoint.path_for(out, STEPS))


def _same_weights(a, b):
    for what in ("model", "ema"):
        for k in a[what]:
            assert torch.equal(a[what][k], b[what][k]), (what, k)
    assert a["losses"] == b["losses"]


def _start_then(cmd, out, env=None, after_step=CKPT, extra=()):
    """Start a training run (its own session, as a batch job's step) and return it once it
    has written the checkpoint of `after_step`: from then on it is mid-run."""
    p = subprocess.Popen([*cmd, *TRAIN, *extra, "--out", str(out)], env=env or _env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not checkpoint.path_for(out, after_step).exists():
        if p.poll() is not None or time.time() > deadline:
            p.kill()
            pytest.fail(f"the run ended or hung before step {after_step}: {p.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return p


def _ranks(p):
    """The training processes under a launcher (not the launcher itself)."""
    me = psutil.Process(p.pid)
    return [c for c in me.children(recursive=True) if "autohc.cli" in " ".join(c.cmdline())]


def _stopped_at(stderr: str, world: int) -> int:
    """The step every rank says it stopped at (all the same), from the run's log."""
    steps = []
    for line in stderr.splitlines():
        if line.startswith("autohc train: SIG") and " at step " in line:
            steps.append(int(line.split(" at step ")[1].split(":")[0]))
        elif line.startswith("autohc train: rank ") and "stopped at step" in line:
            steps.append(int(line.split("stopped at step ")[1].split()[0]))
    assert len(steps) == world and len(set(steps)) == 1, (steps, stderr[-3000:])
    return steps[0]


def _check_stop(out, stderr, world):
    """One checkpoint written at the stop step, after the last periodic one."""
    step = _stopped_at(stderr, world)
    assert CKPT < step < STEPS
    steps = [s for s, _ in checkpoint.listing(out)]
    assert steps[-1] == step and [s for s in steps if s > CKPT] == [step], steps
    assert checkpoint.load(checkpoint.path_for(out, step))["step"] == step
    assert f"stopped after writing {checkpoint.path_for(out, step)}" in stderr
    assert not list(out.glob(".ckpt-*"))
    return step


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    r = _run([sys.executable], out)
    assert r.returncode == 0, r.stderr[-3000:]
    return _final(out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two") / "run"
    r = _run(_torchrun(), out)
    assert r.returncode == 0, r.stderr[-3000:]
    return _final(out)


# ----------------------------------------------------------------------- the signal module

def test_parse_signal_names_and_numbers():
    assert preempt.parse_signal("USR1") == preempt.parse_signal("sigusr1") == signal.SIGUSR1
    assert preempt.parse_signal("15") == signal.SIGTERM
    with pytest.raises(ValueError, match="not a signal name or number"):
        preempt.parse_signal("USR9")


def test_first_signal_is_a_request_the_same_one_twice_is_not_a_second():
    with preempt.StopSignals([signal.SIGTERM, signal.SIGUSR1], grace_s=60) as stop:
        assert not stop and stop.requested is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)        # within the grace: Slurm and torchrun both told us
        assert stop.requested == "SIGUSR1" and stop.requested_signal == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL     # restored


SECOND_SIGNAL = """
import os, signal, sys, time
from pathlib import Path
from autohc.runtime import preempt
half = Path(sys.argv[1])
with preempt.StopSignals([signal.SIGTERM], grace_s=0.2) as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == "SIGTERM"
    with preempt.writing(half):
        half.write_bytes(b"half a checkpoint")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)        # after the grace: at once
        time.sleep(5)
print("not reached")
"""


def test_a_second_signal_exits_at_once_removing_the_half_written_file(tmp_path):
    script, half = tmp_path / "second.py", tmp_path / ".ckpt-00000009.pt.tmp-1"
    script.write_text(SECOND_SIGNAL)
    r = subprocess.run([sys.executable, str(script), str(half)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert "SIGTERM again: exiting at once" in r.stderr and "not reached" not in r.stdout
    assert not half.exists()


# ----------------------------------------------------------------------- stop and continue

def test_sigterm_stops_one_process_with_a_checkpoint_and_the_same_command_continues(single, tmp_path):
    out = tmp_path / "run"
    p = _start_then([sys.executable], out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == preempt.EXIT_PREEMPTED, err[-3000:]
    _check_stop(out, err, world=1)
    r = _run([sys.executable], out)                 # the same command: --resume auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr
    _same_weights(_final(out), single)              # bit for bit


@pytest.mark.parametrize("sig,own,requeued", [(signal.SIGUSR1, [], True),
                                              (signal.SIGUSR2, ["--stop-signal", "USR2"], True),
                                              (signal.SIGTERM, [], False)], ids=["USR1", "USR2", "TERM"])
def test_stop_signal_with_requeue_asks_slurm_to_requeue(tmp_path, sig, own, requeued):
    """--requeue on the job's own signal (USR1 by default, or --stop-signal's); SIGTERM
    (scancel, a time limit) only stops."""
    out, bin_dir, record = tmp_path / "run", tmp_path / "bin", tmp_path / "scontrol.args"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"                     # a stand-in that records what it was asked
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    fake.chmod(0o755)
    env = _env(SLURM_JOB_ID="4242", PATH=f"{bin_dir}:{os.environ['PATH']}")
    p = _start_then([sys.executable], out, env=env, extra=["--requeue", *own])
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == preempt.EXIT_PREEMPTED, err[-3000:]
    _check_stop(out, err, world=1)
    if requeued:
        assert record.read_text().split() == ["requeue", "4242"] and "requeued Slurm job 4242" in err
    else:
        assert not record.exists()


def test_sigterm_to_two_ranks_under_torchrun(two_ranks, tmp_path):
    out = tmp_path / "run"
    p = _start_then(_torchrun(), out)
    os.killpg(p.pid, signal.SIGTERM)                # as Slurm does: every process of the step
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0                        # torchrun's own code for a signal (1)
    assert err.count(f"(exit {preempt.EXIT_PREEMPTED})") == 2, err[-3000:]
    _check_stop(out, err, world=2)
    r = _run(_torchrun(), out)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_weights(_final(out), two_ranks)


def test_sigterm_to_two_ranks_under_mpirun(two_ranks, tmp_path):
    out = tmp_path / "run"
    mpirun = _mpirun()
    p = _start_then(mpirun, out)
    ranks = _ranks(p)
    assert len(ranks) == 2
    for r in ranks:                                 # the tasks, as srun signals them
        r.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == preempt.EXIT_PREEMPTED, err[-3000:]     # mpirun passes the ranks' code on
    _check_stop(out, err, world=2)
    r = _run(mpirun, out)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_weights(_final(out), two_ranks)           # MPI's and gloo's two-rank sums are the same


def test_torchrun_max_restarts_continues_after_a_rank_is_killed(two_ranks, tmp_path):
    out = tmp_path / "run"
    p = _start_then(_torchrun("--max-restarts", "1"), out)
    victim = _ranks(p)[-1]
    victim.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "resuming from" in err
    _same_weights(_final(out), two_ranks)


# ----------------------------------------------------------------------- resume, disks

def test_another_configuration_in_out_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, *BASE, "--steps", "3", "--ckpt-every", "3", "--out", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    before = sorted(p.name for p in out.iterdir())
    r = subprocess.run([sys.executable, *TRAIN, "--out", str(out), "--lr", "3e-4", "--batch", "8"],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("autohc: --resume auto: ") and "Traceback" not in r.stderr
    assert "--batch 16 (this command: 8)" in lines[-1] and "--lr 0.001 (this command: 0.0003)" in lines[-1]
    r = subprocess.run([sys.executable, *TRAIN, "--out", str(out), "--resume", "never"],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--resume never:" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def _file_size_limit(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_previous(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, *BASE, "--steps", str(CKPT), "--ckpt-every", str(CKPT), "--out", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    size = checkpoint.path_for(out, CKPT).stat().st_size
    # the next checkpoint may not exceed half of one (the losses.csv and logs stay far below)
    r = subprocess.run([sys.executable, *TRAIN, "--out", str(out)], env=_env(), capture_output=True,
                       text=True, timeout=600, preexec_fn=_file_size_limit(size // 2))
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"autohc: cannot write checkpoint {checkpoint.path_for(out, 2 * CKPT)}: File too large "
                           "(needs about "), last
    assert "free there); the previous checkpoint" in last and "Traceback" not in r.stderr
    assert [s for s, _ in checkpoint.listing(out)] == [CKPT]
    assert checkpoint.load(checkpoint.path_for(out, CKPT))["step"] == CKPT
    assert not list(out.glob(".ckpt-*"))            # no partial file


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    state = {"format": "autohc-dit-1", "w": torch.zeros(1000)}
    checkpoint.save(state, tmp_path, 1)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 100)
    with pytest.raises(checkpoint.WriteError, match=r"ckpt-00000002.pt: not enough free space \(needs about "
                                                    r"0.0 MB, 0.0 MB free there\); the previous checkpoint"):
        checkpoint.save(state, tmp_path, 2)
    assert [s for s, _ in checkpoint.listing(tmp_path)] == [1] and len(list(tmp_path.iterdir())) == 1


def test_on_ckpt_error_warn_trains_on_and_the_last_must_be_written(tmp_path, monkeypatch, capsys):
    from autohc.dit.train import TrainConfig, Trainer
    real, calls, failing = checkpoint.save, [], {3}

    def flaky(state, folder, step, keep=3):
        calls.append(step)
        if step in failing:
            raise checkpoint.WriteError(f"cannot write checkpoint {checkpoint.path_for(folder, step)}: "
                                        "No space left on device")
        return real(state, folder, step, keep)

    monkeypatch.setattr(checkpoint, "save", flaky)
    cfg = dict(model="DiT-Ti/8", data="digits", batch=8, out=str(tmp_path), ckpt_every=3)
    r = Trainer(TrainConfig(steps=6, on_ckpt_error="warn", **cfg)).run(progress=False)
    assert r["steps"] == 6 and calls == [3, 6] and r["stopped_by"] is None
    assert "training goes on (--on-ckpt-error warn)" in capsys.readouterr().err
    assert [s for s, _ in checkpoint.listing(tmp_path)] == [6]
    failing.update({9, 10})
    stop = Trainer(TrainConfig(steps=12, on_ckpt_error="stop", extra={"resume": "auto"}, **cfg))
    with pytest.raises(checkpoint.WriteError):              # the default: stop at the first
        stop.run(progress=False)
    assert stop.step == 9
    warn = Trainer(TrainConfig(steps=10, on_ckpt_error="warn", extra={"resume": "auto"}, **cfg))
    with pytest.raises(checkpoint.WriteError):              # warn, but the last one failed
        warn.run(progress=False)
    assert warn.step == 10 and [s for s, _ in checkpoint.listing(tmp_path)] == [6]
