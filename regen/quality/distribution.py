"""Distances between two sets of feature vectors (generated vs reference): FID and KID through
torchmetrics, improved precision and recall as a pure function.

FID (Heusel et al. 2017): ||mu_g - mu_r||^2 + Tr(S_g + S_r - 2 (S_g S_r)^1/2) of the Gaussians
fitted to the features. Biased for small sets (it grows as 1/N), so compare runs at the same
sample count. KID (Binkowski et al. 2018, eq. 4): the unbiased MMD^2 with the cubic polynomial
kernel k(x, y) = (x.y / d + 1)^3, averaged over random subsets; 0 in expectation for two sets
from one distribution, at any size.
"""

from __future__ import annotations

import warnings

import torch


class _Given(torch.nn.Module):
    """torchmetrics' metrics run a feature network on what they are given: here the features
    are already computed (once per sample, reused across metrics), so the network is identity."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def fid(fake: torch.Tensor, real: torch.Tensor) -> float:
    from torchmetrics.image.fid import FrechetInceptionDistance

    _need(fake, real, 2, "FID")
    m = FrechetInceptionDistance(feature=_Given(fake.shape[1]))
    m.update(real.double(), real=True)
    m.update(fake.double(), real=False)
    return max(float(m.compute()), 0.0)  # rounding can leave -1e-12 for identical sets


def kid(fake: torch.Tensor, real: torch.Tensor, subsets: int = 50, subset_size: int = 1000,
        seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the unbiased MMD^2 over `subsets` random subsets of min(subset_size, N)."""
    from torchmetrics.image.kid import KernelInceptionDistance

    _need(fake, real, 2, "KID")
    size = min(subset_size, len(fake), len(real))
    with warnings.catch_warnings():  # "saves all features in a buffer": here they are already in memory
        warnings.simplefilter("ignore", UserWarning)
        m = KernelInceptionDistance(feature=_Given(fake.shape[1]), subsets=subsets, subset_size=size)
    m.update(real.double(), real=True)
    m.update(fake.double(), real=False)
    with torch.random.fork_rng(devices=[]):  # torchmetrics draws its subsets from the global RNG: keep training's
        torch.manual_seed(seed)
        mean, std = m.compute()
    return float(mean), float(std)


def precision_recall(fake: torch.Tensor, real: torch.Tensor, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019, eq. 1-3; k = 3 as in the paper).

    Each set's manifold is the union of balls around its points, each ball's radius the
    distance to that point's k-th nearest neighbour in its own set. Precision: the share of
    generated samples inside the reference manifold (fidelity). Recall: the share of reference
    samples inside the generated manifold (diversity: a collapsed model covers few)."""
    _need(fake, real, k + 1, "precision/recall")
    fake, real = fake.double(), real.double()

    def radii(x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, x)
        return d.kthvalue(k + 1, dim=1).values  # the +1 skips the point itself (distance 0)

    def inside(points: torch.Tensor, centres: torch.Tensor, r: torch.Tensor) -> float:
        return (torch.cdist(points, centres) <= r[None, :]).any(dim=1).double().mean().item()

    return inside(fake, real, radii(real)), inside(real, fake, radii(fake))


def _need(fake: torch.Tensor, real: torch.Tensor, n: int, what: str) -> None:
    if len(fake) < n or len(real) < n:
        raise ValueError(f"{what} needs at least {n} generated and {n} reference samples "
                         f"(got {len(fake)} and {len(real)})")
