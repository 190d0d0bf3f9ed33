"""Flow-matching image/video policy: a velocity model v(x_sigma, sigma, cond), a prompt
conditioner, and a decoder (identity: the built-in models work in pixel space; the latent
diffusers models in `regen.policies.flow_sd3`, `flow_flux`, `flow_qwenimage`, `flow_wan` and
`flow_hunyuan` subclass this one and decode with their VAE).

The built-in models are diffusers `UNet2DModel`s with tiny configs, conditioned through the
UNet's own class-embedding path (`class_embed_type="identity"`: the prompt vector is added
to the time embedding). Videos stack their frames as channels. The prompt conditioner is a
bag of word embeddings over the task's vocabulary, with a `<null>` prompt for classifier-
free guidance. On disk a policy is a folder:

    flow_policy.json     kind, sample shape, vocabulary
    unet/                diffusers folder (config.json, safetensors)
    prompt_encoder.safetensors
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from regen.errors import UserError

NULL = "<null>"


class PromptEncoder(nn.Module):
    """Mean of the prompt's word embeddings; unknown words share one embedding, the empty
    prompt is the learned `<null>` vector (the unconditional branch of guidance)."""

    def __init__(self, vocab: list[str], dim: int):
        super().__init__()
        self.vocab = [NULL, "<unk>", *vocab]
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.embed = nn.Embedding(len(self.vocab), dim)
        nn.init.normal_(self.embed.weight, std=0.5)

    def forward(self, prompts: list[str]) -> torch.Tensor:
        ids = [[self.index.get(w, 1) for w in p.lower().split()] or [0] for p in prompts]
        width = max(len(i) for i in ids)
        dev = self.embed.weight.device
        padded = torch.tensor([i + [0] * (width - len(i)) for i in ids], device=dev)
        mask = torch.tensor([[1.0] * len(i) + [0.0] * (width - len(i)) for i in ids], device=dev)
        e = self.embed(padded)
        return (e * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


@dataclass
class FlowSample:
    """A batch of B = prompts x group_size generated samples."""

    x0: torch.Tensor  # (B, *sample_shape) in model space: pixels [-1, 1] here, latents for VAE models
    prompts: list[str]  # (B,)
    sigmas: torch.Tensor  # (S+1,) the sampling grid, 1 -> 0
    states: torch.Tensor | None = None  # (B, S+1, *x0.shape[1:]) the trajectory (SDE methods)
    log_probs: torch.Tensor | None = None  # (B, S) per-step log-probs; 0 on ODE steps
    sde: torch.Tensor | None = None  # (S,) bool: the stochastic (trainable) steps
    means: list | None = None  # S x ((B, *x) on SDE steps, None elsewhere): the sampler's Gaussian means
    version: torch.Tensor | None = None  # (B,) long: weight version that sampled each row (rollout workers)

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: torch.Tensor) -> FlowSample:
        pick = (lambda t: None if t is None else t[idx.to(t.device)])  # noqa: E731
        return FlowSample(self.x0[idx], [self.prompts[i] for i in idx.tolist()], self.sigmas, pick(self.states),
                          pick(self.log_probs), self.sde, None if self.means is None else [pick(m) for m in self.means],
                          pick(self.version))

    def to(self, device) -> FlowSample:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return FlowSample(self.x0.to(device), self.prompts, self.sigmas, move(self.states), self.log_probs, self.sde,
                          None if self.means is None else [move(m) for m in self.means], self.version)

    @staticmethod
    def concat(parts: list[FlowSample]) -> FlowSample:
        """One batch from consecutive shares (torchrun ranks' or rollout actors' rows, in order)."""
        def cat(name):
            return None if any(getattr(p, name) is None for p in parts) else \
                torch.cat([getattr(p, name).to(parts[0].x0.device) for p in parts])

        means = None if any(p.means is None for p in parts) else \
            [None if m is None else torch.cat([p.means[i].to(m.device) for p in parts])
             for i, m in enumerate(parts[0].means)]
        return FlowSample(cat("x0"), [q for p in parts for q in p.prompts], parts[0].sigmas, cat("states"),
                          cat("log_probs"), parts[0].sde, means, cat("version"))


def draw_noise(gen: torch.Generator, B: int, shape: tuple, sde: torch.Tensor) -> tuple:
    """The noise of a rollout of B samples: the starting noise x_T, then one tensor per SDE step
    (None on ODE steps), drawn in that order from `gen` on the CPU."""
    x = torch.randn((B, *shape), generator=gen)
    return x, [torch.randn((B, *shape), generator=gen) if bool(s) else None for s in sde]


class FlowPolicy:
    # torchrun (regen/runtime/dist.py): the DDP wrapper around self.unet; the training network's
    # forward passes go through it (see _net), frozen copies and swapped-in EMAs do not.
    ddp_unet = None

    def __init__(self, unet, encoder: PromptEncoder, sample_shape: tuple[int, ...], device: torch.device,
                 kind: str = "shapes"):
        self.unet = unet.to(device)
        self.encoder = encoder.to(device)
        self.sample_shape = tuple(sample_shape)  # (C, H, W) or (F, C, H, W)
        self.device = device
        self.kind = kind

    # ---------------------------------------------------------------- building and saving

    @classmethod
    def builtin(cls, video: bool, seed: int, device: torch.device) -> FlowPolicy:
        """A fresh tiny UNet for 16x16 shapes (images) or 8-frame moving shapes (videos)."""
        from diffusers import UNet2DModel

        from regen.tasks import shapes

        torch.manual_seed(seed)
        frames = shapes.FRAMES if video else 1
        channels = 3 * frames
        unet = UNet2DModel(
            sample_size=shapes.RES, in_channels=channels, out_channels=channels, layers_per_block=1,
            block_out_channels=(32, 64, 64), down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
            norm_num_groups=8, class_embed_type="identity",
        )
        vocab = ["a", "at", "the", "moving", *shapes.COLOURS, *shapes.SHAPES, *shapes.POSITIONS, *shapes.DIRECTIONS]
        encoder = PromptEncoder(sorted(set(vocab)), dim=4 * 32)  # the UNet's time-embedding width
        shape = (frames, 3, shapes.RES, shapes.RES) if video else (3, shapes.RES, shapes.RES)
        return cls(unet, encoder, shape, device, "moving-shapes" if video else "shapes")

    @classmethod
    def load(cls, folder: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> FlowPolicy:
        from diffusers import UNet2DModel

        p = Path(folder).expanduser()
        meta_file = p / "flow_policy.json"
        if not meta_file.is_file():
            raise UserError(f"model.path: '{folder}' is not a regen flow model folder (no flow_policy.json)")
        meta = json.loads(meta_file.read_text())
        unet = UNet2DModel.from_pretrained(str(p / "unet"), torch_dtype=dtype)
        encoder = PromptEncoder(meta["vocab"], meta["dim"])
        encoder.load_state_dict(load_file(str(p / "prompt_encoder.safetensors")))
        return cls(unet, encoder.to(dtype), tuple(meta["sample_shape"]), device, meta["kind"])

    def save_pretrained(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.unet.save_pretrained(str(folder / "unet"), safe_serialization=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.encoder.state_dict().items()},
                  str(folder / "prompt_encoder.safetensors"))
        meta = {"kind": self.kind, "sample_shape": list(self.sample_shape), "vocab": self.encoder.vocab[2:],
                "dim": self.encoder.embed.embedding_dim}
        (folder / "flow_policy.json").write_text(json.dumps(meta, indent=1))

    export = save_pretrained  # pixel-space models: the checkpoint form is the exported form

    def parameters(self):
        return [*self.unet.parameters(), *self.encoder.parameters()]

    def train(self, mode: bool = True) -> None:
        self.unet.train(mode)
        self.encoder.train(mode)

    # ---------------------------------------------------------------- the velocity field
    # A condition is whatever `self.encoder(prompts)` returns: here a (B, D) tensor, for SD3 a
    # tuple of tensors; only `velocity` and `_cat_cond` look inside it.

    def _net(self, unet=None):
        """The network a velocity is computed with: `unet` (a frozen copy), else the policy's own
        (through its DDP wrapper under torchrun, so the update's gradients are averaged)."""
        net = unet or self.unet
        return self.ddp_unet if self.ddp_unet is not None and net is self.ddp_unet.module else net

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor, unet=None) -> torch.Tensor:
        """v(x_sigma, sigma, cond) = d x / d sigma; x (B, *sample_shape), sigma (B,), cond (B, D).
        unet: another network with the same config (the frozen reference, an EMA copy)."""
        B = x.shape[0]
        flat = x.reshape(B, -1, *x.shape[-2:])  # video frames as channels
        t = (sigma * 1000).to(flat.dtype)  # the UNet's timestep embedding expects 0..1000
        v = self._net(unet)(flat, t, class_labels=cond.to(flat.dtype)).sample
        return v.reshape(x.shape)

    def guided_velocity(self, x, sigma, cond, null, scale: float, unet=None) -> torch.Tensor:
        """Classifier-free guidance (Ho & Salimans 2022): v_null + scale * (v_cond - v_null)."""
        if scale == 1.0:
            return self.velocity(x, sigma, cond, unet)
        v = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), self._cat_cond(cond, null), unet)
        vc, vu = v.chunk(2)
        return vu + scale * (vc - vu)

    @staticmethod
    def _cat_cond(cond, null):
        """The conditional and unconditional batches as one (guidance in one forward pass)."""
        if isinstance(cond, torch.Tensor):
            return torch.cat([cond, null])
        return tuple(torch.cat([c, n]) for c, n in zip(cond, null))

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Samples -> pixels in [-1, 1], (B, 3, H, W) or (B, F, 3, H, W); identity in pixel space."""
        return x0

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        """The returned sample: pixels are clamped to their range (latent models override)."""
        return x.clamp(-1, 1)

    def flow_matching_loss(self, x0: torch.Tensor, prompts: list[str], gen: torch.Generator,
                           cond_dropout: float = 0.1, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rectified-flow pretraining loss (Liu et al. 2023; Lipman et al. 2023):
        sigma ~ U(0, 1), x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, mean squared
        error. A fraction cond_dropout of prompts is replaced by the empty one, so that the
        model also learns the unconditional field guidance needs.

        rows: the batch rows whose loss to compute (a torchrun rank's share); the randomness is
        drawn for the whole batch all the same, so each row sees the numbers it sees in one
        process. The mean is over those rows' elements."""
        B = x0.shape[0]
        drop = torch.rand(B, generator=gen) < cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        sigma = torch.rand(B, generator=gen).to(self.device)
        eps = torch.randn(x0.shape, generator=gen).to(self.device)
        if rows is not None:
            x0, sigma, eps, prompts = x0[rows], sigma[rows], eps[rows], [prompts[i] for i in rows.tolist()]
        s = sigma.view(len(sigma), *[1] * (x0.dim() - 1))
        xt = (1 - s) * x0 + s * eps
        v = self.velocity(xt, sigma, self.encoder(prompts))
        return (v.float() - (eps - x0).float()).pow(2).mean()

    # ---------------------------------------------------------------- sampling

    def sigmas(self, steps: int, shift: float | None) -> torch.Tensor:
        """(steps + 1,) sigma grid from 1 to 0 (flow.shift; null: the model's own, 1 here)."""
        from regen.samplers.flow import sigma_schedule

        return sigma_schedule(steps, 1.0 if shift is None else shift)

    def set_guidance_embed(self, value: float | None) -> None:
        """flow.guidance_embed, for models with a guidance embedding (FLUX-dev); config
        validation refuses it for the others."""
        if value is not None:
            raise UserError(f"flow.guidance_embed={value}: this {self.kind} model has no guidance embedding "
                            "(its guidance is flow.guidance, classifier-free)")

    @torch.no_grad()
    def sample_ode(self, prompts: list[str], n: int, gen: torch.Generator, steps: int = 20,
                   shift: float | None = 1.0, guidance: float = 1.0) -> FlowSample:
        """n samples per prompt (consecutive rows form a group) with the Euler ODE."""
        from regen.samplers.flow import euler_step

        prompts = [p for p in prompts for _ in range(n)]
        B = len(prompts)
        cond = self.encoder(prompts)
        null = self.encoder([""] * B)
        sigmas = self.sigmas(steps, shift).to(self.device)
        x = torch.randn((B, *self.sample_shape), generator=gen).to(self.device)
        for i in range(steps):
            v = self.guided_velocity(x, sigmas[i].expand(B), cond, null, guidance)
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        return FlowSample(self._finish(x), prompts, sigmas)

    @torch.no_grad()
    def rollout(self, prompts: list[str], n: int, noise, steps: int, sde: torch.Tensor,
                noise_level: float, sampler: str = "sde", shift: float | None = 1.0, guidance: float = 1.0,
                keep_states: bool = True, keep_means: bool = False, solver: str = "euler") -> FlowSample:
        """n samples per prompt; steps where `sde` (S,) is True are stochastic (Flow-GRPO SDE or
        CPS) and get a log-prob, the others are Euler ODE steps (log-prob 0). keep_states stores
        the trajectory, which the per-step losses re-score; keep_means the Gaussian mean of each
        SDE step (the behaviour policy's, for batches trained on after the weights moved).
        noise: (x_T (B, *sample_shape), [eps (B, *sample_shape) for each SDE step, None for the
        others]) for these rows, from `FlowPlan` (regen/modalities/flow.py: drawn for the whole
        batch and sliced, so a row's sample does not depend on which process drew it), or a
        torch.Generator to draw them from here. solver: the ODE steps' Euler or Heun step."""
        from regen.samplers.flow import cps_step, euler_step, heun_step, sde_step

        prompts = [p for p in prompts for _ in range(n)]
        B = len(prompts)
        if isinstance(noise, torch.Generator):
            noise = draw_noise(noise, B, self.sample_shape, sde)
        x_T, eps = noise
        cond, null = self.encoder(prompts), self.encoder([""] * B)
        sig = self.sigmas(steps, shift).tolist()
        x = x_T.to(self.device)
        states, logps, means = [x], torch.zeros(B, steps), [None] * steps
        for i in range(steps):
            v = self.guided_velocity(x, torch.full((B,), sig[i], device=self.device), cond, null, guidance)
            if bool(sde[i]):
                e = eps[i].to(self.device)
                out = (sde_step(x, v, sig[i], sig[i + 1], noise_level, sig[1], noise=e) if sampler == "sde"
                       else cps_step(x, v, sig[i], sig[i + 1], noise_level, noise=e))
                x, logps[:, i] = out.next, out.log_prob.cpu()
                means[i] = out.mean if keep_means else None
            elif solver == "heun":
                x = heun_step(x, v, lambda y, s: self.guided_velocity(y, torch.full((B,), float(s), device=self.device),
                                                                     cond, null, guidance), sig[i], sig[i + 1])
            else:
                x = euler_step(x, v, sig[i], sig[i + 1])
            if keep_states:
                states.append(x)
        return FlowSample(self._finish(x), prompts, torch.tensor(sig), torch.stack(states, 1) if keep_states else None,
                          logps, sde.clone(), means if keep_means else None)

    def step_logprobs(self, batch: FlowSample, noise_level: float, sampler: str = "sde", guidance: float = 1.0,
                      unet=None) -> tuple[torch.Tensor, list[torch.Tensor | None], list[float]]:
        """Re-score the stored transitions under the current weights (or `unet`, e.g. the
        reference): log-probs (B, S) (0 on ODE steps), the Gaussian means of the SDE steps
        (None elsewhere) and each step's std. Same code as sampling, so a fully on-policy
        first update has ratio exactly 1."""
        from regen.samplers.flow import cps_step, sde_step

        B, S = batch.x0.shape[0], len(batch.sigmas) - 1
        sig = batch.sigmas.tolist()
        cond, null = self.encoder(batch.prompts), self.encoder([""] * B)
        logps = torch.zeros(B, S, device=self.device)
        means: list[torch.Tensor | None] = [None] * S
        stds = [0.0] * S
        for i in torch.nonzero(batch.sde).flatten().tolist():
            x = batch.states[:, i]
            v = self.guided_velocity(x, torch.full((B,), sig[i], device=self.device), cond, null, guidance, unet)
            out = (sde_step(x, v, sig[i], sig[i + 1], noise_level, sig[1], prev_sample=batch.states[:, i + 1])
                   if sampler == "sde" else cps_step(x, v, sig[i], sig[i + 1], noise_level,
                                                     prev_sample=batch.states[:, i + 1]))
            logps[:, i], means[i], stds[i] = out.log_prob, out.mean, out.std
        return logps, means, stds

