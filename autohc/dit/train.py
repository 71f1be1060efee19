"""The DiT training loop behind `autohc train`.

One step: a batch from the data stream, timesteps and noise from the trainer's own generator,
epsilon-MSE loss, backward, AdamW (autohc's fused one, or torch's with --no-autohc), EMA.
Everything a step draws from is in the checkpoint (weights, EMA, optimizer, both RNG states,
data position, the losses so far), so --resume continues bit-identically on the same machine
and kernels. Data parallel (world > 1, runtime/dist.py): `batch` is the global batch; every
rank draws the whole batch's timesteps, noise and label-dropout draws and takes its slice, the
model is wrapped in DistributedDataParallel (gradients all-reduced in buckets during backward,
on the communication thread of runtime.dist.CommHook unless comm="gloo"), and the logged loss
is the mean over ranks, so w ranks reproduce one process on the same global batch up to
float32 reduction order. Only rank 0 writes checkpoints, logs and plots.

A batch system's stop signal (SIGTERM, and the job's own, default SIGUSR1: runtime/preempt.py)
ends the run at the next step boundary: every rank's flag travels with the loss's all-reduce,
so all ranks stop after the same step; one checkpoint is written and run() returns with
"stopped_by" set. A resume (`resume` "auto", the command line's default) continues from the
newest checkpoint in `out` only when it was trained with the same settings (RESUME_KEYS).
"""
from __future__ import annotations

import contextlib
import copy
import csv
import math
import os
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checkpoint, data as datalib, precision
from .diffusion import GaussianDiffusion
from .model import DiT, config as model_config
from ..runtime import memory, preempt

# the settings a resumed run must share with the run in --out (the rest, e.g. --steps,
# --ckpt-every, --threads, the number of ranks, may change between the two)
RESUME_KEYS = ("model", "data", "batch", "lr", "weight_decay", "ema", "seed", "class_dropout",
               "learn_sigma", "precision", "image_size", "channels")


class ResumeError(datalib.InputError):
    """--out holds a run this command cannot continue (another setup, or not empty for
    --resume never): one line, exit code 2, nothing written."""


@dataclass
class TrainConfig:
    model: str = "DiT-S/2"
    data: str = "digits"
    steps: int = 1000
    batch: int = 64
    out: str = "runs/dit"
    lr: float = 1e-4
    weight_decay: float = 0.0
    ema: float = 0.9999
    ckpt_every: int = 500
    keep: int = 3
    seed: int = 0
    autohc: bool = True
    threads: int | None = None
    image_size: int | None = None       # synthetic size / folder resize
    channels: int = 3                   # synthetic
    class_dropout: float = 0.1
    learn_sigma: bool = False
    sample_steps: int = 50
    cfg: float = 4.0
    rank: int = 0
    world: int = 1
    comm: str = "thread"                # data parallel: "thread" (CommHook) or "gloo" (DDP's own)
    log_every: int = 50                 # without a terminal: a log line every N steps (rank 0)
    automem: str | None = None          # AutoMem tier for saved activations: file, file:DIR, bf16
    cftp: int | None = None             # CFTP thread clusters (0: one per NUMA node); None: off
    automem_state: bool = False         # AutoMem also for the optimizer state, between steps
    init: str | None = None             # start from these weights (autohc, facebookresearch/DiT, diffusers)
    precision: str = "fp32"             # fp32, bf16 (autocast, fp32 master weights) or auto (dit/precision.py)
    stop_signal: int | None = int(signal.SIGUSR1)    # caught besides SIGTERM: stop at the step's end
    requeue: bool = False               # on stop_signal: also `scontrol requeue` the Slurm job
    on_ckpt_error: str = "stop"         # a checkpoint that cannot be written: stop (exit 2) or warn
    extra: dict = field(default_factory=dict)


def build_model(cfg: dict, fused_ops=None) -> DiT:
    """The model a checkpoint's "arch" describes, its blocks on `fused_ops` (autohc.ops) if given."""
    c = model_config(cfg["model"])
    return DiT(input_size=cfg["input_size"], patch_size=c.patch, in_channels=cfg["in_channels"],
               hidden_size=c.hidden, depth=c.depth, num_heads=c.heads, num_classes=cfg["num_classes"],
               class_dropout_prob=cfg["class_dropout"], learn_sigma=cfg["learn_sigma"]).use_fused_ops(fused_ops)


def autohc_ops(use_autohc: bool):
    """autohc's fused operators for a run on autohc, else None (plain torch)."""
    if not use_autohc:
        return None
    from ..torch.ops import FUSED
    return FUSED


def ema_decay(decay: float, step: int) -> float:
    """The EMA's decay at step n: the usual warm-up min(decay, (1 + n) / (10 + n)) so that short
    runs have a useful average; at n -> inf it is the reference's plain `decay`."""
    return min(decay, (1 + step) / (10 + step))


def ema_pairs(ema: torch.nn.Module, model: torch.nn.Module):
    """(parameter, its EMA) of every trained parameter."""
    return [(p, e) for e, p in zip(ema.parameters(), model.parameters()) if p.requires_grad]


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float, step: int) -> None:
    """The EMA step as the reference's update_ema: one mul_ and add_ per parameter."""
    d = ema_decay(decay, step)
    for e, p in zip(ema.parameters(), model.parameters()):
        if p.requires_grad:
            e.mul_(d).add_(p.detach(), alpha=1 - d)


def make_optimizer(params, *, lr: float, weight_decay: float, use_autohc: bool, bf16: bool = False):
    """autohc's fused AdamW, or torch's default one (foreach) as a stock script has it. bf16 (a
    bf16 run on a CPU whose bf16 GEMMs autohc serves): autohc's keeps bf16 working copies of the
    weights, written in its pass, that autocast's Linears read (torch/optim.py)."""
    if use_autohc:
        from ..torch import served
        from ..torch.optim import AdamW
        opt = AdamW(params, lr=lr, weight_decay=weight_decay)
        if bf16 and served.bf16_served():
            opt.keep_bf16_copies()
        return opt
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB -> GiB (Linux)


class Trainer:
    def __init__(self, cfg: TrainConfig, dataset: datalib.Dataset | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        if cfg.steps < 1 or cfg.batch < 1 or cfg.ckpt_every < 1:
            raise ValueError("steps, batch and ckpt_every must be >= 1")
        if cfg.on_ckpt_error not in ("stop", "warn"):
            raise ValueError(f"on_ckpt_error must be 'stop' or 'warn', got {cfg.on_ckpt_error!r}")
        resumed = self._find_resume(cfg)
        self.data = dataset or datalib.load(cfg.data, image_size=cfg.image_size,
                                            channels=cfg.channels, seed=cfg.seed)
        init = self._read_init(cfg, resumed)
        if cfg.model is None:           # --init or --resume without --model: theirs
            cfg.model = init.arch["model"] if init else resumed[1]["arch"]["model"] if resumed else "DiT-Ti/2"
        C, H, _ = self.data.shape
        self.arch = {"model": cfg.model, "input_size": H, "in_channels": C,
                     "num_classes": self.data.num_classes, "class_dropout": cfg.class_dropout,
                     "learn_sigma": init.arch["learn_sigma"] if init else cfg.learn_sigma,
                     "images": self.data.images, "data": self.data.name}
        if self.data.latent is not None:
            self.arch["latent"] = self.data.latent
        if init:
            self._check_init(init)
        if resumed:
            old = resumed[1]["arch"]
            diff = {k: (old.get(k), v) for k, v in self.arch.items() if old.get(k) != v}
            if diff:
                raise ResumeError(f"--resume: {resumed[0]} was trained with a different setup: "
                                  + ", ".join(f"{k} {a!r} (now {b!r})" for k, (a, b) in diff.items())
                                  + "; pass the same settings to continue it, or another --out")
        self.precision, self.precision_why = precision.resolve(cfg.precision)
        torch.manual_seed(cfg.seed)
        # the fused operators in both precisions (their bf16 forms under autocast)
        self.model = build_model(self.arch, autohc_ops(cfg.autohc))
        ema_weights = self._load_init(init) if init else None
        if cfg.autohc:                  # the large weights in transparent huge pages
            memory.parameters_to_huge_pages(self.model)
        self.ema = copy.deepcopy(self.model).requires_grad_(False).eval()
        if ema_weights is not None:
            self.ema.load_state_dict(ema_weights)
        self.opt = make_optimizer([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, use_autohc=cfg.autohc,
                                  bf16=self.precision == "bf16")
        # autohc's AdamW updates the EMA in its own pass over the weights (torch/optim.py)
        self.fused_ema = hasattr(self.opt, "attach_ema")
        if self.fused_ema:
            self.opt.attach_ema(ema_pairs(self.ema, self.model))
        self.diffusion = GaussianDiffusion()
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)     # timesteps and noise
        self.batches = datalib.Batches(self.data, cfg.batch, seed=cfg.seed, rank=cfg.rank, world=cfg.world)
        self.step, self.losses = 0, []
        if resumed:
            self._restore(resumed[1])
            self.resumed_from = resumed[0]
        else:
            self.resumed_from = None
        self.flops_per_step = 3 * cfg.batch * self.model.flops_per_image()
        self.forward, self.comm_hook, self.automem = self.model, None, None
        if cfg.automem:
            from ..runtime.automem import AutoMem
            from ..runtime.tiers import make_tier
            self.automem = AutoMem(make_tier(cfg.automem), self.model)
        self.state_offload = None
        if cfg.automem_state:
            if not cfg.automem:
                raise ValueError("--automem-state needs --automem TIER (the tier the state goes to)")
            from ..runtime.automem import StateOffload
            from ..runtime.tiers import make_tier
            self.state_offload = StateOffload(self.opt, make_tier(cfg.automem))
        self.cftp_clusters = None
        if cfg.cftp is not None:
            self._cftp(cfg.cftp)
        if cfg.world > 1:
            self._data_parallel()
        self.stop: preempt.StopSignals | None = None     # run()'s, or the caller's (set before run)
        self.stopping: dict[str, bool] = {}     # after a step: which kind of signal any rank caught

    # ---------------------------------------------------------------- resume
    def _find_resume(self, cfg: TrainConfig):
        """(path, state) of the checkpoint to continue, or None for a fresh start.

        extra["resume"]: "auto" (or True): the newest loadable checkpoint in out, if its
        settings match; "never": a fresh run, only into an empty or missing folder; unset:
        a fresh run, refused where out holds checkpoints (the library's default)."""
        mode = cfg.extra.get("resume")
        mode = {True: "auto", False: None}.get(mode, mode)
        if mode not in (None, "auto", "never"):
            raise ValueError(f"resume must be 'auto' or 'never', got {mode!r}")
        if mode == "never":
            if self.out.is_dir() and any(self.out.iterdir()):
                raise ResumeError(f"--resume never: {self.out} is not empty: pass a new or empty --out "
                                  "(or --resume auto to continue the run there)")
            return None
        if mode is None:
            if checkpoint.listing(self.out):
                raise ValueError(f"{self.out} holds checkpoints of an earlier run: pass --resume to continue "
                                 "it, or another --out")
            return None
        had = checkpoint.listing(self.out)
        resumed = checkpoint.latest(self.out)
        if resumed is None:
            if had:
                print(f"autohc: no loadable checkpoint in {self.out}; starting from step 0", file=sys.stderr)
            return None
        old = dict(resumed[1].get("config", {}))
        mine = asdict(cfg)
        if old and "precision" not in old:      # a checkpoint from before --precision: fp32 ran
            old["precision"] = "fp32"
        if "precision" in old:          # what ran there against what would run here: auto may be either
            old["precision"] = resumed[1].get("precision") or precision.resolve(old["precision"])[0]
            mine["precision"] = precision.resolve(mine["precision"])[0]
        diff = [k for k in RESUME_KEYS if k in old and mine[k] is not None and old[k] != mine[k]]
        if diff:
            def now(k):                 # --precision auto: what it resolved to, and that it was auto
                return (f"{mine[k]!r} from --precision {cfg.precision}"
                        if k == "precision" and cfg.precision != mine[k] else repr(mine[k]))
            raise ResumeError(f"--resume auto: {resumed[0]} was trained with "
                              + ", ".join(f"--{k.replace('_', '-')} {old[k]!r} (this command: {now(k)})"
                                          for k in diff)
                              + "; pass the same settings to continue it, or another --out")
        return resumed

    # ------------------------------------------------------------------ --init
    def _read_init(self, cfg: TrainConfig, resumed):
        if not cfg.init:
            return None
        if resumed:
            print(f"autohc: resuming {self.out}; --init {cfg.init} is not read again", file=sys.stderr)
            return None
        from . import convert
        init = convert.read(cfg.init)
        if cfg.model is not None and cfg.model != init.arch["model"]:
            raise convert.CheckpointError(f"--init {cfg.init}: a {init.arch['model']} checkpoint, "
                                          f"not the --model {cfg.model} asked for")
        return init

    def _check_init(self, init) -> None:
        from . import convert
        a, b = init.arch, self.arch
        if (a["in_channels"], a["input_size"]) != (b["in_channels"], b["input_size"]):
            raise convert.CheckpointError(
                f"--init {self.cfg.init}: a {a['model']} for {a['in_channels']} x {a['input_size']} x "
                f"{a['input_size']} inputs; the data is {b['in_channels']} x {b['input_size']} x {b['input_size']}")
        convert.warn(init.notes)

    def _load_init(self, init) -> dict:
        """The init's weights into the model (its label table re-initialised when the data has
        other classes); returns the EMA's weights to start from."""
        from . import convert
        table = "y_embedder.embedding_table.weight"
        fresh = self.model.state_dict()[table]
        sds = [dict(init.model), dict(init.best)]
        if sds[0][table].shape != fresh.shape:
            print(f"autohc: --init {self.cfg.init}: {init.arch['num_classes']} classes there, "
                  f"{self.arch['num_classes']} in the data: the label table is re-initialised", file=sys.stderr)
            for sd in sds:
                sd[table] = fresh.clone()
        want = {k: v.shape for k, v in self.model.state_dict().items()}
        for what, sd in zip(("model", "EMA"), sds):
            bad = sorted(set(want) ^ set(sd)) or [k for k in want if sd[k].shape != want[k]]
            if bad:
                raise convert.CheckpointError(f"--init {self.cfg.init}: its {what} weights do not fit "
                                              f"{self.arch['model']} (first mismatch: {bad[0]})")
        self.model.load_state_dict(sds[0], strict=True)
        print(f"autohc: starting from {init.source} ({init.arch['model']}, step {init.step})", file=sys.stderr)
        return sds[1]

    def _cftp(self, clusters: int) -> None:
        """Every GEMM's N split across the thread clusters; weights (and, after the first step,
        the AdamW moments) first-touched by the cluster that owns their rows."""
        from ..runtime import cftp
        from ..torch.threads import kernel_threads
        if not self.cfg.autohc:
            raise ValueError("--cftp needs autohc's kernels (drop --no-autohc)")
        n = clusters or cftp.default_clusters()
        cftp.enable(n, kernel_threads())
        cftp.first_touch(self.model, self.opt, n)
        self.cftp_clusters, self._moments_homed = n, bool(self.opt.state)

    def _data_parallel(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from ..runtime import dist
        if self.cfg.comm not in ("thread", "gloo"):
            raise ValueError(f"comm must be 'thread' or 'gloo', got {self.cfg.comm!r}")
        self.forward = DDP(self.model)
        if self.cfg.comm == "thread":
            self.comm_hook = dist.CommHook(use_mpi=dist.comm_over_mpi())
            self.forward.register_comm_hook(None, self.comm_hook.hook)

    def end_data_parallel(self) -> None:
        """After the last step, on every rank: wait for the others, drop the DDP wrapper (its
        reducer's threads) and then the process group, in that order: a process group torn
        down under a live reducer aborts the process ("terminate called without an active
        exception"). The model, EMA and checkpoints stay usable (rank 0 samples after this)."""
        if self.cfg.world == 1:
            return
        import gc
        from ..runtime import dist
        dist.average(0.0)
        if self.comm_hook is not None:
            self.comm_hook.close()
        self.forward = self.model
        gc.collect()
        dist.shutdown()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"format": "autohc-dit-1", "arch": self.arch, "config": asdict(self.cfg),
                "precision": self.precision,      # what ran (config says what was asked: auto)
                "step": self.step, "model": self.model.state_dict(), "ema": self.ema.state_dict(),
                "opt": self.opt.state_dict(), "rng_global": torch.get_rng_state(),
                "rng_trainer": self.gen.get_state(), "data": self.batches.state_dict(),
                "losses": list(self.losses)}

    def _restore(self, s: dict) -> None:
        self.model.load_state_dict(s["model"])
        self.ema.load_state_dict(s["ema"])
        self.opt.load_state_dict(s["opt"])
        torch.set_rng_state(s["rng_global"])
        self.gen.set_state(s["rng_trainer"])
        self.batches.load_state_dict(s["data"])
        self.step, self.losses = int(s["step"]), list(s["losses"])

    def save(self) -> Path | None:
        if self.cfg.rank != 0:
            return None
        if self.state_offload is not None:      # the moments belong in the checkpoint
            self.state_offload.restore()
        p = checkpoint.save(self.state_dict(), self.out, self.step, self.cfg.keep)
        self.write_losses()
        return p

    def write_losses(self) -> None:
        tmp = self.out / ".losses.csv.tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss"])
            w.writerows((i + 1, repr(v)) for i, v in enumerate(self.losses))
        os.replace(tmp, self.out / "losses.csv")

    # ------------------------------------------------------------------ step
    def train_step(self) -> float:
        self.model.train()
        x, y = self.batches.next()                      # this rank's slice of the global batch
        B, share = self.cfg.batch, x.shape[0]
        mine = slice(self.cfg.rank * share, (self.cfg.rank + 1) * share)
        # the whole batch's draws on every rank, this rank's slice used: the same numbers as
        # one process on batch B, whatever the world size
        t = torch.randint(0, self.diffusion.num_timesteps, (B,), generator=self.gen)[mine]
        noise = torch.randn((B, *x.shape[1:]), generator=self.gen)[mine]
        draws = torch.rand(B)[mine] if self.cfg.class_dropout > 0 else None
        with self.automem if self.automem is not None else contextlib.nullcontext():
            with precision.autocast(self.precision):    # bf16: the forward only, as torch advises
                loss = self.diffusion.training_loss(self.forward, x, t, y, noise, drop_draws=draws)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()                     # (the moments start back mid-backward)
        if self.state_offload is not None:
            self.state_offload.restore()
        if self.fused_ema:              # AdamW and the EMA in one pass
            self.opt.step(ema_decay=ema_decay(self.cfg.ema, self.step))
        else:
            self.opt.step()
            ema_update(self.ema, self.model, self.cfg.ema, self.step)
        if self.state_offload is not None:
            self.state_offload.offload()
        if self.cftp_clusters and not self._moments_homed:     # the moments exist from now on
            from ..runtime import cftp
            cftp.first_touch(self.model, self.opt, self.cftp_clusters)
            self._moments_homed = True
        self.step += 1
        value = loss.item()
        caught = self._caught()
        if self.cfg.world > 1:          # the stop flags travel with the loss: all ranks agree
            from ..runtime import dist
            value, *caught = dist.average_with_flags(value, caught)
        self.stopping = {"term": bool(caught[0]), "own": bool(caught[1])} if any(caught) else {}
        if not math.isfinite(value):
            raise FloatingPointError(f"loss is {value} at step {self.step}; lower --lr")
        self.losses.append(value)
        return value

    def _caught(self) -> list[bool]:
        """[SIGTERM-like caught, the job's own stop signal caught] on this rank."""
        sig = self.stop.requested_signal if self.stop is not None else None
        own = sig is not None and sig == self.cfg.stop_signal and sig != signal.SIGTERM
        return [sig is not None and not own, own]

    def checkpoint_everywhere(self, last: bool) -> Path | None:
        """Rank 0 writes a checkpoint; with several ranks every rank then waits for it (no rank
        exits before it is on disk) and learns whether it failed. A failure raises
        checkpoint.WriteError unless on_ckpt_error is "warn" and the run goes on after it."""
        err, path = None, None
        if self.cfg.rank == 0:
            try:
                path = self.save()
            except checkpoint.WriteError as e:
                err = e
        failed = err is not None
        if self.cfg.world > 1:
            from ..runtime import dist
            failed = dist.average(float(failed)) > 0
        if failed:
            if self.cfg.on_ckpt_error == "warn" and not last:
                if err is not None:
                    print(f"autohc: warning: {err}; training goes on (--on-ckpt-error warn)",
                          file=sys.stderr, flush=True)
                return None
            raise err or checkpoint.WriteError(f"rank 0 could not write the checkpoint of step {self.step} "
                                               "(its log says why)")
        return path

    def run(self, progress: bool = True) -> dict:
        """Train to cfg.steps, or to the step at which a stop signal came (summary "stopped_by":
        the signal, "checkpoint": what was written); returns a summary (steps, seconds,
        images/s, GFLOP/s, peak RSS)."""
        if self.stop is None:
            with preempt.StopSignals(preempt.stop_signals(self.cfg.stop_signal)) as self.stop:
                try:
                    return self._run(progress)
                finally:
                    self.stop = None
        return self._run(progress)

    def _run(self, progress: bool) -> dict:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        cfg, start = self.cfg, self.step
        if self.cfg.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        cols = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}")]
        t0, smooth = time.perf_counter(), None
        # the bar on stderr: stdout is the summary (--json)
        # a terminal gets a bar; a batch job's log file gets a plain line every log_every steps
        tty = sys.stderr.isatty()
        with Progress(*cols, disable=not progress or cfg.rank != 0 or not tty, transient=False,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("train", total=cfg.steps, completed=start, stats="")
            while self.step < cfg.steps:
                loss = self.train_step()
                smooth = loss if smooth is None else 0.98 * smooth + 0.02 * loss
                dt = time.perf_counter() - t0
                n = self.step - start
                stats = (f"loss {smooth:.4f} · {n / dt:.2f} it/s · {n * cfg.batch / dt:.1f} img/s · "
                         f"{n * self.flops_per_step / dt / 1e9:.0f} GFLOP/s · RSS {peak_rss_gb():.2f} GB")
                bar.update(task, completed=self.step, stats=stats)
                if progress and not tty and cfg.rank == 0 and (
                        self.step % max(1, cfg.log_every) == 0 or self.step == cfg.steps):
                    print(f"autohc train: step {self.step}/{cfg.steps} · {stats}", file=sys.stderr, flush=True)
                if self.stopping or self.step % cfg.ckpt_every == 0 or self.step == cfg.steps:
                    written = self.checkpoint_everywhere(last=bool(self.stopping) or self.step == cfg.steps)
                if self.stopping:
                    break
        dt = time.perf_counter() - t0
        n = self.step - start
        stopped = None
        if self.stopping:
            mine = self.stop.requested if self.stop is not None else None
            stopped = {"signal": mine or "a stop signal on another rank",
                       "requeue": self.stopping["own"] and cfg.requeue,
                       "checkpoint": str(written) if written else None}
        return {"steps": self.step, "new_steps": n, "seconds": dt, "stopped_by": stopped,
                "steps_per_s": n / dt if dt else 0.0, "images_per_s": n * cfg.batch / dt if dt else 0.0,
                "gflops": n * self.flops_per_step / dt / 1e9 if dt else 0.0,
                "final_loss": self.losses[-1] if self.losses else None, "peak_rss_gb": peak_rss_gb()}
