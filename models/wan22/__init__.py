"""Wan2.2 diffusion transformer for torchtitan: model, flavors, data, loss, FSDP.

``build_wan22_train_spec()`` returns the TrainSpec that torchtitan_tide registers as
"wan22". It works with the stock ``torchtitan.train.Trainer``: the dataloader yields
``({"input": noisy latents, "timesteps": t, "text_emb": umT5 embeddings}, velocity)`` and
the loss is a sum of squared errors that the Trainer turns into a mean by dividing by the
global label element count. Run options live in the ``[wan22]`` TOML section
(``models.wan22.job_config``).

Exports load on first use (PEP 562): ``torchtitan_tide.config`` imports
``models.wan22.job_config``, and the launcher must not pay for torchtitan's import there.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Wan22DataConfig": ".job_config",
    "Wan22Model": ".model",
    "Wan22ModelArgs": ".args",
    "build_wan22_dataloader": ".data",
    "flow_matching_loss": ".loss",
    "parallelize_wan22": ".parallelize",
    "wan22_configs": ".args",
    "write_latent_folder": ".data",
}

__all__ = sorted([*_EXPORTS, "build_wan22_train_spec"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_wan22_train_spec():
    """The Wan2.2 TrainSpec (flavors "debugmodel", "t2v_a14b", "t2v_a14b_20layers",
    "ti2v_5b"); no pipelining, no tokenizer (text embeddings are precomputed)."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.protocols.train_spec import TrainSpec

    from .args import wan22_configs
    from .data import build_wan22_dataloader
    from .loss import build_flow_matching_loss
    from .model import Wan22Model
    from .parallelize import parallelize_wan22

    return TrainSpec(
        model_cls=Wan22Model,
        model_args=wan22_configs,
        parallelize_fn=parallelize_wan22,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_wan22_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=build_flow_matching_loss,
    )
