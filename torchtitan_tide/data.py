"""The embedded training text, registered as TorchTitan dataset ``tide_text``.

``training.dataset = "tide_text"`` reads JSON-lines documents (``{"text": ...}``) or
plain ``.txt`` files. Without ``training.dataset_path`` it reads the Python Language
Reference text shipped in ``torchtitan_tide/assets`` (no download); with a path it reads
that file, or every ``*.jsonl`` / ``*.txt`` file of that folder in name order (one
``.txt`` file is one document). Documents are held in memory as a map-style
``datasets.Dataset``, so TorchTitan's checkpointed sample index resumes exactly.
"""

import json
from pathlib import Path

from datasets import Dataset

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
EMBEDDED_TEXT = ASSETS_DIR / "text" / "python_reference.jsonl"
EMBEDDED_TOKENIZER = ASSETS_DIR / "tokenizer"
DATASET_NAME = "tide_text"


def resolve_asset_path(path: str) -> str:
    """Return ``path`` if it exists; a ``torchtitan_tide/assets/...`` path is also
    resolved against the installed package, so configs work from any directory."""
    if Path(path).exists():
        return path
    marker = "torchtitan_tide/assets/"
    if marker in path:
        packaged = ASSETS_DIR / path.split(marker, 1)[1]
        if packaged.exists():
            return str(packaged)
    return path


def read_documents(path: str | Path) -> list[str]:
    """Read documents from a ``.jsonl`` file, a ``.txt`` file, or a folder of them.

    Raises:
        FileNotFoundError: the path does not exist or the folder holds no such file.
        ValueError: a JSON line is not an object with a string ``text`` field.
    """
    path = Path(resolve_asset_path(str(path)))
    if not path.exists():
        raise FileNotFoundError(
            f"training.dataset_path {str(path)!r} does not exist; give a .jsonl/.txt file "
            "or a folder of them, or leave dataset_path unset for the embedded text"
        )
    files = sorted(
        p for p in path.iterdir() if p.suffix in (".jsonl", ".txt")
    ) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl or .txt files in {str(path)!r}")
    documents: list[str] = []
    for file in files:
        if file.suffix == ".txt":
            documents.append(file.read_text(encoding="utf-8"))
            continue
        with file.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument type
                        f"{file}:{line_no}: expected a JSON object with a string 'text' field"
                    )
                documents.append(record["text"])
    return documents


def _load_documents(path: str) -> Dataset:
    return Dataset.from_list([{"text": doc} for doc in read_documents(path)])


def register_dataset() -> None:
    """Add ``tide_text`` to TorchTitan's dataset registry (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=str(EMBEDDED_TEXT),
        loader=_load_documents,
        sample_processor=lambda sample: sample["text"],
    )
