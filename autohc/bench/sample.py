"""`autohc bench sample`: seconds per image and images/s of class-conditional DiT sampling
(DDIM, classifier-free guidance) with diffusers' DiTTransformer2DModel as users run it (fp32
eager, under torch.autocast bf16, torch.compile with freezing under autocast) against autohc
(its DiT with the fused operators under install(), fp32 and bf16 with frozen weights: what
`autohc sample` runs), on the same random weights (autohc's converted to diffusers' layout:
dit/convert.py `to_diffusers`). The `+autohc` modes are the drop-in: diffusers' model unchanged,
under install() (its Linears, matmuls and SDPA on autohc's kernels, the rest on ATen).

One sample of a mode is one sampler step of a batch: the guided forward (conditional and
null-class halves in one doubled batch, as DiTPipeline and the reference's forward_with_cfg
run it) and the fp32 DDIM update. The modes' steps are interleaved (diffusers, diffusers-bf16,
..., then again) on the same inputs, medians with their spread (bench/timing.py); a whole
image costs `sample_steps` such steps, so seconds per image = step median x sample_steps /
batch. Each mode's guided eps is compared on the same inputs with its fp32 form's (max abs
difference over the largest |eps|; `reference_of`): the bf16 modes' rounding.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..dit import precision
from ..dit.diffusion import GaussianDiffusion
from ..hw import cpu
from ..torch import dispatch as override
from ..tune import first_use
from . import timing
from .step import mode_parts, synthetic_model

MODES = ("diffusers", "diffusers-bf16", "diffusers-bf16+compile", "diffusers+autohc", "diffusers-bf16+autohc",
         "autohc", "autohc-bf16")
BASELINES = ("diffusers-bf16", "diffusers-bf16+compile", "diffusers")
# the modes whose speedups over each baseline are reported: every mode not a baseline (autohc's DiT,
# and diffusers' under install()), in reverse order: autohc-bf16, autohc, then the drop-in's
CONTENDERS = tuple(reversed([m for m in MODES if m not in BASELINES]))


def random_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """The reference initialises the adaLN modulations and the final layer to zero (its output
    is then zero at any input); for a benchmark whose outputs are compared, those get small
    random values too (normal, std 0.02), drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def diffusers_twin(model: torch.nn.Module, arch: dict) -> torch.nn.Module:
    """diffusers' DiTTransformer2DModel with `model`'s weights (autohc convert's mapping)."""
    from ..dit.convert import diffusers_config, to_diffusers
    from ..dit.model import config
    from ..dit.vae import diffusers_module
    diffusers = diffusers_module()
    twin = diffusers.DiTTransformer2DModel(**diffusers_config(arch))
    missing, unexpected = twin.load_state_dict(to_diffusers(model.state_dict(), config(arch["model"]).depth),
                                               strict=False)
    if missing or unexpected:
        raise RuntimeError(f"DiT -> DiTTransformer2DModel: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return twin.eval().requires_grad_(False)


def reference_of(name: str, present) -> str | None:
    """The mode a mode's eps is compared with: the fp32 form of the same code (autohc-bf16:
    autohc; diffusers-bf16 and its compiled form: diffusers); autohc fp32 against diffusers
    fp32, which differ as models, not by rounding: diffusers' DiT embeds the timestep with
    downscale_freq_shift=1 (frequencies exp(-ln(10^4) i / (half - 1))), the reference with
    i / half. None where that mode did not run."""
    ref = "diffusers" if name.startswith("diffusers") or name == "autohc" else "autohc"
    return ref if ref in present and ref != name else None


def _guided(forward, C: int, cfg: float):
    """eps(x, t, y) with guidance at scale cfg from forward(x2, t2, y2) -> out on the doubled
    batch (conditional, then null class), in fp32."""
    def eps(x, t, y, null):
        out = forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null)]))
        cond, uncond = out[:, :C].float().chunk(2)
        return uncond + cfg * (cond - uncond)
    return eps


class _Mode:
    def __init__(self, name: str, dit, twin, arch: dict, cfg: float, first_use_tuning: bool):
        self.name = name
        base, self.precision = mode_parts(name)
        self.on_autohc = base.startswith("autohc")
        self.installed = self.on_autohc or base.endswith("+autohc")     # (+autohc: the drop-in)
        C = arch["in_channels"]
        self.install_kw = {"first_use_tuning": first_use_tuning}
        if self.on_autohc:
            self.model = dit
            self.eps = _guided(lambda x, t, y: dit(x, t, y), C, cfg)
        else:
            forward = twin
            if base.endswith("+compile"):
                import torch._inductor.config as ic
                ic.freezing = True          # weights folded into the graph as constants, packed once
                forward = torch.compile(twin, mode="max-autotune")
            self.model = twin
            self.eps = _guided(lambda x, t, y: forward(x, timestep=t, class_labels=y).sample, C, cfg)
        self.times, self.outs = [], []
        self.null = arch["num_classes"]

    @contextlib.contextmanager
    def context(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if self.installed:
                stack.enter_context(override.installed(**self.install_kw))
            yield

    def step(self, diffusion: GaussianDiffusion, x, t, y, keep: bool) -> torch.Tensor:
        """One sampler step: the guided eps (under autocast for -bf16) and the fp32 DDIM update
        from t to t - 1000/steps."""
        with self.context():
            t0 = time.perf_counter()
            with precision.autocast(self.precision):
                eps = self.eps(x, t, y, self.null)
            x0 = diffusion._x0_from_eps(x, t, eps).clamp(-1, 1)
            ac_prev = diffusion._at(diffusion.alphas_cumprod, (t - 20).clamp(min=0), x)
            x_prev = ac_prev.sqrt() * x0 + (1 - ac_prev).sqrt() * eps
            dt = time.perf_counter() - t0
            if self.installed and first_use.enabled():
                first_use.finish_pending()      # untimed: races left by first-use tuning
        if keep:
            self.times.append(dt)
        self.outs.append(eps)
        return x_prev


def bench_sample(model: str = "DiT-S/2", batch: int = 4, *, image_size: int = 32, samples: int = 5,
                 warmup: int = 1, sample_steps: int = 50, cfg: float = 4.0, modes=MODES,
                 threads: int | None = None, first_use_tuning: bool = True, progress=None) -> dict:
    """Seconds per sampler step, per image and images/s of each mode (see the module doc)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if warmup < 0 or samples < 1:
        raise ValueError(f"--samples must be >= 1 and --warmup >= 0, got {samples} and {warmup}")
    if threads:
        torch.set_num_threads(threads)
    say = progress or (lambda m: None)
    was_installed = override.is_installed()
    override.uninstall()
    try:
        return _bench(model, batch, image_size, samples, warmup, sample_steps, cfg, list(modes),
                      first_use_tuning, say)
    finally:
        if was_installed:
            override.install()


def _bench(model, batch, image_size, samples, warmup, sample_steps, cfg, modes, first_use_tuning, say):
    from ..dit.train import autohc_ops
    torch.manual_seed(0)
    spent0 = first_use.spent()
    arch = {"model": model, "input_size": image_size, "in_channels": 4, "num_classes": 1000,
            "class_dropout": 0.1, "learn_sigma": True}
    dit = random_weights(synthetic_model(model, image_size, autohc_ops(True))).eval()
    twin = diffusers_twin(dit, arch) if any(not m.startswith("autohc") for m in modes) else None
    runs = [_Mode(m, dit, twin, arch, cfg, first_use_tuning) for m in modes]
    say(f"bench sample: {model}, batch {batch} (x2 for guidance), {torch.get_num_threads()} threads, "
        f"modes {modes}, steps interleaved")
    diffusion = GaussianDiffusion()
    g = torch.Generator().manual_seed(1)
    x = torch.randn((batch, 4, image_size, image_size), generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    ts = torch.linspace(999, 0, warmup + samples).round().long()
    from ..torch.frozen import frozen
    with frozen(dit):                   # one block for the whole run: each weight rounded once
        _steps(runs, diffusion, x, y, ts, warmup, samples, batch, say)
    return _summary(runs, model, batch, image_size, cfg, sample_steps, samples, spent0)


def _steps(runs, diffusion, x, y, ts, warmup, samples, batch, say):
    for i in range(warmup + samples):
        t = torch.full((batch,), int(ts[i]), dtype=torch.long)
        nxt = None
        for r in runs:
            x_r = r.step(diffusion, x, t, y, keep=i >= warmup)
            nxt = x_r if nxt is None else nxt
        x = nxt                         # every mode's next input: the first mode's step
        say(f"  step {i + 1}/{warmup + samples}{' (warm-up)' if i < warmup else ''}: "
            + ", ".join(f"{r.name} {r.times[-1]:.2f} s" if i >= warmup else r.name for r in runs))


def _summary(runs, model, batch, image_size, cfg, sample_steps, samples, spent0) -> dict:
    by_name = {r.name: r for r in runs}
    diff, refs = {}, {}
    for r in runs:
        ref = by_name.get(reference_of(r.name, by_name))
        refs[r.name] = ref.name if ref else None
        diff[r.name] = None if ref is None else max(float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)
                                                    for a, b in zip(r.outs, ref.outs))
    summary = {r.name: timing.summarize(r.times) for r in runs}
    step_s = {m: t.median for m, t in summary.items()}
    per_image = {m: s * sample_steps / batch for m, s in step_s.items()}
    speedups = {f"{a} vs {b}": step_s[b] / step_s[a] for a in CONTENDERS for b in BASELINES
                if a in step_s and b in step_s}
    isa, isa_why = cpu.bf16_isa()
    return {"model": model, "batch": batch, "image_size": image_size, "cfg": cfg,
            "sample_steps": sample_steps, "threads": torch.get_num_threads(), "timed": samples,
            "bf16_unit": isa, "bf16_unit_why": isa_why,
            "step_s": step_s, "spread_pct": {m: t.spread_pct for m, t in summary.items()},
            "s_per_image": per_image, "images_per_s": {m: 1.0 / v for m, v in per_image.items()},
            "speedups": speedups, "eps_reference": refs, "max_rel_eps_diff": diff,
            "first_use_race_s": round(first_use.spent()["race_s"] - spent0["race_s"], 2),
            "step_times": {r.name: r.times for r in runs}}
