"""Rectified-flow (flow-matching) noising, the Wan2.2 expert split and the training loss.

Convention (Wan2.x): with clean latents x0, Gaussian noise n and noise level sigma in [0, 1],
    x_sigma = (1 - sigma) * x0 + sigma * n,     target velocity v = n - x0,
and the model sees timestep t = 1000 * sigma. Wan2.2 A14B routes t >= boundary * 1000 to the
high-noise expert and t < boundary * 1000 to the low-noise expert; each expert is trained
only on its own range of sigma.
"""

from typing import NamedTuple

import torch
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

NUM_TRAIN_TIMESTEPS = 1000


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Map u in [0, 1] to sigma = shift*u / (1 + (shift-1)*u) (monotone; shift=1 is identity)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def unshift_sigma(sigma: float, shift: float) -> float:
    """Inverse of ``shift_sigma`` for a scalar: u = sigma / (shift - (shift-1)*sigma)."""
    return sigma / (shift - (shift - 1.0) * sigma)


def expert_sigma_range(expert: str, boundary: float) -> tuple[float, float]:
    """[low, high) range of sigma that ``expert`` trains on."""
    match expert:
        case "high_noise":
            return boundary, 1.0
        case "low_noise":
            return 0.0, boundary
        case "both":
            return 0.0, 1.0
        case _:
            raise ValueError(
                f"Unknown expert {expert!r}; expected 'high_noise', 'low_noise' or 'both'"
            )


def sample_timesteps(
    num: int, expert: str, boundary: float, shift: float, generator: torch.Generator
) -> torch.Tensor:
    """``num`` float32 timesteps t = 1000 * sigma from the shifted schedule, restricted to
    ``expert``'s range: t >= 1000 * boundary for "high_noise", t < 1000 * boundary for
    "low_noise" (checked on the float32 values the model sees).

    Draws u uniformly on the pre-image of the sigma range under ``shift_sigma``, so within
    the range the distribution is the shifted schedule's, conditioned on the range.
    """
    low, high = expert_sigma_range(expert, boundary)
    u_low, u_high = unshift_sigma(low, shift), unshift_sigma(high, shift)
    u = u_low + (u_high - u_low) * torch.rand(num, generator=generator, dtype=torch.float64)
    t = (shift_sigma(u, shift) * NUM_TRAIN_TIMESTEPS).to(torch.float32)
    # float32 rounding may land a draw on the wrong side of the boundary; pin it back.
    t_boundary = torch.tensor(boundary * NUM_TRAIN_TIMESTEPS, dtype=torch.float32)
    if expert == "low_noise":
        t = torch.minimum(t, torch.nextafter(t_boundary, torch.zeros_like(t_boundary)))
    elif expert == "high_noise":
        t = torch.maximum(t, t_boundary)
    return t


class FlowMatchingSample(NamedTuple):
    """One noised training example: model inputs and the regression target."""

    noisy_latents: torch.Tensor
    """x_sigma, same shape as the clean latents, float32."""
    timesteps: torch.Tensor
    """1000 * sigma, float32, shape [] for one sample or [B] for a batch."""
    target: torch.Tensor
    """Velocity n - x0, float32."""


def add_noise(
    latents: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor
) -> FlowMatchingSample:
    """Noise ``latents`` to sigma = timesteps / 1000 (``timesteps`` scalar or [B],
    broadcast over the remaining dimensions of ``latents``)."""
    x0 = latents.float()
    t = timesteps.float()
    sigma = (t / NUM_TRAIN_TIMESTEPS).reshape(t.shape + (1,) * (x0.dim() - t.dim()))
    noisy = (1.0 - sigma) * x0 + sigma * noise.float()
    return FlowMatchingSample(noisy_latents=noisy, timesteps=t, target=noise.float() - x0)


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors over all elements, in float32.

    torchtitan's Trainer divides the returned sum by the global count of label elements
    (``labels != -100``; every velocity element counts), so the logged and optimized loss
    is the mean squared error over all latent elements of the global batch.
    """
    return torch.nn.functional.mse_loss(pred.float(), target.float().detach(), reduction="sum")


def build_flow_matching_loss(job_config: JobConfig, **kwargs):
    """TrainSpec ``build_loss_fn``: ``flow_matching_loss``, compiled if configured."""
    del kwargs
    loss_fn = flow_matching_loss
    if job_config.compile.enable and "loss" in job_config.compile.components:
        logger.info("Compiling the Wan2.2 flow-matching loss with torch.compile")
        loss_fn = torch.compile(loss_fn, backend=job_config.compile.backend)
    return loss_fn
