"""`autohc train`, `autohc sample`, `autohc eval` and `autohc bench step`: parsers and runners
(registered by autohc/cli.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.results import add_save_argument, recorder
from ..dit.sizes import MODELS
from .argtypes import (automem_tier, checkpoint_path, data_spec, non_negative_float, non_negative_int, output_dir,
                       output_file, positive_float, positive_int, sampling_steps, signal_name, unit_interval)

# bench/step.py's MODES, spelled here so that parsing the command line does not import torch
# (autohc train sets torch's OpenMP spin before torch loads); a test keeps the two equal
STEP_MODES = ("stock", "compiled", "autohc", "autohc+compile",
              "stock-bf16", "compiled-bf16", "autohc-bf16", "autohc-bf16+compile")
SAMPLE_MODES = ("diffusers", "diffusers-bf16", "diffusers-bf16+compile", "diffusers+autohc",
                "diffusers-bf16+autohc", "autohc", "autohc-bf16")
STEP_BF16_MODES = ("stock", "stock-bf16", "compiled-bf16", "autohc-bf16", "autohc-bf16+compile")

TRAIN_EPILOG = """examples:
  autohc train --data digits --out runs/digits        # the laptop default: DiT-Ti/2, 2000 steps (time per CPU: docs/results.md)
  autohc train --data digits --steps 4000 --out runs/digits   # continue the same run to 4000 steps
  autohc train --model DiT-XL/2 --data npy:latents.npy --batch 8 --lr 1e-4 --out runs/xl
  autohc train --model DiT-S/2 --data folder:imgs/ --image-size 32 --no-autohc --out runs/s
  autohc train --data digits --precision fp32 --out runs/digits-fp32   # fp32 even where the CPU has bf16
latent DiT (images -> VAE latents once -> train -> decoded samples), and fine-tuning:
  autohc encode --data folder:imgs/ --vae stabilityai/sd-vae-ft-ema --image-size 256 --out latents/
  autohc train --model DiT-XL/2 --data latents:latents/ --batch 8 --lr 1e-4 --out runs/xl
  autohc train --init DiT-XL-2-256x256.pt --data latents:latents/ --lr 1e-4 --out runs/ft
data parallel (one rank per socket or die, all its cores; --batch is the global batch):
  torchrun --nproc-per-node 2 -m autohc.cli train --batch 64 --out runs/dp
  mpirun -np 2 --map-by ppr:1:socket:pe=N autohc train --batch 64 --out runs/dp
  srun --ntasks-per-node 2 --cpus-per-task N autohc train --batch 64 --out runs/dp
data:
  digits          scikit-learn's 8x8 digits, 10 classes (bundled: no download)
  folder:PATH     one subfolder per class with images (--image-size N resizes)
  npy:PATH.npy    N x C x H x W (uint8 images, or float latents), labels in PATH.labels.npy
  synthetic       random data for benchmarks (--image-size, --channels)
  latents:DIR     latents written by autohc encode (memory-mapped; samples decoded by its VAE)
on a batch cluster (docs/training.md has a Slurm script):
  #SBATCH --signal=USR1@120 ... srun autohc train ... --requeue --out runs/xl
  SIGTERM (time limit, scancel, preemption) or --stop-signal (default USR1): the step ends, one
  checkpoint is written, exit 75; the same command continues (--resume auto, the default)
exit codes: 0 done, 1 error, 2 bad input / another run's --out / checkpoint not written,
  75 stopped by a signal (checkpoint written), 128+N a second signal N (exited at once)
writes to --out: ckpt-<step>.pt (atomic; the last --keep kept), losses.csv, losses.png, samples.png"""


def _sampling_args(p, *, steps_alias: bool = False) -> None:
    p.add_argument("--sampler", choices=["ddim", "ddpm"], default="ddim",
                   help="ddim (eta 0) or ddpm (posterior variance) (default: ddim)")
    names = ("--sample-steps", "--steps") if steps_alias else ("--sample-steps",)
    p.add_argument(*names, dest="sample_steps", type=sampling_steps, default=None,
                   help="sampling steps, at most 1000 (default: ddim 50, ddpm all 1000; ddpm on fewer walks "
                        "the reference DiT's respaced chain, as its sample.py does with 250)")
    p.add_argument("--cfg", type=positive_float, default=2.0,
                   help="classifier-free guidance scale; 1 = none (default: 2)")


def _precision_arg(p) -> None:
    """--precision of the commands that sample (sample, eval, compare)."""
    p.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                   help="the model's forward in fp32, or bf16 under torch.autocast (bf16 GEMMs on "
                        "weights rounded once for the whole run, fp32 sums; the DDIM/DDPM update in "
                        "fp32); auto (default): bf16 where the CPU multiplies bf16 in hardware (AMX, "
                        "AVX512_BF16), else fp32. The summary line says which ran")


def _sampling_precision(args) -> str:
    """--precision resolved: 'fp32' or 'bf16' (the summary line says which ran)."""
    from ..dit import precision
    return precision.resolve(args.precision)[0]


def _eval_args(p) -> None:
    """What eval and compare sample and score with."""
    p.add_argument("--per-class", type=positive_int, default=100, help="samples per class (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    p.add_argument("--raw", action="store_true", help="the raw model weights instead of the EMA")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--no-autohc", action="store_true", help="stock torch kernels")
    p.add_argument("--vae", default=None, metavar="PATH_OR_ID",
                   help="a latent model's VAE, if not where the checkpoint says")
    _sampling_args(p, steps_alias=True)
    _precision_arg(p)


def add_parsers(sub, bsub) -> None:
    models = ", ".join(MODELS)
    t = sub.add_parser("train", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="train a class-conditional DiT (checkpoints, resume, samples)",
                       description="Trains a class-conditional DiT with the epsilon-MSE diffusion loss, AdamW and\n"
                                   "EMA, on autohc's tuned GEMMs and fused operators (--no-autohc: stock torch).\n"
                                   "Shows loss, steps/s, images/s, GFLOP/s and peak RSS. A run whose --out holds\n"
                                   "checkpoints of the same settings continues from the newest, with losses\n"
                                   "bit-identical to an uninterrupted run (--resume auto, the default).\n"
                                   "Data parallel when started by torchrun, mpirun or srun: --batch is the global batch.",
                       epilog=TRAIN_EPILOG)
    t.add_argument("--model", default=None, choices=list(MODELS), metavar="NAME",
                   help=f"one of {models} (default: DiT-Ti/2, or the size of --init's or --resume's checkpoint)")
    t.add_argument("--data", default="digits", type=data_spec,
                   help="digits | folder:PATH | npy:PATH | latents:DIR | synthetic (default: digits)")
    t.add_argument("--init", default=None, metavar="CKPT",
                   help="fine-tune from these weights: a facebookresearch/DiT state dict (.pt, .safetensors; "
                        "DiT-XL-2-256x256.pt style, with or without model/ema keys), a diffusers "
                        "DiTTransformer2DModel or DiTPipeline folder, or an autohc checkpoint; another "
                        "number of classes re-initialises the label table")
    t.add_argument("--steps", type=positive_int, default=2000, help="train until this step (default: 2000)")
    t.add_argument("--batch", type=positive_int, default=64,
                   help="images per step, all ranks together (default: 64)")
    t.add_argument("--out", default="runs/dit", type=output_dir, help="run folder (default: runs/dit)")
    t.add_argument("--resume", nargs="?", const="auto", default="auto", choices=["auto", "never"],
                   help="auto (default; also a bare --resume): continue from the newest checkpoint in "
                        "--out when it was trained with the same settings (model, data, batch, lr, "
                        "weight decay, EMA, seed, label dropout, precision; --steps may grow), a "
                        "different one is an error naming the difference; never: a fresh run, only "
                        "into a new or empty --out")
    t.add_argument("--stop-signal", type=signal_name, default="USR1", metavar="SIG",
                   help="besides SIGTERM, the signal that stops the run at the end of its step with a "
                        "checkpoint and exit code 75 (default: USR1, for Slurm's --signal=USR1@SECONDS)")
    t.add_argument("--requeue", action="store_true",
                   help="on --stop-signal (not on SIGTERM: scancel, time limit), after the checkpoint, "
                        "ask Slurm to requeue the job (scontrol requeue $SLURM_JOB_ID); the requeued job "
                        "continues the run by itself")
    t.add_argument("--on-ckpt-error", choices=["stop", "warn"], default="stop",
                   help="a checkpoint that cannot be written (no space, quota, permissions, I/O): stop "
                        "(default: one line, exit 2, the previous checkpoint intact) or warn and train "
                        "on to the next one (the last one must be written either way)")
    t.add_argument("--no-autohc", action="store_true", help="stock torch kernels and torch.optim.AdamW")
    t.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                   help="auto (default): bf16 where the CPU multiplies bf16 in hardware (AMX, "
                        "AVX512_BF16), else fp32 (a CPU without them runs fp32 and the log says so); "
                        "bf16: mixed precision, the forward under "
                        "torch.autocast('cpu', bfloat16) (bf16 GEMMs and attention, fp32 sums), "
                        "master weights, AdamW and EMA in fp32, checkpoints as for fp32 (the digits "
                        "check found it equal to fp32: docs/training.md); fp32: everything in fp32. "
                        "The log and the summary say which ran and why; the end-of-run samples use "
                        "the same; a resume compares the precision that ran, not the flag")
    t.add_argument("--no-comm-thread", action="store_true",
                   help="data parallel: all-reduce on gloo's own threads instead of autohc's "
                        "communication thread (pinned to the CPU plan's comm core; MPI under mpirun)")
    t.add_argument("--automem", type=automem_tier, default=None, metavar="TIER",
                   help="AutoMem: saved activations leave memory after the forward pass and are "
                        "prefetched back for backward: file (a temporary directory), file:DIR "
                        "(e.g. a local SSD), numa[:NODE] (a NUMA memory node: the capacity tier "
                        "beside HBM) or bf16 (a bfloat16 copy: changes results slightly)")
    t.add_argument("--automem-state", action="store_true",
                   help="with --automem: AdamW's moments also go to the tier between steps, back "
                        "while backward runs (twice the parameters' bytes out of the peak)")
    t.add_argument("--cftp", type=non_negative_int, nargs="?", const=0, default=None, metavar="CLUSTERS",
                   help="CFTP: thread clusters (default with no number: one per NUMA node) each own "
                        "a slice of N of every GEMM, one copy of the model in the process, weights "
                        "and AdamW moments first-touched by their cluster (DiT-HC section 4.1)")
    t.add_argument("--log-every", type=positive_int, default=50,
                   help="without a terminal (a batch job's log): a progress line every N steps (default: 50)")
    t.add_argument("--no-first-use-tuning", action="store_true",
                   help="do not tune GEMM problems the registry lacks on first use (a few seconds "
                        "each; AUTOHC_FIRST_USE=0 does the same)")
    t.add_argument("--no-memory-check", action="store_true",
                   help="start even where the step would need more memory than this machine (or "
                        "the job's limit) has: before the first step, the activations are measured "
                        "on a forward of 1 and 2 images, and a run that does not fit is refused in "
                        "one line with the largest --batch that fits")
    t.add_argument("--lr", type=positive_float, default=1e-3,
                   help="AdamW learning rate (default: 1e-3; the DiT paper uses 1e-4 for ImageNet)")
    t.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay (default: 0)")
    t.add_argument("--ema", type=unit_interval, default=0.9999, help="EMA decay (default: 0.9999, with warm-up)")
    t.add_argument("--ckpt-every", type=positive_int, default=500, help="checkpoint every K steps (default: 500)")
    t.add_argument("--keep", type=positive_int, default=3, help="checkpoints kept (default: 3)")
    t.add_argument("--seed", type=int, default=0, help="seed of init, data order and noise (default: 0)")
    t.add_argument("--threads", type=positive_int, default=None, help="threads (default: every usable CPU)")
    t.add_argument("--image-size", type=positive_int, default=None, help="resize folder images / synthetic size")
    t.add_argument("--channels", type=positive_int, default=None, help="synthetic data channels (default: 3)")
    t.add_argument("--class-dropout", type=unit_interval, default=0.1,
                   help="label dropout for classifier-free guidance (default: 0.1)")
    t.add_argument("--learn-sigma", action="store_true",
                   help="model also outputs variance channels (reference layout; not trained by the MSE loss)")
    t.add_argument("--samples-per-class", type=non_negative_int, default=8,
                   help="samples per class in samples.png at the end (default: 8; up to 10 classes; "
                        "0: no samples, e.g. for a large model's benchmark run)")
    _sampling_args(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    add_save_argument(t)

    s = sub.add_parser(
        "sample", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="class-conditional samples from a checkpoint: a PNG grid, or (--num) a sample set for FID",
        description="Samples from a checkpoint's EMA weights (--raw: the raw ones), in one of two forms:\n"
                    "  a PNG grid: one row per class, --per-class images of each of --classes;\n"
                    "  a sample set (--num N, or an --out ending in .npz): N images in one .npz as the ADM\n"
                    "  evaluation suite (and facebookresearch/DiT's sample_ddp.py) writes it for FID: arr_0\n"
                    "  uint8 N x H x W x C in index order (C = 1 for one-channel models), labels int64.\n"
                    "Image i of a set has its own label (uniform over --classes, default all of the model's)\n"
                    "and noise, both from a generator seeded by (--seed, i) only. In one process or under\n"
                    "torchrun, mpirun or srun: batch k (images [k B, (k+1) B), B = --per-batch) is drawn by\n"
                    "rank k % world, so the set is bit-identical whatever the number of ranks (given the\n"
                    "same kernels; another --per-batch changes the last bits of a GEMM's blocking, hence a\n"
                    "setting of the set). Guidance (--cfg) needs a model trained with label dropout; a set\n"
                    "from a model without one defaults to --cfg 1.",
        epilog="""examples:
  autohc sample --ckpt runs/digits --classes 0 1 2 3 --per-class 8 --out grid.png
  autohc sample --ckpt runs/digits --num 10000 --out samples.npz      # a set: arr_0 + labels
  autohc sample --ckpt runs/xl --num 50000 --per-batch 32 --sampler ddpm --sample-steps 250 --cfg 1.5 --out fid50k.npz
the same set over ranks (each rank all its cores, or --threads):
  torchrun --nproc-per-node 2 -m autohc.cli sample --ckpt runs/xl --num-samples 50000 --out fid50k.npz
  mpirun -np 2 --map-by ppr:1:socket:pe=N autohc sample --ckpt runs/xl --num 50000 --out fid50k.npz
  srun --ntasks-per-node 2 --cpus-per-task N autohc sample --ckpt runs/xl --num 50000 --out fid50k.npz
a set resumes: each finished batch is a shard, OUT.parts/batch-<k>.npz (written atomically), with
  the settings in OUT.parts/meta.json; the same command after a crash, a kill or a stop signal
  draws only the batches missing (a shard that does not load is drawn again). Other settings
  into the same --out: exit 2, naming the setting. At the end rank 0 writes OUT and removes
  OUT.parts/ (--keep-shards keeps it). The shard folder must be one all ranks see.
on a batch cluster: SIGTERM or --stop-signal (default USR1, e.g. #SBATCH --signal=USR1@120):
  the batches in flight end, their shards are written, exit 75; the same command continues
exit codes: 0 done, 1 error, 2 bad input / another set's --out / a shard not written,
  75 stopped by a signal (shards kept), 128+N a second signal N (exited at once)""")
    s.add_argument("--ckpt", required=True, type=checkpoint_path,
                   help="checkpoint file, or a run folder (its newest)")
    s.add_argument("--classes", type=int, nargs="+", default=None,
                   help="classes (default: a grid the first 10, a set all of the model's, drawn uniformly)")
    s.add_argument("--per-class", type=positive_int, default=None, help="grid: samples per class (default: 8)")
    s.add_argument("--num", "--num-samples", dest="num", type=positive_int, default=None, metavar="N",
                   help="draw a sample set of N images into --out (a .npz) instead of a grid "
                        "(default with an --out ending in .npz: 50000, the FID-50K set). Under torchrun "
                        "write --num-samples: torchrun takes --num for its --numa-binding")
    s.add_argument("--per-batch", type=positive_int, default=32, metavar="B",
                   help="set: images per batch and shard, drawn by one rank (default: 32; with --cfg "
                        "the model sees 2B rows)")
    s.add_argument("--out", default=None, type=output_file,
                   help="grid: the PNG (default: samples.png); set: the .npz (default: samples.npz), its "
                        "shards in OUT.parts/ while it is drawn")
    s.add_argument("--keep-shards", action="store_true",
                   help="set: keep OUT.parts/ when OUT is written (a rerun then only assembles OUT again)")
    s.add_argument("--stop-signal", type=signal_name, default="USR1", metavar="SIG",
                   help="set: besides SIGTERM, the signal that stops it after the batches in flight, with "
                        "their shards written and exit code 75 (default: USR1)")
    s.add_argument("--parallel", default="data", choices=["data", "cfg", "patch"],
                   help="set: how ranks share the work (default: data, each batch on one rank). cfg: "
                        "teams of 2 ranks, one the conditional half of the guided batch, one the "
                        "unconditional, eps exchanged each step; patch: teams of --parallel-ranks, each "
                        "rank a slice of the tokens, attention over gathered keys and values (xDiT's "
                        "CFG and sequence parallel). Teams take batches round-robin (data parallel); "
                        "samples equal data parallel's up to rounding, so it is a setting of the set")
    s.add_argument("--parallel-ranks", type=positive_int, default=None, metavar="P",
                   help="set: ranks per team with --parallel patch (default: 2; a divisor of the "
                        "world size and of the model's token count); cfg: 2")
    s.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads of each process (default: torch's)")
    s.add_argument("--json", action="store_true", help="one JSON summary instead of the summary line")
    s.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    s.add_argument("--raw", action="store_true", help="the raw model weights instead of the EMA")
    s.add_argument("--no-autohc", action="store_true", help="stock torch kernels")
    s.add_argument("--vae", default=None, metavar="PATH_OR_ID",
                   help="a latent model's VAE, if not where the checkpoint says (its folder or hub id)")
    _sampling_args(s, steps_alias=True)
    _precision_arg(s)
    s.set_defaults(cfg=None)            # 2; a set from a model without label dropout: 1

    e = sub.add_parser("eval", help="digits quality: class match and Fréchet distance of samples",
                       description="Generates samples of every digit class and labels them with a "
                                   "classifier trained on the real digits (scikit-learn). Reports "
                                   "the share classified as the class asked for and the Fréchet "
                                   "distance to the real digits in the classifier's feature space.",
                       epilog="example:  autohc eval --ckpt runs/digits --per-class 100 --json")
    e.add_argument("--ckpt", required=True, type=checkpoint_path,
                   help="checkpoint file, or a run folder (its newest)")
    _eval_args(e)

    c = sub.add_parser("compare", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="training runs side by side: loss curves and digits quality (e.g. fp32 vs bf16)",
                       description="Compares `autohc train` runs (their --out folders): the loss curves\n"
                                   "of their newest checkpoints in one plot, and the digits quality of\n"
                                   "each one's EMA samples (as autohc eval: the share classified as the\n"
                                   "class asked for, the Fréchet distance to the real digits) in one\n"
                                   "table, each run against the first. Every run samples with the same\n"
                                   "seed, sampler and guidance.",
                       epilog="example (the fidelity of bf16 training, same seed):\n"
                              "  autohc train --data digits --steps 2000 --precision fp32 --out runs/digits\n"
                              "  autohc train --data digits --steps 2000 --out runs/digits-bf16 --precision bf16\n"
                              "  autohc compare runs/digits runs/digits-bf16")
    c.add_argument("runs", nargs="+", metavar="RUN", type=checkpoint_path,
                   help="run folders (or checkpoint files); the first is the baseline")
    c.add_argument("--out", default=None, type=output_file, help="plot path (default: compare.png in the last run's folder)")
    _eval_args(c)
    add_save_argument(c)

    bs = bsub.add_parser("sample", formatter_class=argparse.RawDescriptionHelpFormatter,
                         help="DiT sampling: diffusers' DiTTransformer2DModel (eager, autocast, compiled) vs autohc",
                         description="Seconds per image and images/s of class-conditional DiT sampling (DDIM,\n"
                                     "classifier-free guidance: the doubled batch) on random weights, 4-channel\n"
                                     "latents, 1000 classes: diffusers' DiTTransformer2DModel as users run it (fp32\n"
                                     "eager, under torch.autocast bf16, and torch.compile mode=max-autotune with\n"
                                     "inductor's freezing under autocast) against autohc's DiT on the same weights\n"
                                     "(fp32, and bf16 with weights rounded once: what `autohc sample` runs), and\n"
                                     "diffusers' model unchanged under autohc.install() (the +autohc modes).\n"
                                     "One sample is one sampler step of a batch (guided forward + fp32 DDIM update),\n"
                                     "the modes interleaved; seconds per image = step x --sample-steps / batch. Each\n"
                                     "bf16 mode's eps is compared with its fp32 form's on the same inputs.",
                         epilog="examples:\n  autohc bench sample --model DiT-S/2 --batch 8\n"
                                "  autohc bench sample --model DiT-XL/2 --batch 4 --modes diffusers-bf16 autohc-bf16\n"
                                "  autohc bench sample --model DiT-XL/2 --save")
    bs.add_argument("--model", default="DiT-S/2", choices=list(MODELS), metavar="NAME",
                    help=f"one of {models} (default: DiT-S/2)")
    bs.add_argument("--batch", type=positive_int, default=8, help="images per batch (default: 8; the model sees 2x)")
    bs.add_argument("--image-size", type=positive_int, default=32, help="latent size (default: 32 = 256px)")
    bs.add_argument("--samples", type=positive_int, default=5, help="timed steps per mode (default: 5)")
    bs.add_argument("--warmup", type=non_negative_int, default=1,
                    help="untimed steps first (default: 1; the compiled mode compiles in it)")
    bs.add_argument("--sample-steps", type=sampling_steps, default=50,
                    help="DDIM steps an image takes, for seconds per image (default: 50)")
    bs.add_argument("--cfg", type=positive_float, default=4.0, help="guidance scale (default: 4.0)")
    bs.add_argument("--modes", nargs="+", choices=list(SAMPLE_MODES), default=None,
                    help="what to run (default: all: " + ", ".join(SAMPLE_MODES) + ")")
    bs.add_argument("--threads", type=positive_int, default=None, help="threads (default: every usable CPU)")
    bs.add_argument("--no-first-use-tuning", action="store_true",
                    help="run the default GEMM kernels where the registry has no entry (default: tune "
                         "new GEMM problems on first use, in the warm-up step and between steps)")
    bs.add_argument("--parallel", nargs="+", choices=["cfg", "patch"], default=None,
                    help="instead of the modes: autohc's guided step on a team of --ranks processes "
                         "(CFG parallel, patch parallel: `autohc sample --parallel`) against one process "
                         "with the same total threads, in turns over --rounds rounds")
    bs.add_argument("--ranks", type=positive_int, default=2, help="--parallel: ranks per team (default: 2)")
    bs.add_argument("--rounds", type=positive_int, default=2,
                    help="--parallel: turns of every layout, each --samples timed steps (default: 2)")
    bs.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                    help="--parallel: the forward's precision (default: auto, bf16 where the CPU has it)")
    bs.add_argument("--json", action="store_true", help="one JSON object")
    add_save_argument(bs)

    b = bsub.add_parser("step", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="one DiT training step: stock torch vs torch.compile vs autohc",
                        description="Times one training step (forward, backward, AdamW) of a DiT on synthetic 256px\n"
                                    "latents (32x32x4, 1000 classes) with stock torch eager, torch.compile (inductor)\n"
                                    "and autohc, in one run: steps interleaved (one mode after the other when three\n"
                                    "copies would not fit in memory), median after warm-up; the losses of the\n"
                                    "steps from the same seed are compared.",
                        epilog="examples:\n  autohc bench step --model DiT-S/2 --batch 8\n"
                               "  autohc bench step --model DiT-XL/2 --batch 4 --json\n"
                               "  autohc bench step --modes stock autohc --steps 6\n"
                               "  autohc bench step --modes compiled autohc+compile")
    b.add_argument("--model", default="DiT-S/2", choices=list(MODELS), metavar="NAME",
                   help=f"one of {models} (default: DiT-S/2)")
    b.add_argument("--batch", type=positive_int, default=8, help="images per step (default: 8)")
    b.add_argument("--image-size", type=positive_int, default=32, help="latent size (default: 32 = 256px)")
    b.add_argument("--steps", type=positive_int, default=10, help="steps per mode (default: 10)")
    b.add_argument("--warmup", type=positive_int, default=2, help="of which untimed (default: 2)")
    b.add_argument("--modes", nargs="+", choices=list(STEP_MODES), default=None,
                   help="what to run (default: the four fp32 ones, or with --precision bf16 stock "
                        "fp32 and the four -bf16 ones); autohc+compile is torch.compile under "
                        "install(): inductor's GEMMs and attention on autohc, its fused code for "
                        "the element-wise rest; a -bf16 mode runs its forward under "
                        "torch.autocast bf16 with fp32 master weights")
    b.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="the default modes: fp32 (default), or bf16: stock fp32, stock autocast, "
                        "compiled autocast, autohc-bf16 and autohc-bf16+compile, with "
                        "autohc-bf16's speedups over each")
    b.add_argument("--threads", type=positive_int, default=None, help="threads (default: every usable CPU)")
    b.add_argument("--torch-threads", type=positive_int, default=None,
                   help="torch's own threads while autohc is installed (default: install()'s)")
    b.add_argument("--no-first-use-tuning", action="store_true",
                   help="run the default GEMM kernels where the registry has no entry (default: "
                        "tune each new GEMM problem on first use, as install() does; that time "
                        "is reported apart)")
    b.add_argument("--profile", action="store_true",
                   help="after the timed steps, one profiled step per mode: its time (seconds "
                        "and share) in GEMM, attention, element-wise, optimizer, copies and "
                        "other, and the GFLOP/s the GEMMs and attention reach inside the step")
    b.add_argument("--short-spin", action="store_true",
                   help="set GOMP_SPINCOUNT=10000 before torch loads, as `autohc train` does "
                        "(default: libgomp's default wait, as a user's script runs stock torch). "
                        "It applies to stock too. With AUTOHC_TEAM=pool it is what lets install() "
                        "keep torch's threads (docs/override.md, Threads)")
    b.add_argument("--json", action="store_true", help="one JSON object")
    add_save_argument(b)


def _kernels(args):
    """autohc installed for the command, unless --no-autohc."""
    import contextlib
    import autohc
    if args.no_autohc:
        return contextlib.nullcontext()
    return autohc.installed(first_use_tuning=not getattr(args, "no_first_use_tuning", False))


def _fused_ops(args):
    """autohc's fused operators for the model, unless --no-autohc."""
    from ..dit.train import autohc_ops
    return autohc_ops(not args.no_autohc)


def _sample_steps(args) -> int:
    """--sample-steps, or the sampler's default."""
    from ..dit.diffusion import GaussianDiffusion
    return args.sample_steps or GaussianDiffusion().default_steps(args.sampler)


def _generate(model, arch, classes, per_class: int, args, progress: bool, precision: str):
    """Samples of `classes` with the sampler, steps, guidance and seed the command was given,
    the forward in `precision` (resolved: fp32 or bf16)."""
    from ..dit.sample import generate
    return generate(model, arch, classes, per_class=per_class, sampler=args.sampler,
                    steps=_sample_steps(args), cfg=args.cfg, seed=args.seed, progress=progress,
                    precision=precision)


def _train_conflict(args) -> str | None:
    """What the options ask that this data or setup cannot do (else None): said, not ignored."""
    kind = args.data.partition(":")[0]
    if args.image_size is not None and kind not in ("folder", "synthetic"):
        return (f"--image-size is for folder: and synthetic data (resized or drawn at that size); "
                f"--data {args.data} has its own size")
    if args.channels is not None and kind != "synthetic":
        return f"--channels is for synthetic data; --data {args.data} has its own channels"
    if args.automem_state and not args.automem:
        return "--automem-state needs --automem TIER (the tier the state goes to)"
    return None


def cmd_train(args) -> int:
    import torch
    conflict = _train_conflict(args)
    if conflict:
        print(f"autohc: {conflict}", file=sys.stderr)
        return 2
    args.recorder = recorder("train", args)     # --save: started before training (fresh or not)
    if args.threads:                    # before install(), which takes the count for its kernels
        torch.set_num_threads(args.threads)
    with _kernels(args):
        return _train(args)


def _train(args) -> int:
    from ..runtime import dist
    try:
        launch = dist.init()            # world 1 without a launcher
    except dist.LaunchError as e:
        print(f"autohc: {e}", file=sys.stderr)
        return 1
    try:
        return _train_in_group(args, launch)
    finally:
        dist.shutdown()


def _train_in_group(args, launch) -> int:
    from ..dit import data as datalib
    from ..dit.train import TrainConfig, Trainer
    cfg = TrainConfig(model=args.model, data=args.data, steps=args.steps, batch=args.batch,
                      out=args.out, lr=args.lr, weight_decay=args.weight_decay, ema=args.ema,
                      ckpt_every=args.ckpt_every, keep=args.keep, seed=args.seed,
                      autohc=not args.no_autohc, threads=args.threads, image_size=args.image_size,
                      channels=args.channels or 3, class_dropout=args.class_dropout,
                      learn_sigma=args.learn_sigma, sample_steps=_sample_steps(args), cfg=args.cfg,
                      rank=launch.rank, world=launch.world,
                      comm="gloo" if args.no_comm_thread else "thread", log_every=args.log_every,
                      automem=args.automem, cftp=args.cftp, automem_state=args.automem_state,
                      init=args.init, precision=args.precision, stop_signal=args.stop_signal,
                      requeue=args.requeue, on_ckpt_error=args.on_ckpt_error,
                      extra={"resume": args.resume})
    from ..runtime import preempt
    # caught from here on: a signal while the data loads or kernels compile stops after step one
    with preempt.StopSignals(preempt.stop_signals(args.stop_signal)) as stop:
        try:
            trainer = Trainer(cfg)
        except datalib.InputError as e:
            print(f"autohc: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        if not args.no_memory_check and not _fits_in_memory(trainer, launch):
            return 2
        trainer.stop = stop
        return _run_trainer(trainer, args, launch)


def _fits_in_memory(trainer, launch) -> bool:
    """Whether the run fits in every rank's memory (dit/memory_check.py); where it does not,
    every rank says so and none starts."""
    from ..dit import memory_check
    from ..runtime import dist
    why = None
    try:
        memory_check.check(trainer)
    except memory_check.MemoryShortError as e:
        why = str(e)
    _, short = dist.average_with_flags(0.0, [why is not None])
    if why is not None:
        print(f"autohc: {why}", file=sys.stderr)
    elif short:
        print(f"autohc: rank {launch.rank}: another rank has too little memory for this run (its line says why)",
              file=sys.stderr)
    return not short


def _run_trainer(trainer, args, launch) -> int:
    from ..dit import checkpoint
    from ..dit.model import expect_forwards
    from ..dit.sample import plot_losses, save_grid
    from ..runtime import preempt
    from ..torch.threads import kernel_threads
    cfg = trainer.cfg
    if launch.world > 1 and launch.rank == 0:
        print(f"autohc: data parallel over {launch.world} ranks ({launch.launcher}), global batch "
              f"{cfg.batch} = {cfg.batch // launch.world} per rank, gradient all-reduce "
              + ("on gloo's threads" if cfg.comm == "gloo" else
                 f"on a communication thread ({'MPI' if trainer.comm_hook.use_mpi else 'gloo'}, "
                 f"core {trainer.comm_hook.core})"), file=sys.stderr)
    if launch.rank == 0:
        print(f"autohc: precision {trainer.precision}: {trainer.precision_why}", file=sys.stderr)
    if trainer.resumed_from and launch.rank == 0:
        print(f"autohc: resuming from {trainer.resumed_from} (step {trainer.step})", file=sys.stderr)
    if trainer.step >= cfg.steps:
        print(f"autohc: {args.out} is already at step {trainer.step} >= --steps {cfg.steps}", file=sys.stderr)
    try:
        with expect_forwards(trainer.model, max(0, cfg.steps - trainer.step)):
            summary = trainer.run(progress=not args.no_progress)
    except checkpoint.WriteError as e:
        print(f"autohc: {e}" if launch.rank == 0 else f"autohc: rank {launch.rank}: stopping: {e}",
              file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        if launch.world == 1:
            raise
        from ..runtime import dist
        print(f"autohc: {dist.peer_failure(launch, 'a data-parallel step', e)}", file=sys.stderr)
        return 1
    finally:                            # helper threads (and the file tier's folder) go
        if trainer.comm_hook is not None:
            trainer.comm_hook.close()
        if trainer.automem is not None:
            trainer.automem.close()
        if trainer.state_offload is not None:
            trainer.state_offload.close()
        if trainer.cftp_clusters:
            from ..runtime import cftp
            cftp.disable()
    if (stopped := summary["stopped_by"]) is not None:
        # every rank says so before end_data_parallel's last collective (under mpirun the first
        # rank to exit with a non-zero code gets the others killed, their line unwritten), each
        # line in one write: the ranks share stderr and say it at the same moment
        if launch.rank == 0:
            line = (f"autohc train: {stopped['signal']} at step {trainer.step}: stopped after writing "
                    f"{stopped['checkpoint']}; the same command continues from there "
                    f"(exit {preempt.EXIT_PREEMPTED})")
        else:
            line = f"autohc train: rank {launch.rank}: stopped at step {trainer.step} (exit {preempt.EXIT_PREEMPTED})"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    trainer.end_data_parallel()
    if stopped is not None:
        if launch.rank == 0 and stopped["requeue"]:
            preempt.requeue()
        return preempt.EXIT_PREEMPTED
    if launch.rank != 0:                # rank 0 plots, samples and reports
        return 0
    out = Path(args.out)
    plot_losses(trainer.losses, out / "losses.png")
    wrote = [out / "losses.png"]
    if args.samples_per_class:
        classes = list(range(min(10, trainer.data.num_classes)))
        x, _ = _generate(trainer.ema.eval(), trainer.arch, classes, args.samples_per_class, args,
                         progress=not args.no_progress, precision=trainer.precision)
        from ..dit.sample import decode_latents
        save_grid(decode_latents(x, trainer.arch), len(classes), out / "samples.png")
        wrote.append(out / "samples.png")
    summary.update(out=str(out), losses_png=str(out / "losses.png"),
                   samples_png=str(out / "samples.png") if args.samples_per_class else None,
                   model=cfg.model, batch=args.batch, autohc=not args.no_autohc,
                   precision=trainer.precision, precision_why=trainer.precision_why,
                   threads=kernel_threads())
    if (rec := getattr(args, "recorder", None)) is not None:
        print(f"autohc: result saved to {rec.save(summary, threads=summary['threads'])}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"autohc: {summary['steps']} steps ({summary['new_steps']} now) in {summary['seconds']:.0f} s: "
              f"{summary['steps_per_s']:.2f} steps/s, {summary['images_per_s']:.0f} images/s, "
              f"{summary['gflops']:.0f} GFLOP/s, final loss {summary['final_loss']:.4f}, "
              f"peak RSS {summary['peak_rss_gb']:.2f} GB, precision {trainer.precision} ({trainer.precision_why})\n"
              f"autohc: wrote {', '.join(map(str, wrote))}; checkpoints in {out}")
    return 0


def cmd_sample(args) -> int:
    if args.threads:                    # before install(), which takes the count for its kernels
        import torch
        torch.set_num_threads(args.threads)
    if args.num is not None or (args.out or "").endswith(".npz"):
        from ..dit import sample_set    # a sample set: autohc/dit/sample_set.py
        return sample_set.command(args, kernels=lambda: _kernels(args), fused_ops=lambda: _fused_ops(args))
    if args.parallel != "data" or args.parallel_ranks is not None:
        print("autohc: --parallel and --parallel-ranks are for a sample set (--num N): a grid is drawn "
              "in one process", file=sys.stderr)
        return 2
    from ..dit.model import expect_forwards
    from ..dit.sample import latent_decoder, load_model, save_grid
    out = args.out or "samples.png"
    args.cfg = 2.0 if args.cfg is None else args.cfg
    model, arch, path = load_model(args.ckpt, ema=not args.raw, fused_ops=_fused_ops(args))
    classes = args.classes if args.classes is not None else list(range(min(10, arch["num_classes"])))
    per_class = args.per_class or 8
    check_sampling_inputs(arch, classes, per_class)
    decode = latent_decoder(arch, args.vae)     # a bad --vae: said before any sampling
    prec = _sampling_precision(args)
    with _kernels(args), expect_forwards(model, _sample_steps(args)):
        x, _ = _generate(model, arch, classes, per_class, args, progress=True, precision=prec)
    save_grid(x if decode is None else decode(x), len(classes), out)
    if args.json:
        print(json.dumps({"out": out, "samples": len(x), "ckpt": str(path), "precision": prec}))
    else:
        print(f"autohc: {len(x)} samples ({prec}) from {path} -> {out}")
    return 0


def _eval_digits(ckpt, args, progress: bool) -> dict:
    """Digits quality of a checkpoint's samples (autohc eval's figures)."""
    from ..dit.evaluate import evaluate_digits
    from ..dit.model import expect_forwards
    from ..dit.sample import latent_decoder, load_model
    model, arch, path = load_model(ckpt, ema=not args.raw, fused_ops=_fused_ops(args))
    check_digits_model(arch, path)
    check_sampling_inputs(arch, list(range(10)), args.per_class)
    decode = latent_decoder(arch, args.vae)     # a bad --vae: said before any sampling
    prec = _sampling_precision(args)
    with _kernels(args), expect_forwards(model, _sample_steps(args)):
        x, y = _generate(model, arch, list(range(10)), args.per_class, args, progress=progress,
                         precision=prec)
    x = x if decode is None else decode(x)
    if tuple(x.shape[1:]) != (1, 8, 8):
        raise ValueError(f"{path}: the VAE decodes to {tuple(x.shape[1:])}, not 1 x 8 x 8 digits")
    r = evaluate_digits(x, y)
    r.update(ckpt=str(path), sampler=args.sampler, sample_steps=_sample_steps(args), cfg=args.cfg,
             sampling_precision=prec)
    return r


def check_sampling_inputs(arch: dict, classes: list[int], per_class: int) -> None:
    """InputError for classes the model lacks, or more images than memory holds (the sampler
    keeps a few fp32 copies of the batch), before any sampling."""
    import psutil
    from ..dit.data import InputError
    from ..dit.sample import check_classes
    check_classes(arch, classes)
    side, latent = arch["input_size"], arch.get("latent")
    each = 8 * arch["in_channels"] * side * side * 4 + (3 * latent["image_size"] ** 2 * 4 if latent else 0)
    need = len(classes) * per_class * each
    have = psutil.virtual_memory().available
    if need > have:
        raise InputError(f"--per-class {per_class} x {len(classes)} classes: about {need / 2**30:.1f} GiB "
                         f"of samples in one batch, {have / 2**30:.1f} GiB available; ask for fewer")


def check_digits_model(arch: dict, path) -> None:
    """InputError unless the model makes digits (what autohc eval and compare score)."""
    from ..dit.data import InputError
    latent = arch.get("latent")
    size = latent["image_size"] if latent else arch["input_size"]
    if (latent is None and arch["in_channels"] != 1) or (size, arch["num_classes"]) != (8, 10):
        raise InputError(f"{path}: autohc eval checks digits models (1 x 8 x 8 images, or their latents; "
                         f"10 classes); this one makes {size} x {size} "
                         f"{'images through a VAE' if latent else 'images'}, {arch['num_classes']} classes")


def cmd_eval(args) -> int:
    r = _eval_digits(args.ckpt, args, progress=not args.json)
    path = r["ckpt"]
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{path}: {r['samples']} samples ({args.sampler}, {_sample_steps(args)} steps, cfg {args.cfg}, "
              f"{r['sampling_precision']})\n"
              f"  classified as the class asked for: {100 * r['class_match']:.1f}%  "
              f"(per class: {', '.join(f'{k}: {100 * v:.0f}%' for k, v in r['per_class'].items())})\n"
              f"  Fréchet distance to the real digits: {r['frechet']:.3f}  "
              f"(between two halves of the real digits: {r['frechet_real_halves']:.3f})\n"
              f"  classifier accuracy on held-out real digits: {100 * r['classifier_test_accuracy']:.1f}%")
    return 0


def cmd_compare(args) -> int:
    from ..dit import compare
    from ..torch.threads import kernel_threads
    from ..dit.data import InputError
    if len(args.runs) < 2:
        raise InputError(f"compare: give two run folders or more, got {len(args.runs)}")
    runs = [compare.run_summary(r) for r in args.runs]     # every run readable before sampling
    for r in runs:                                          # ... and a digits model
        check_digits_model(r["arch"], r["ckpt"])
    rec = recorder("compare", args)
    for r in runs:
        if not args.json:
            print(f"autohc: sampling {r['run']} ({r['ckpt']}) for its digits quality", file=sys.stderr)
        del r["arch"]
        r.update(_eval_digits(r["ckpt"], args, progress=not args.json))
        r["ckpt"] = str(r["ckpt"])
    summary = compare.summarize(runs)
    out = Path(args.out) if args.out else Path(args.runs[-1]) / "compare.png"
    summary.update(plot=str(compare.plot(runs, summary, out)), sampler=args.sampler,
                   sample_steps=_sample_steps(args), cfg=args.cfg, per_class=args.per_class)
    if rec is not None:
        print(f"autohc: result saved to {rec.save(summary, threads=kernel_threads())}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(compare.table(summary))
        print(f"smoothed loss curves ({summary['smoothing_steps']} steps) within "
              f"{100 * summary['smoothed_loss_max_rel_diff']:.1f} % of the first run's over "
              f"{summary['common_steps']} steps; plot: {summary['plot']}")
    return 0


def cmd_bench_sample(args) -> int:
    if args.parallel:
        return _bench_sample_parallel(args)
    from ..bench.sample import bench_sample
    rec = recorder("sample", args)
    modes = args.modes or list(SAMPLE_MODES)
    r = bench_sample(args.model, args.batch, image_size=args.image_size, samples=args.samples,
                     warmup=args.warmup, sample_steps=args.sample_steps, cfg=args.cfg, modes=modes,
                     threads=args.threads, first_use_tuning=not args.no_first_use_tuning,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    if rec is not None:
        print(f"autohc: result saved to {rec.save(r, threads=r['threads'])}", file=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']} batch {r['batch']} (x2 with guidance {r['cfg']:g}), {r['threads']} threads, "
          f"bf16 unit {r['bf16_unit']}; median of {r['timed']} sampler steps, an image = "
          f"{r['sample_steps']} steps:")
    for m in modes:
        d = r["max_rel_eps_diff"][m]
        print(f"  {m:24s} {r['step_s'][m]:7.3f} s/step ±{r['spread_pct'][m]:4.1f}%  {r['s_per_image'][m]:8.2f} s/image  "
              f"{r['images_per_s'][m]:7.3f} images/s"
              + (f"  eps vs {r['eps_reference'][m]}: {d:.1e}" if d is not None else ""))
    for k, v in r["speedups"].items():
        print(f"  {k}: {v:.2f}x")
    if r.get("first_use_race_s"):
        print(f"  first-use tuning: {r['first_use_race_s']:.1f} s of races, untimed")
    return 0


def _bench_sample_parallel(args) -> int:
    from ..bench.sample_parallel import bench_sample_parallel
    if args.modes:
        print("autohc: --modes and --parallel are two benchmarks: give one", file=sys.stderr)
        return 2
    rec = recorder("sample", args)
    try:
        r = bench_sample_parallel(args.model, args.batch, image_size=args.image_size, samples=args.samples,
                                  warmup=args.warmup, rounds=args.rounds, cfg=args.cfg, layouts=args.parallel,
                                  ranks=args.ranks, threads=args.threads, precision=args.precision,
                                  progress=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"autohc: {e}", file=sys.stderr)
        return 2
    if rec is not None:
        print(f"autohc: result saved to {rec.save(r, threads=r['threads'])}", file=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']} batch {r['batch']} (x2 with guidance {r['cfg']:g}), {r['threads']} threads in all, "
          f"{r['precision']}; median of {r['timed']} guided sampler steps:")
    for m, s in r["step_s"].items():
        who = "one process" if m == "one" else f"{m} team of {r['ranks']}"
        extra = "" if m == "one" else (f"  {r['speedups'][m + ' vs one']:.2f}x one process, "
                                       f"eps vs one: {r['max_rel_eps_diff'][m]:.1e}")
        print(f"  {who:22s} {s:7.3f} s/step ±{r['spread_pct'][m]:4.1f}%{extra}")
    return 0


def cmd_bench_step(args) -> int:
    from ..bench.step import bench_step
    rec = recorder("step", args)
    modes = args.modes or list(STEP_BF16_MODES if args.precision == "bf16" else STEP_MODES[:4])
    r = bench_step(args.model, args.batch, image_size=args.image_size, steps=args.steps,
                   warmup=args.warmup, modes=modes, threads=args.threads,
                   torch_threads=args.torch_threads, first_use_tuning=not args.no_first_use_tuning,
                   profile=args.profile, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if rec is not None:
        print(f"autohc: result saved to {rec.save(r, threads=r['threads'])}", file=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']} batch {r['batch']}, {r['threads']} threads, median of {r['timed_steps']} steps:")
    peaks = sorted((r.get("peak_gflops_by_mode") or {}).values()) or [r["peak_gflops"]]
    shown = f"{peaks[0]:.0f}" if peaks[-1] - peaks[0] < 1 else f"{peaks[0]:.0f}-{peaks[-1]:.0f}"
    print(f"  ({r['step_gflop']:.1f} GFLOP per step in GEMMs and attention; FMA peak {shown} GFLOP/s, "
          "probed around each mode's steps)")
    for m in modes:
        bf16 = (r.get("pct_bf16_peak") or {}).get(m)
        print(f"  {m:20s} {r['step_s'][m]:.3f} s/step  {r['gflops'][m]:7.1f} GFLOP/s  "
              f"{r['pct_peak'][m]:4.1f}% of peak" + (f" ({bf16:.1f}% of the bf16 peak)" if bf16 else ""))
    for k in ("speedup_vs_stock", "speedup_vs_compiled"):
        if r.get(k) is not None:
            print(f"  autohc {k.replace('_', ' ')}: {r[k]:.2f}x")
        if r.get(f"autohc_compile_{k}") is not None:
            print(f"  autohc+compile {k.replace('_', ' ')}: {r[f'autohc_compile_{k}']:.2f}x")
    if r.get("first_use_race_s") or r.get("first_use_build_s"):
        print(f"  first-use tuning: {r['first_use_race_s']:.1f} s of races in the warm-up steps or "
              f"between steps, {r['first_use_build_s']:.1f} s of compiles beside them")
    for k, v in (r.get("bf16_speedups") or {}).items():
        print(f"  {k}: {v:.2f}x")
    if r.get("max_loss_rel_diff_bf16") is not None:
        print(f"  max relative loss difference of the -bf16 modes vs stock-bf16 over {args.steps} steps: "
              f"{r['max_loss_rel_diff_bf16']:.2e}")
    print(f"  max relative loss difference vs stock over {args.steps} steps: {r['max_loss_rel_diff']:.2e}; "
          f"peak RSS {r['peak_rss_gb']:.2f} GB")
    if r.get("copy_gbps"):
        print(f"  one thread's copy bandwidth: {r['copy_gbps']['before']:.1f} GB/s before the steps, "
              f"{r['copy_gbps']['after']:.1f} after (on a shared machine, what the neighbours' memory "
              "traffic leaves)")
    f = r.get("floors")
    if f:
        print(f"  floors: memory {f['memory_s']:.3f} s ({f['params'] / 1e6:.1f}M parameters x "
              f"{f['bytes_per_param']} B at the copy bandwidth, {f['copy_gbps']:.1f} GB/s at {r['threads']} threads); "
              "compute (flops / the unit's peak): "
              + ", ".join(f"{m} {f['compute_s'][m]:.3f} s ({r['step_s'][m] / max(f['compute_s'][m], f['memory_s']):.1f}x "
                          "the higher floor)" for m in modes))
    for m, k in (r.get("kernel_teams") or {}).items():
        print(f"  {m}: {k['jobs_per_step']:.0f} kernel team jobs a step, {k['in_teams_s']:.3f} s in them, "
              f"{k['outside_s']:.3f} s ({100 * k['outside_s'] / r['step_s'][m]:.0f} %) outside them (the "
              "interpreter, torch's dispatch and autograd, ATen's ops, one-thread calls)")
    if r.get("profile"):
        classes = list(next(iter(r["profile"].values()))["share"])
        print(f"  share of a profiled step: {'mode':15s}" + "".join(f"{c:>12s}" for c in classes))
        for m, p in r["profile"].items():
            print(f"  {'':26s}{m:15s}" + "".join(f"{100 * p['share'][c]:11.1f}%" for c in classes))
        print(f"  seconds of a profiled step: {'mode':13s}" + "".join(f"{c:>12s}" for c in classes)
              + "   GEMM GFLOP/s  attention GFLOP/s (inside the step)")
        for m, p in r["profile"].items():
            rate = p.get("gflops", {})
            print(f"  {'':28s}{m:13s}" + "".join(f"{p['seconds'][c]:11.3f}s" for c in classes)
                  + f"   {rate.get('gemm') or float('nan'):12.1f}  {rate.get('attention') or float('nan'):17.1f}")
    return 0
