"""The ``[wan22]`` TOML section: data source, expert choice and noise schedule.

Merge it into a run through ``[job] custom_config_module`` (a module whose ``JobConfig``
dataclass has a ``wan22: Wan22DataConfig`` field; this module's ``JobConfig`` is one). A run
whose config lacks the section gets the defaults below (``wan22_data_config``).
"""

from dataclasses import dataclass, field
from typing import Any

EXPERTS = ("high_noise", "low_noise", "both")
DATA_SOURCES = ("synthetic", "folder")


@dataclass
class Wan22DataConfig:
    source: str = "synthetic"
    """Where clean latents come from. "synthetic": seeded Gaussian latents and text embeddings
    of the shapes below (benchmarks, tests). "folder": precomputed latents and umT5 embeddings
    in the on-disk format of ``models/wan22/data.py`` under ``folder``."""
    folder: str = ""
    """Folder holding ``index.json`` and the sample files (source = "folder"). Empty means
    ``training.dataset_path``."""
    latent_frames: int = 21
    """Latent frames F of synthetic samples (81 video frames / VAE time stride 4, +1)."""
    latent_height: int = 60
    """Latent height H of synthetic samples (480 px / VAE stride 8)."""
    latent_width: int = 104
    """Latent width W of synthetic samples (832 px / VAE stride 8)."""
    expert: str = "both"
    """Which Wan2.2 expert this run trains: "high_noise" samples timesteps t >= boundary*1000,
    "low_noise" samples t < boundary*1000, "both" samples the whole range (one model)."""
    boundary: float = 0.875
    """Noise level sigma (= t / 1000) where the experts switch; 0.875 for T2V-A14B."""
    timestep_shift: float = 5.0
    """Flow-matching shift k: sigma = k*u / (1 + (k-1)*u) for u uniform, so k > 1 favours high
    noise. Wan's inference shift is 12.0 for T2V-A14B and 5.0 for TI2V-5B; its training shift
    is unpublished."""
    seed: int = 0
    """Base seed of timesteps, noise and synthetic samples; a sample's draws depend only on
    (seed, its global index), so they are the same for any dp degree and after resume."""


@dataclass
class JobConfig:
    """Extension of torchtitan's JobConfig with the ``[wan22]`` section."""

    wan22: Wan22DataConfig = field(default_factory=Wan22DataConfig)


def validate_data_config(config: Wan22DataConfig) -> None:
    """Raise ``ValueError`` naming the bad field of ``config``."""
    if config.source not in DATA_SOURCES:
        raise ValueError(f"wan22.source={config.source!r}; expected one of {DATA_SOURCES}")
    if config.expert not in EXPERTS:
        raise ValueError(f"wan22.expert={config.expert!r}; expected one of {EXPERTS}")
    if not 0.0 < config.boundary < 1.0:
        raise ValueError(f"wan22.boundary={config.boundary}; expected 0 < boundary < 1")
    if config.timestep_shift <= 0.0:
        raise ValueError(f"wan22.timestep_shift={config.timestep_shift}; expected > 0")
    for name in ("latent_frames", "latent_height", "latent_width"):
        if getattr(config, name) <= 0:
            raise ValueError(f"wan22.{name}={getattr(config, name)}; expected > 0")


def wan22_data_config(job_config: Any) -> Wan22DataConfig:
    """The validated ``[wan22]`` section of ``job_config``, or the defaults if absent."""
    config = getattr(job_config, "wan22", None)
    if config is None:
        config = Wan22DataConfig()
    validate_data_config(config)
    return config
