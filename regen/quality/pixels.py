"""Pixel-level comparisons through torchmetrics: SSIM and PSNR of each sample against its
aligned reference (images, or videos frame by frame), and the reference-free temporal
consistency of a video (SSIM between consecutive frames). Inputs are uint8 arrays shaped
(N, H, W, C) or (N, F, H, W, C), as the rewards see them."""

from __future__ import annotations

import numpy as np
import torch

PSNR_CAP_DB = 100.0  # identical pixels give infinite PSNR; capped so a mean stays a number


def _frames(media: np.ndarray) -> torch.Tensor:
    """(N * F, C, H, W) float in [0, 255]: every frame of every sample."""
    x = torch.from_numpy(np.ascontiguousarray(media)).float()
    return x.reshape(-1, *x.shape[-3:]).movedim(-1, 1)


def _kernel(h: int, w: int) -> tuple[int, float]:
    """SSIM's Gaussian window (11 px, sigma 1.5; Wang et al. 2004), narrowed for images smaller than it."""
    size = min(11, h - (h % 2 == 0), w - (w % 2 == 0))
    return size, 1.5 * size / 11


def ssim(fake: np.ndarray, ref: np.ndarray) -> float:
    """Mean SSIM over samples (and frames) of each sample against the reference at the same index."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn

    _same(fake, ref)
    a, b = _frames(fake), _frames(ref)
    size, sigma = _kernel(a.shape[-2], a.shape[-1])
    return float(ssim_fn(a, b, data_range=255.0, kernel_size=size, sigma=sigma))


def psnr(fake: np.ndarray, ref: np.ndarray) -> float:
    """Mean over samples of each one's PSNR (dB, all its frames together) against its reference."""
    from torchmetrics.functional.image import peak_signal_noise_ratio as psnr_fn

    _same(fake, ref)
    a = torch.from_numpy(np.ascontiguousarray(fake)).double()
    b = torch.from_numpy(np.ascontiguousarray(ref)).double()
    dims = tuple(range(1, a.dim()))
    per = psnr_fn(a, b, data_range=255.0, reduction="none", dim=dims)
    return float(per.clamp(max=PSNR_CAP_DB).mean())


def temporal_ssim(videos: np.ndarray) -> float:
    """Mean SSIM between consecutive frames: 1 for a still video, low for flicker."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn

    if videos.ndim != 5 or videos.shape[1] < 2:
        raise ValueError(f"temporal consistency needs videos of 2 or more frames, got shape {videos.shape}")
    x = torch.from_numpy(np.ascontiguousarray(videos)).float().movedim(-1, 2)  # (N, F, C, H, W)
    a, b = x[:, :-1].reshape(-1, *x.shape[2:]), x[:, 1:].reshape(-1, *x.shape[2:])
    size, sigma = _kernel(a.shape[-2], a.shape[-1])
    return float(ssim_fn(a, b, data_range=255.0, kernel_size=size, sigma=sigma))


def _same(fake: np.ndarray, ref: np.ndarray) -> None:
    if fake.shape != ref.shape:
        raise ValueError(f"SSIM/PSNR compare each sample with its reference: shapes {fake.shape} and {ref.shape} differ")
