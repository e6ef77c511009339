"""Wan2.2 diffusion transformer for torchtitan: model, flavors, data, loss, FSDP.

``build_wan22_train_spec()`` returns the TrainSpec that torchtitan_tide registers as
"wan22". It works with the stock ``torchtitan.train.Trainer``: the dataloader yields
``({"input": noisy latents, "timesteps": t, "text_emb": umT5 embeddings}, velocity)`` and
the loss is a sum of squared errors that the Trainer turns into a mean by dividing by the
global label element count. Run options live in the ``[wan22]`` TOML section
(``models.wan22.job_config``).
"""

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.protocols.train_spec import TrainSpec

from .args import Wan22ModelArgs, wan22_configs
from .data import build_wan22_dataloader, write_latent_folder
from .job_config import Wan22DataConfig
from .loss import build_flow_matching_loss, flow_matching_loss
from .model import Wan22Model
from .parallelize import parallelize_wan22

__all__ = [
    "Wan22DataConfig",
    "Wan22Model",
    "Wan22ModelArgs",
    "build_wan22_dataloader",
    "build_wan22_train_spec",
    "flow_matching_loss",
    "parallelize_wan22",
    "wan22_configs",
    "write_latent_folder",
]


def build_wan22_train_spec() -> TrainSpec:
    """The Wan2.2 TrainSpec (flavors "debugmodel", "t2v_a14b", "t2v_a14b_20layers",
    "ti2v_5b"); no pipelining, no tokenizer (text embeddings are precomputed)."""
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
