"""`autohc encode` (images -> VAE latents, once) and `autohc convert` (DiT weights between
autohc, facebookresearch/DiT and diffusers): parsers and runners."""
from __future__ import annotations

import argparse
import json
import sys

from .argtypes import output_dir, positive_int, signal_name

ENCODE_EPILOG = """examples:
  autohc encode --data folder:imgs/ --vae stabilityai/sd-vae-ft-ema --image-size 256 --out latents/
  autohc encode --data folder:imgs/ --vae ./sd-vae-ft-mse --image-size 256 --flip --out latents/
  autohc encode --data folder:imgs/ --vae ./sd-vae-ft-ema --image-size 256 --precision fp32 --out latents-fp32/
  torchrun --nproc-per-node 4 -m autohc.cli encode --data folder:imgs/ --vae ./sd-vae-ft-ema --image-size 256 --threads 2 --out latents/
  autohc train --model DiT-XL/2 --data latents:latents/ --out runs/xl
--vae is a diffusers AutoencoderKL: a folder (save_pretrained) or a hub id. With internet,
`--vae stabilityai/sd-vae-ft-ema` downloads it once into the Hugging Face cache; without, point
it at a local copy. A stopped encode resumes: run the same command again (in the precision
it started in: meta.json records it; another one is refused, exit 2).
SIGTERM or --stop-signal (default USR1) ends it after the batch in flight, exit 75.
Under torchrun, mpirun or srun the ranks share the batches (one file, the same as one
process's); a stopped run continues at any number of ranks."""

CONVERT_EPILOG = """formats:
  autohc      an autohc checkpoint without optimizer state (for sample, eval, train --init)
  dit         a facebookresearch/DiT state dict (EMA weights, as DiT-XL-2-256x256.pt; .pt, or
              .safetensors by the suffix), which the reference's sample.py loads
  diffusers   a DiTTransformer2DModel folder, or a whole DiTPipeline folder (transformer, vae,
              DDPM scheduler) when the model's VAE is known (latents:DIR training) or --vae is given
examples:
  autohc convert DiT-XL-2-256x256.pt xl.pt --to autohc
  autohc convert runs/xl dit-xl-finetuned.pt --to dit
  autohc convert runs/xl pipeline/ --to diffusers     # DiTPipeline.from_pretrained("pipeline/")
  autohc convert pipeline/ back.pt --to autohc"""


def add_parsers(sub) -> None:
    e = sub.add_parser("encode", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="encode a folder of class images into VAE latents for --data latents:DIR",
                       description="Encodes every image of a class-per-subfolder data set once through a VAE\n"
                                   "(center crop and resize as facebookresearch/DiT, optional flipped copies)\n"
                                   "into a memory-mapped latent data set, batch by batch, resumable.",
                       epilog=ENCODE_EPILOG)
    e.add_argument("--data", required=True, metavar="folder:PATH",
                   help="the images: one subfolder per class (its name is the class name)")
    e.add_argument("--vae", required=True, metavar="PATH_OR_ID", help="a diffusers AutoencoderKL")
    e.add_argument("--out", required=True, metavar="DIR", type=output_dir, help="the latent data set's folder")
    e.add_argument("--image-size", type=positive_int, default=None,
                   help="center-crop and resize every image to N x N (default: the images' own "
                        "size, which must then be one square size)")
    e.add_argument("--flip", action="store_true", help="also encode a horizontally flipped copy of each image")
    e.add_argument("--batch", type=positive_int, default=16, help="images per VAE call (default: 16)")
    e.add_argument("--seed", type=int, default=0, help="seed of the posterior draws (default: 0)")
    e.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                   help="the VAE's encoder forward in fp32, or bf16 under torch.autocast('cpu', "
                        "bfloat16) (bf16 convolutions, the posterior's draw in fp32); auto (default): "
                        "bf16 where the CPU multiplies bf16 in hardware (AMX, AVX512_BF16), else fp32. "
                        "The latents are stored in fp32 either way; meta.json records the precision "
                        "that ran (a resume must run the same) and the summary says which and why")
    e.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    e.add_argument("--stop-signal", type=signal_name, default="USR1", metavar="SIG",
                   help="besides SIGTERM, the signal that ends the encode after the batch in flight "
                        "(exit 75; the same command continues) (default: USR1)")
    e.add_argument("--json", action="store_true", help="print a JSON summary")

    c = sub.add_parser("convert", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="convert DiT weights between autohc, facebookresearch/DiT and diffusers",
                       description="Reads a DiT checkpoint in any of the three formats (safely: no pickled\n"
                                   "objects are run) and writes it in the one --to names.",
                       epilog=CONVERT_EPILOG)
    c.add_argument("src", metavar="IN", help="checkpoint file or folder (autohc run folder: its newest)")
    c.add_argument("dst", metavar="OUT", help="file (autohc, dit) or new folder (diffusers)")
    c.add_argument("--to", required=True, choices=["autohc", "dit", "diffusers"], help="output format")
    c.add_argument("--vae", default=None, metavar="PATH_OR_ID",
                   help="diffusers: write a DiTPipeline with this VAE (default: the model's own, if known)")
    c.add_argument("--force", action="store_true", help="overwrite an existing OUT file")


def cmd_encode(args) -> int:
    """0 done, 1 an error (a bad launch, a rank that died), 2 bad input, 75 stopped by a signal.
    Under torchrun, mpirun or srun the ranks share the batches (encode.encode_folder); rank 0
    alone prints."""
    from ..dit.data import InputError
    from ..dit.encode import Elsewhere, encode_folder
    from ..runtime import dist, preempt
    kind, _, path = args.data.partition(":")
    if kind != "folder" or not path:
        raise InputError(f"--data {args.data!r}: expected folder:PATH")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    with preempt.StopSignals(preempt.stop_signals(args.stop_signal)) as stop:
        try:
            launch = dist.init()            # world 1 without a launcher
        except dist.LaunchError as e:
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        lead = launch.rank == 0
        try:
            r = encode_folder(path, args.vae, args.out, image_size=args.image_size, flip=args.flip,
                              batch=args.batch, seed=args.seed, precision=args.precision,
                              progress=lead and not args.no_progress,
                              log=(lambda m: print(m, file=sys.stderr, flush=True)) if lead else None, stop=stop)
        except Elsewhere as e:              # every rank exits 2; rank 0 says why
            if lead:
                print(f"autohc: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:           # a collective that failed: one line per rank
            if launch.world == 1:
                raise
            print(f"autohc: {dist.peer_failure(launch, 'encode', e)}", file=sys.stderr)
            return 1
        finally:
            dist.shutdown()
    if not lead:
        return preempt.EXIT_PREEMPTED if r["stopped_by"] else 0
    if r["stopped_by"]:
        total = r["shape"][0] // (2 if r["flip"] else 1)       # the images; rows hold their flips too
        print(f"autohc encode: {r['stopped_by']} at image {r['done']} of {total}: stopped, the rows so far "
              f"kept in {args.out}; the same command continues (exit {preempt.EXIT_PREEMPTED})", file=sys.stderr)
        if args.json:
            print(json.dumps(r, indent=2))
        return preempt.EXIT_PREEMPTED
    ranks = f" over {launch.world} ranks ({launch.launcher})" if launch.world > 1 else ""
    if args.json:
        print(json.dumps(r, indent=2))
    elif r["new_images"] == 0:
        print(f"autohc: {args.out} already holds all {r['images']} latents ({r['precision']})")
    else:
        print(f"autohc: {r['new_images']} images encoded in {r['seconds']:.1f} s ({r['images_per_s']:.1f} images/s"
              f"{ranks}), the VAE in {r['precision']} ({r['precision_why']}); {r['images']} latents "
              f"{tuple(r['shape'][1:])} of {len(r['classes'])} classes in {args.out}; train with "
              f"--data latents:{args.out}")
    return 0


def cmd_convert(args) -> int:
    from pathlib import Path
    from ..dit import convert
    from .argtypes import output_dir, output_file
    out = Path(args.dst)
    if args.vae is not None and args.to != "diffusers":
        raise convert.CheckpointError(f"--vae is for --to diffusers (a DiTPipeline); --to {args.to} "
                                      "writes the transformer's weights alone")
    try:                                # a place that cannot be written: said before reading IN
        (output_dir if args.to == "diffusers" else output_file)(args.dst)
    except argparse.ArgumentTypeError as e:
        raise convert.CheckpointError(f"OUT {e}") from None
    if args.to != "diffusers" and out.exists() and not args.force:
        raise convert.CheckpointError(f"{out}: exists; pass --force to overwrite it")
    if args.to != "diffusers" and out.is_dir():
        raise convert.CheckpointError(f"{out}: is a folder; --to {args.to} writes a file")
    w = convert.read(args.src)
    _check_loads(w)
    convert.write(w, args.to, out, vae=args.vae)
    convert.warn(w.notes)
    print(f"autohc: {w.arch['model']} ({w.arch['num_classes']} classes, {w.arch['in_channels']} x "
          f"{w.arch['input_size']} x {w.arch['input_size']}) from {w.source} -> {out} ({args.to})")
    return 0


def _check_loads(w) -> None:
    """The weights load into autohc's model of their arch (strict), or one clear error."""
    from ..dit import convert
    from ..dit.train import build_model
    m = build_model(w.arch)
    for name, sd in (("model", w.model), ("ema", w.ema)):
        if sd is None:
            continue
        try:
            m.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise convert.CheckpointError(f"{w.source}: its {name} weights do not fit {w.arch['model']} "
                                          f"({' '.join(first[1:2]).strip()[:200]})") from None
