"""Regenerate the embedded training text and its BPE tokenizer.

The debug runs train on real English prose: the topic pages of the Python
Language Reference (PSF license, shipped with every CPython as
``pydoc_data.topics``). This script extracts them into
``torchtitan_tide/assets/text/python_reference.jsonl`` (one document per line,
``{"text": ...}``) and trains a byte-level BPE tokenizer on that text into
``torchtitan_tide/assets/tokenizer/``. The committed files were produced with
CPython 3.11.7 and tokenizers 0.23; rerun only to change the assets.

Usage: python scripts/assets/build_text_assets.py [--vocab-size 2048]
"""

import argparse
import json
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "torchtitan_tide" / "assets"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def write_text(out_path: Path) -> list[str]:
    from pydoc_data import topics

    docs = [topics.topics[name].strip() for name in sorted(topics.topics)]
    docs = [doc for doc in docs if len(doc) > 200]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return docs


def train_tokenizer(docs: list[str], out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 8192,
        "source": f"trained by scripts/assets/build_text_assets.py on CPython {sys.version.split()[0]}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    docs = write_text(ASSETS / "text" / "python_reference.jsonl")
    train_tokenizer(docs, ASSETS / "tokenizer", args.vocab_size)
    print(f"wrote {len(docs)} documents, {sum(map(len, docs))} characters, vocab {args.vocab_size}")


if __name__ == "__main__":
    main()
