"""Sample sets for FID and the like: `autohc sample --num N --out samples.npz`, in one process
or over the ranks of torchrun, mpirun or srun, as facebookresearch/DiT's sample_ddp.py.

Image i (0 <= i < N) has its own class label and its own noise: both come from one
torch.Generator seeded by (--seed, i) alone (`image_seed`: numpy's SeedSequence of the pair),
the label first (uniform over the model's classes, or over --classes), then the initial noise
and, for DDPM, every step's noise. Batches are fixed index ranges [k B, (k+1) B) of
B = --per-batch images, batch k drawn by rank k % world, so the same batches are computed
whatever the number of ranks and the set is bit-identical for any world size. (A row of a
GEMM does not depend on the other rows in exact arithmetic, but a kernel's blocking over the
batch changes the last bits: a different --per-batch gives images equal up to rounding, not
bit-identical. It is one of the settings a rerun must repeat.)

Every finished batch is one shard, written atomically (a temp file in the same folder,
flushed and fsynced, then renamed) to OUT.parts/batch-<k:08d>.npz (`images` uint8 NHWC,
`labels`, `indices`), beside OUT.parts/meta.json with the settings (`Settings`). A job killed
or stopped and restarted with the same command skips the shards that exist and load, draws
the rest, and ends with no image missing or twice; a shard that does not load is drawn again
(with a warning). The same --out with other settings is refused, naming the setting.

At the end (after the last round's collective: every rank's shards are written) rank 0
writes OUT in the ADM evaluation suite's format, atomically: `arr_0` uint8 (N, H, W, C) in
index order (C = 1 for a one-channel model, 3 for RGB) and `labels` int64, streamed shard by
shard (memory: one shard). Latent models' samples are decoded by their VAE first. Images are
converted as ADM does, each pixel on its own: ((x + 1) * 127.5).clamp(0, 255) truncated to
uint8 (no per-batch stretch). The shard folder is then removed (--keep-shards keeps it: a rerun
then only assembles OUT again).

Stop signals (runtime/preempt.py): SIGTERM and --stop-signal end the job at the next round of
batches (a round: one batch per rank; every rank joins each round's all-gather, which carries
the stop flag, so all ranks stop together) with the shards kept and exit code 75.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .data import InputError

FORMAT = "autohc-sample-set-1"
DEFAULT_NUM = 50_000            # the ADM / DiT FID-50K set
DEFAULT_PER_BATCH = 32
LOG_EVERY_S = 60.0              # without a terminal: a line this often, or every 5 % of the set


@dataclass
class Settings:
    """What a set's images depend on; meta.json, which a rerun into the same --out must match."""
    ckpt: str                   # the checkpoint file (a run folder's newest, resolved)
    step: int
    weights: str                # ema | raw
    num: int
    per_batch: int
    seed: int
    sampler: str
    steps: int
    cfg: float
    classes: list[int] | None   # None: all of the model's
    vae: str | None             # a latent model's VAE (None: pixel space)
    kernels: str                # autohc | torch
    precision: str = "fp32"     # the model's forward: fp32 | bf16 (resolved; the sampler runs fp32)
    parallel: str = "data"      # ranks per batch: data | cfg | patch:P (dit/sample_parallel.py)

    def meta(self) -> dict:
        return {"format": FORMAT, **asdict(self)}


def first_difference(there: dict, here: dict) -> str | None:
    """'KEY THERE there, HERE' for the first setting of `here` that `there` does not share."""
    for key, value in here.items():
        if there.get(key) != value:
            return f"{key} {there.get(key)!r} there, {value!r}"
    return None


def image_seed(seed: int, i: int) -> int:
    """The 64-bit seed of image i's generator: numpy's SeedSequence of (seed, i), distinct and
    well mixed for every pair."""
    hi, lo = np.random.SeedSequence([seed % 2 ** 64, i]).generate_state(2)
    return int(hi) << 32 | int(lo)


def labels_and_generators(indices: range, seed: int, classes: list[int]) -> tuple[torch.Tensor, list]:
    """Each image's label (uniform over `classes`) and its generator, positioned after the label
    draw: the noise comes next from the same stream."""
    gens, labels = [], []
    for i in indices:
        g = torch.Generator().manual_seed(image_seed(seed, i))
        labels.append(classes[int(torch.randint(len(classes), (1,), generator=g))])
        gens.append(g)
    return torch.tensor(labels, dtype=torch.long), gens


def to_uint8_adm(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8 as the ADM suite's samplers convert:
    ((x + 1) * 127.5).clamp(0, 255), truncated; every pixel on its own."""
    return ((x.detach().float() + 1) * 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


@torch.no_grad()
def draw(model, arch: dict, s: Settings, indices: range, decode: Callable | None = None, team=None
         ) -> tuple[np.ndarray, np.ndarray]:
    """The images (uint8 NHWC) and labels (int64) of `indices`; with a cfg `team`
    (dit/sample_parallel.py) this rank's half of the guided batch, eps exchanged each step
    (patch teams: the model is inside sample_parallel.token_split)."""
    from .diffusion import GaussianDiffusion
    from .sample import guided_eps
    from .sample_parallel import cfg_eps
    classes = s.classes if s.classes is not None else list(range(arch["num_classes"]))
    y, gens = labels_and_generators(indices, s.seed, classes)
    shape = (len(y), arch["in_channels"], arch["input_size"], arch["input_size"])
    eps = (cfg_eps(model, arch, y, s.cfg, s.precision, team) if team is not None and team.mode == "cfg"
           else guided_eps(model, arch, y, s.cfg, s.precision))
    x = GaussianDiffusion().sample(eps, shape, sampler=s.sampler, steps=s.steps, clip=arch["images"],
                                   generators=gens)
    if decode is not None:
        x = decode(x)
    return to_uint8_adm(x), y.numpy().astype(np.int64)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable) -> None:
    """write(file) into a temp file beside `path`, flushed and fsynced, then renamed over it; the
    temp file is removed by an immediate exit on a second signal (preempt.writing) or an error."""
    from ..runtime import preempt
    tmp = path.with_name(f".{path.name}.tmp")
    with preempt.writing(tmp):
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _fsync_dir(path.parent)


class ShardError(Exception):
    """A shard or the set that could not be written (no space, quota, permissions): one line."""


class Shards:
    """OUT.parts/: batch-<k:08d>.npz per finished batch and meta.json."""

    def __init__(self, out: Path, num: int, per_batch: int):
        self.out, self.num, self.per_batch = out, num, per_batch
        self.dir = out.with_name(out.name + ".parts")
        self.batches = -(-num // per_batch)

    def indices(self, k: int) -> range:
        return range(k * self.per_batch, min(self.num, (k + 1) * self.per_batch))

    def path(self, k: int) -> Path:
        return self.dir / f"batch-{k:08d}.npz"

    def listed(self) -> int:
        """Images in the shards present (by name, not loaded): for the first log line."""
        return sum(len(self.indices(k)) for k in range(self.batches) if self.path(k).is_file())

    def check_meta(self, s: Settings) -> None:
        """Create the folder and meta.json, or check that they are this set's (InputError)."""
        meta = self.dir / "meta.json"
        if self.dir.exists() and not self.dir.is_dir():
            raise InputError(f"{self.dir}: a file where the sample set's shard folder goes: remove it "
                             "or choose another --out")
        if meta.is_file():
            try:
                there = json.loads(meta.read_text())
                assert isinstance(there, dict)
                there.setdefault("precision", "fp32")       # (sets from before the settings)
                there.setdefault("parallel", "data")
            except (OSError, ValueError, AssertionError):
                raise InputError(f"{meta}: not readable as a sample set's settings: remove {self.dir} "
                                 "or choose another --out") from None
            differ = first_difference(there, s.meta())
            if differ:
                raise InputError(f"{self.dir} holds shards of another sample set ({differ} here): the same "
                                 f"settings continue it; or remove {self.dir} or choose another --out")
            return
        if self.dir.is_dir() and any(self.dir.glob("batch-*.npz")):
            raise InputError(f"{self.dir} holds shards but no meta.json: remove it or choose another --out")
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(meta, lambda f: f.write((json.dumps(s.meta(), indent=1) + "\n").encode()))

    def load(self, k: int, warn: Callable[[str], None] | None = None):
        """(images, labels) of batch k from its shard, or None: missing, or (with a warning)
        one that does not load or is not batch k of this set (then drawn again)."""
        p = self.path(k)
        if not p.is_file():
            return None
        want = self.indices(k)
        try:
            with np.load(p, allow_pickle=False) as z:
                images, labels, indices = z["images"], z["labels"], z["indices"]
            ok = (images.dtype == np.uint8 and images.ndim == 4 and len(images) == len(want)
                  and labels.dtype == np.int64 and labels.shape == (len(want),)
                  and np.array_equal(indices, np.arange(want.start, want.stop)))
            why = "not this batch's images"
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if ok:
            return images, labels
        if warn:
            warn(f"autohc sample: warning: {p} does not load ({why}): drawing batch {k} again")
        return None

    def write(self, k: int, images: np.ndarray, labels: np.ndarray) -> None:
        idx = self.indices(k)
        arrays = {"images": images, "labels": labels, "indices": np.arange(idx.start, idx.stop, dtype=np.int64)}
        try:
            _atomic_write(self.path(k), lambda f: np.savez(f, **arrays))
        except OSError as e:
            raise ShardError(f"{self.path(k)}: could not be written ({e.strerror or e}); "
                             "the shards written stay, the same command continues") from None

    def assemble(self) -> tuple[int, int, int]:
        """Write OUT (arr_0, labels) from the shards in index order, atomically, streaming one
        shard at a time; its (H, W, C)."""
        first = self.load(0)
        if first is None:
            raise ShardError(f"{self.path(0)}: missing or unloadable when assembling {self.out}")
        h, w, c = first[0].shape[1:]

        def write(f):
            labels = []
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                with zf.open("arr_0.npy", "w", force_zip64=True) as a:
                    np.lib.format.write_array_header_1_0(
                        a, {"descr": "|u1", "fortran_order": False, "shape": (self.num, h, w, c)})
                    for k in range(self.batches):
                        got = first if k == 0 else self.load(k)
                        if got is None or got[0].shape[1:] != (h, w, c):
                            raise ShardError(f"{self.path(k)}: missing, unloadable or of another image "
                                             f"size when assembling {self.out}: rerun the same command")
                        a.write(np.ascontiguousarray(got[0]).tobytes())
                        labels.append(got[1])
                with zf.open("labels.npy", "w", force_zip64=True) as b:
                    np.lib.format.write_array(b, np.concatenate(labels).astype(np.int64), allow_pickle=False)
        try:
            _atomic_write(self.out, write)
        except OSError as e:
            raise ShardError(f"{self.out}: could not be written ({e.strerror or e}); the shards in "
                             f"{self.dir} stay: the same command assembles it again") from None
        return h, w, c

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def remove_temps(self) -> None:
        for p in self.dir.glob(".*.tmp"):
            p.unlink(missing_ok=True)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Rank 0's progress: a rich bar on a terminal (stderr), else a log line every 5 % of the set
    or LOG_EVERY_S seconds. Rate and ETA count the images drawn by this job (not those found)."""

    def __init__(self, num: int, show: bool, log: Callable[[str], None]):
        self.num, self.done, self.show, self.log = num, 0, show, log
        self.t0, self.drawn = time.monotonic(), 0
        self._last_t, self._last_done = self.t0, 0
        self._bar = None
        if show and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress as Bar, TextColumn
            self._bar = Bar(TextColumn("sampling"), BarColumn(), TextColumn("{task.completed}/{task.total} images"),
                            TextColumn("· {task.fields[rate]} · ETA {task.fields[eta]}"),
                            console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("sampling", total=num, rate="? images/s", eta="?")

    def rate(self) -> float:
        return self.drawn / max(time.monotonic() - self.t0, 1e-9)

    def line(self) -> str:
        r = self.rate()
        eta = _duration((self.num - self.done) / r) if r > 0 else "?"
        return f"autohc sample: {self.done}/{self.num} images · {r:.1f} images/s · ETA {eta}"

    def update(self, drawn: int, found: int) -> None:
        self.drawn += drawn
        self.done += drawn + found
        if not self.show:
            return
        now = time.monotonic()
        if self._bar is not None:
            r = self.rate()
            self._bar.update(self._task, completed=self.done, rate=f"{r:.1f} images/s",
                             eta=_duration((self.num - self.done) / r) if r > 0 else "?")
        elif self.done < self.num and (now - self._last_t >= LOG_EVERY_S
                                       or self.done - self._last_done >= max(1, self.num // 20)):
            self.log(self.line())
            self._last_t, self._last_done = now, self.done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _gather_round(signum: int, drawn: int, found: int, failed: bool) -> tuple[int, int, int, bool]:
    """This round's (first stop signal of any rank, 0 for none; images drawn; images found in
    shards; whether a rank failed to write), over all ranks: every rank joins every round."""
    import torch.distributed as tdist
    mine = torch.tensor([signum, drawn, found, int(failed)], dtype=torch.int64)
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(rows, mine)
    signals = [int(r[0]) for r in rows if int(r[0])]
    return (signals[0] if signals else 0, sum(int(r[1]) for r in rows), sum(int(r[2]) for r in rows),
            any(int(r[3]) for r in rows))


def _all_max(value: int) -> int:
    import torch.distributed as tdist
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


def _from_rank_0(obj):
    """Rank 0's `obj` on every rank."""
    import torch.distributed as tdist
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def settings_from_args(args, w, world: int = 1, tokens: int = 1) -> Settings:
    """The set's settings from the command line and the checkpoint's convert.Weights, on `world`
    ranks, for a model of `tokens` tokens; InputError (one line) for what cannot be drawn."""
    from . import sample_parallel
    from .diffusion import GaussianDiffusion
    from .sample import check_classes
    arch = w.arch
    if args.classes is not None:
        check_classes(arch, args.classes)
    dropout = arch.get("class_dropout", 0) or 0
    if args.cfg is None:
        cfg = 2.0 if dropout > 0 else 1.0           # the default guidance where there is a null class
    elif args.cfg != 1.0 and dropout <= 0:
        raise InputError(f"--cfg {args.cfg:g}: {w.source}'s model was trained without label dropout "
                         "(class_dropout 0): it has no null class, so classifier-free guidance is "
                         "impossible; use --cfg 1")
    else:
        cfg = float(args.cfg)
    latent = arch.get("latent")
    mode = getattr(args, "parallel", None) or "data"
    degree = sample_parallel.check(mode, getattr(args, "parallel_ranks", None), world, tokens,
                                   guided=cfg != 1.0 and dropout > 0)
    return Settings(ckpt=str(Path(w.source).resolve()), step=int(w.step), weights="raw" if args.raw else "ema",
                    num=args.num or DEFAULT_NUM, per_batch=args.per_batch, seed=args.seed, sampler=args.sampler,
                    steps=args.sample_steps or GaussianDiffusion().default_steps(args.sampler), cfg=cfg,
                    classes=list(args.classes) if args.classes is not None else None,
                    vae=args.vae or (latent or {}).get("vae"), kernels="torch" if args.no_autohc else "autohc",
                    precision=sampling_precision(args),
                    parallel=f"patch:{degree}" if mode == "patch" else mode)


def sampling_precision(args) -> str:
    """--precision resolved (dit/precision.py): "fp32" or "bf16"; InputError for a bad value."""
    from . import precision
    try:
        return precision.resolve(getattr(args, "precision", None) or "fp32")[0]
    except ValueError as e:
        raise InputError(str(e)) from None


def command(args, *, kernels: Callable, fused_ops: Callable) -> int:
    """`autohc sample --num N --out SET.npz`: 0 done, 1 error, 2 bad input (one line, nothing
    written), 75 stopped by a signal (shards kept)."""
    from ..runtime import dist, preempt
    try:
        launch = dist.discover()
    except dist.LaunchError as e:
        print(f"autohc: {e}", file=sys.stderr)
        return 1

    def say(msg: str) -> None:
        if launch.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    with preempt.StopSignals(preempt.stop_signals(args.stop_signal)) as stop:
        try:
            out = Path(args.out or "samples.npz")
            if out.suffix != ".npz":
                raise InputError(f"--out {out}: a sample set (--num) is a .npz (the ADM evaluation "
                                 "suite's format); a PNG grid takes --per-class instead of --num")
            if args.per_class is not None:
                raise InputError("--per-class is for the PNG grid: a sample set draws --num images, "
                                 "labels uniform over --classes")
            from .sample import latent_decoder, load_weights
            model, w = load_weights(args.ckpt, ema=not args.raw, fused_ops=fused_ops())
            s = settings_from_args(args, w, launch.world, model.x_embedder.num_patches)
            decode = latent_decoder(w.arch, args.vae)
        except InputError as e:
            say(f"autohc: {e}")
            return 2
        try:
            launch = dist.init(launch)
        except dist.LaunchError as e:
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        try:
            from ..torch.frozen import frozen
            from . import sample_parallel
            from .model import expect_forwards
            team = sample_parallel.form(*sample_parallel.parse(s.parallel), launch.world, launch.rank)
            # bf16: each weight rounded once for the whole set; patch teams: this rank's tokens
            # (first-use tuning told this rank's share of the forwards)
            forwards = -(-s.num // (s.per_batch * launch.world)) * s.steps
            with kernels(), frozen(model), sample_parallel.token_split(model, team), \
                    expect_forwards(model, forwards):
                return _run(model, w.arch, s, out, decode, launch, stop, args, say, team)
        except RuntimeError as e:       # a collective that failed: one line per rank
            if launch.world == 1:
                raise
            print(f"autohc: {dist.peer_failure(launch, 'sampling', e)}", file=sys.stderr)
            return 1
        finally:
            dist.shutdown()


def _run(model, arch, s: Settings, out: Path, decode, launch, stop, args, say, team) -> int:
    from ..runtime import preempt
    shards = Shards(out, s.num, s.per_batch)
    # every rank the same settings (a run folder whose newest checkpoint changed between the
    # ranks' loads would mix two models), then rank 0 checks or creates the shard folder
    differ = first_difference(_from_rank_0(s.meta()), s.meta())
    if differ:
        print(f"autohc: rank {launch.rank}: other settings than rank 0's ({differ} here)", file=sys.stderr)
    if _all_max(int(differ is not None)):
        return 2
    error = None
    if launch.rank == 0:
        try:
            shards.check_meta(s)
        except InputError as e:
            error = f"autohc: {e}"
        except OSError as e:
            error = f"autohc: {shards.dir}: could not be created ({e.strerror or e})"
    error = _from_rank_0(error)
    if error is not None:
        say(error)
        return 2
    found0 = shards.listed() if launch.rank == 0 else 0
    ranks = f" over {launch.world} ranks ({launch.launcher}{team.describe()})" if launch.world > 1 else ""
    say(f"autohc sample: {s.num} images of {s.ckpt} (step {s.step}, {s.sampler} {s.steps} steps, cfg {s.cfg:g}, {s.precision}) "
        f"in {shards.batches} batches of {s.per_batch}{ranks} -> {out}; shards in {shards.dir}"
        + (f"; {found0} images already there" if found0 else ""))
    progress = Progress(s.num, launch.rank == 0, say)
    t0 = time.monotonic()
    from .sample_parallel import from_leader
    rounds = -(-shards.batches // team.teams)
    lead = team.member == 0             # a team's leader loads and writes its shards, and counts them
    try:
        for r in range(rounds):
            k = r * team.teams + team.team
            drawn = found = 0
            failed = False
            if k < shards.batches:
                have = lead and shards.load(k, warn=lambda m: print(m, file=sys.stderr, flush=True)) is not None
                if from_leader(team, int(have)):
                    found = len(shards.indices(k)) if lead else 0
                else:
                    images, labels = draw(model, arch, s, shards.indices(k), decode if lead else None, team)
                    try:
                        if lead:
                            shards.write(k, images, labels)
                            drawn = len(images)
                    except ShardError as e:
                        print(f"autohc: {e}", file=sys.stderr, flush=True)
                        failed = True
            signum, drawn_all, found_all, failed_any = _gather_round(stop.requested_signal or 0, drawn, found, failed)
            progress.update(drawn_all, found_all)
            if failed_any:
                return 2
            if signum and progress.done < s.num:
                say(f"autohc sample: {preempt.name(signum)} at image {progress.done} of {s.num}: stopping; "
                    f"shards kept in {shards.dir}; the same command continues")
                return preempt.EXIT_PREEMPTED
    finally:
        progress.close()
    seconds = time.monotonic() - t0
    rc, shape = 0, None
    if launch.rank == 0:                # every rank's shards are written: the last round's gather
        try:
            shape = shards.assemble()
        except ShardError as e:
            print(f"autohc: {e}", file=sys.stderr, flush=True)
            rc = 2
    rc = _all_max(rc)
    if rc or launch.rank != 0:
        return rc
    if args.keep_shards:
        shards.remove_temps()
    else:
        shards.remove()
    summary = {"out": str(out), "num": s.num, "shape": list(shape), "drawn": progress.drawn,
               "from_shards": s.num - progress.drawn, "seconds": round(seconds, 3),
               "images_per_s": round(progress.drawn / max(seconds, 1e-9), 3), "world": launch.world,
               "shards": str(shards.dir) if args.keep_shards else None, **asdict(s)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        h, w, c = shape
        print(f"autohc: {s.num} samples {h}x{w}x{c} from {s.ckpt} (step {s.step}) -> {out} "
              f"({progress.drawn} drawn in {seconds:.0f} s, {summary['images_per_s']:.1f} images/s"
              f"{f' over {launch.world} ranks' if launch.world > 1 else ''}; "
              f"{s.num - progress.drawn} from shards)")
    return 0
