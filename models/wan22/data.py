"""Wan2.2 training data: precomputed latents + text embeddings, noised for flow matching.

Two sources of clean (latents, text embedding) pairs feed one dataset that adds noise:

* ``SyntheticLatents``: seeded Gaussian tensors of the configured shapes (benchmarks, tests).
* ``LatentFolder``: a user-given folder in the on-disk format below.

On-disk format ``wan22-latents-v1`` (write it with ``write_latent_folder``)::

    <folder>/index.json
        {"format": "wan22-latents-v1",
         "latent_shape": [C, F, H, W],      # shared by every sample (no bucketing)
         "text_dim": 4096,
         "samples": ["000000.pt", ...]}     # paths relative to <folder>
    <folder>/<sample>.pt                     # torch.save of a dict of two tensors:
        "latents":  [C, F, H, W]  float32 / bfloat16 / float16 VAE latents, already
                                  normalized the way the VAE's users expect (Wan: per-channel
                                  mean/std of the VAE), F = 1 + (frames - 1) / 4
        "text_emb": [L, text_dim] umT5-XXL last hidden states of the prompt, L <= text_len
                                  (trimmed to the prompt's tokens or zero-padded; the model
                                  zero-pads to text_len like Wan)

Every sample in the stream has a global index g; rank r of W data-parallel ranks takes
g = r, r + W, r + 2W, ... Its timestep and noise (and, for the synthetic source, its
latents and text) are drawn from a generator seeded by hash(seed, g), so a step's batch is
the same for a given dp degree regardless of restarts, and checkpoints store only a counter.
"""

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.config import JobConfig

from .args import Wan22ModelArgs, wan22_configs
from .job_config import Wan22DataConfig, wan22_data_config
from .loss import add_noise, sample_timesteps

FORMAT = "wan22-latents-v1"
INDEX_FILE = "index.json"
LATENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Streams of random draws per sample, so data and noise never share a generator.
_DATA_STREAM, _NOISE_STREAM, _SHUFFLE_STREAM = 0, 1, 2


def seeded_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A CPU generator whose seed is a hash of (seed, stream, index)."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, stream, index), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


class LatentSource(Protocol):
    """Clean training pairs addressed by a global sample index."""

    @property
    def num_samples(self) -> int | None:
        """Number of distinct samples; None for an unbounded (synthetic) source."""
        ...

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents [C, F, H, W], text_emb [L, text_dim]) of sample ``index``."""
        ...


@dataclass
class SyntheticLatents:
    """Gaussian latents [C, F, H, W] and text embeddings [text_len, text_dim] per index."""

    latent_shape: tuple[int, int, int, int]
    text_len: int
    text_dim: int
    seed: int

    @property
    def num_samples(self) -> None:
        return None

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = seeded_generator(self.seed, _DATA_STREAM, index)
        latents = torch.randn(self.latent_shape, generator=generator)
        text_emb = torch.randn(self.text_len, self.text_dim, generator=generator)
        return latents, text_emb


class LatentFolder:
    """Reader of a ``wan22-latents-v1`` folder, validated against the model's shapes.

    Raises ``FileNotFoundError`` for a missing folder, index or sample file and
    ``ValueError`` for a malformed index or a tensor of the wrong shape or dtype; every
    message names the offending path.
    """

    def __init__(self, folder: str | Path, in_channels: int, text_dim: int, text_len: int):
        self.folder = Path(folder)
        self.text_dim, self.text_len = text_dim, text_len
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"Wan2.2 data folder {str(self.folder)!r} does not exist or is not a "
                f"directory (set [wan22] folder or training.dataset_path)"
            )
        index_path = self.folder / INDEX_FILE
        if not index_path.is_file():
            raise FileNotFoundError(
                f"{index_path} is missing; a Wan2.2 data folder needs an {INDEX_FILE} "
                f"(see models/wan22/data.py, format {FORMAT!r})"
            )
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{index_path} is not valid JSON: {err}") from err
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: 'format' must be {FORMAT!r}")
        for key in ("latent_shape", "text_dim", "samples"):
            if key not in index:
                raise ValueError(f"{index_path}: missing key {key!r}")
        shape = tuple(index["latent_shape"])
        if len(shape) != 4 or not all(isinstance(n, int) and n > 0 for n in shape):
            raise ValueError(f"{index_path}: latent_shape {shape} must be 4 positive ints")
        if shape[0] != in_channels:
            raise ValueError(
                f"{index_path}: latents have {shape[0]} channels, the model expects {in_channels}"
            )
        if index["text_dim"] != text_dim:
            raise ValueError(
                f"{index_path}: text_dim {index['text_dim']}, the model expects {text_dim}"
            )
        if not index["samples"]:
            raise ValueError(f"{index_path}: 'samples' is empty")
        self.latent_shape: tuple[int, int, int, int] = shape  # type: ignore[assignment]
        self.paths = [self.folder / name for name in index["samples"]]
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} sample file(s) listed in {index_path} are missing, "
                f"first: {missing[0]}"
            )

    @property
    def num_samples(self) -> int:
        return len(self.paths)

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.paths[index]
        sample = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(sample, dict) or not {"latents", "text_emb"} <= sample.keys():
            raise ValueError(f"{path}: expected a dict with 'latents' and 'text_emb'")
        latents, text_emb = sample["latents"], sample["text_emb"]
        if tuple(latents.shape) != self.latent_shape or latents.dtype not in LATENT_DTYPES:
            raise ValueError(
                f"{path}: latents are {latents.dtype} {list(latents.shape)}, expected "
                f"float32/bfloat16/float16 {list(self.latent_shape)}"
            )
        if (
            text_emb.dim() != 2
            or text_emb.shape[1] != self.text_dim
            or not 0 < text_emb.shape[0] <= self.text_len
        ):
            raise ValueError(
                f"{path}: text_emb is {list(text_emb.shape)}, expected [L, {self.text_dim}] "
                f"with 1 <= L <= {self.text_len}"
            )
        return latents, text_emb


def write_latent_folder(
    folder: str | Path, samples: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> Path:
    """Write (latents [C, F, H, W], text_emb [L, text_dim]) pairs as a ``wan22-latents-v1``
    folder (``000000.pt``, ... plus ``index.json``); all latents must share one shape."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    latent_shape: list[int] | None = None
    text_dim: int | None = None
    for i, (latents, text_emb) in enumerate(samples):
        if latent_shape is None:
            latent_shape, text_dim = list(latents.shape), int(text_emb.shape[-1])
        if list(latents.shape) != latent_shape or text_emb.shape[-1] != text_dim:
            raise ValueError(
                f"sample {i}: latents {list(latents.shape)} / text_dim "
                f"{text_emb.shape[-1]} differ from sample 0 ({latent_shape} / {text_dim})"
            )
        name = f"{i:06d}.pt"
        torch.save(
            {"latents": latents.contiguous(), "text_emb": text_emb.contiguous()}, folder / name
        )
        names.append(name)
    if not names:
        raise ValueError("write_latent_folder needs at least one sample")
    index = {"format": FORMAT, "latent_shape": latent_shape, "text_dim": text_dim, "samples": names}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return folder


class Wan22FlowMatchingDataset(IterableDataset, Stateful):
    """Yields ({"input": x_t, "timesteps": t, "text_emb": text}, velocity target) per sample.

    ``input`` [C, F, H, W] and the target are float32, ``timesteps`` a float32 scalar in
    this expert's range, ``text_emb`` [text_len, text_dim] float32, zero-padded (as the
    model would pad it) so that samples with different prompt lengths batch together.

    The k-th sample of rank ``dp_rank`` is global sample g = k * dp_world_size + dp_rank;
    a finite source is read in a fresh seeded permutation each epoch. With
    ``infinite=False`` a finite source stops before the first round in which some rank
    would run out, so all ranks yield equally; an unbounded source never stops.
    """

    def __init__(
        self,
        source: LatentSource,
        data_config: Wan22DataConfig,
        text_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
    ):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} not in [0, dp_world_size={dp_world_size})")
        self.source = source
        self.data_config = data_config
        self.text_len = text_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.infinite = infinite
        self._sample_idx = 0
        self._permutation_epoch = -1
        self._permutation: torch.Tensor | None = None

    def _source_index(self, global_index: int) -> int:
        size = self.source.num_samples
        if size is None:  # unbounded: every index is its own sample
            return global_index
        epoch, offset = divmod(global_index, size)
        if epoch != self._permutation_epoch:
            generator = seeded_generator(self.data_config.seed, _SHUFFLE_STREAM, epoch)
            self._permutation = torch.randperm(size, generator=generator)
            self._permutation_epoch = epoch
        assert self._permutation is not None
        return int(self._permutation[offset])

    def sample(self, global_index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The noised training pair of global sample ``global_index``."""
        latents, text_emb = self.source.get(self._source_index(global_index))
        cfg = self.data_config
        generator = seeded_generator(cfg.seed, _NOISE_STREAM, global_index)
        timestep = sample_timesteps(1, cfg.expert, cfg.boundary, cfg.timestep_shift, generator)[0]
        noise = torch.randn(latents.shape, generator=generator)
        noised = add_noise(latents, timestep, noise)
        inputs = {
            "input": noised.noisy_latents,
            "timesteps": noised.timesteps,
            "text_emb": F.pad(text_emb.float(), (0, 0, 0, self.text_len - len(text_emb))),
        }
        return inputs, noised.target

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        size = self.source.num_samples
        finite = not self.infinite and size is not None
        while not finite or self._sample_idx < size // self.dp_world_size:
            global_index = self._sample_idx * self.dp_world_size + self.dp_rank
            self._sample_idx += 1
            yield self.sample(global_index)

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self._sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sample_idx = int(state_dict["sample_idx"])


def build_latent_source(
    data_config: Wan22DataConfig, model_args: Wan22ModelArgs, dataset_path: str | None
) -> LatentSource:
    """The clean-sample source named by ``data_config.source``."""
    match data_config.source:
        case "synthetic":
            shape = (
                model_args.in_channels,
                data_config.latent_frames,
                data_config.latent_height,
                data_config.latent_width,
            )
            return SyntheticLatents(
                shape, model_args.text_len, model_args.text_dim, data_config.seed
            )
        case "folder":
            folder = data_config.folder or dataset_path
            if not folder:
                raise ValueError(
                    "wan22.source='folder' needs wan22.folder or training.dataset_path"
                )
            return LatentFolder(
                folder, model_args.in_channels, model_args.text_dim, model_args.text_len
            )
        case _:
            raise ValueError(
                f"wan22.source={data_config.source!r}; expected 'synthetic' or 'folder'"
            )


def build_wan22_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: Any,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """TrainSpec ``build_dataloader_fn``: batches of ``training.local_batch_size`` noised
    samples for the stock torchtitan Trainer (``model(input, timesteps=, text_emb=)``)."""
    del tokenizer
    data_config = wan22_data_config(job_config)
    model_args = wan22_configs[job_config.model.flavor]
    source = build_latent_source(data_config, model_args, job_config.training.dataset_path)
    dataset = Wan22FlowMatchingDataset(
        source,
        data_config,
        text_len=model_args.text_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=job_config.training.local_batch_size,
    )
