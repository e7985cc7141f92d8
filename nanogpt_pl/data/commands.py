"""``nanogpt-pl data ...``: make token shards and seed the tokenizer cache.

Sub-commands:

- ``prepare INPUT... --output-dir DIR``: tokenize text / jsonl / parquet files into shards.
- ``fineweb [--train-shards N]``: download the record's FineWeb cache from the hub.
- ``tokenizer [--source FILE]``: seed the offline tiktoken cache (for machines without
  access to openaipublic.blob.core.windows.net).
- ``corpus``: build the embedded quickstart corpus and print where it is.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from typing import Optional, Sequence

from nanogpt_pl.data import fineweb as fineweb_mod
from nanogpt_pl.data import prepare as prepare_mod

# Errors a user can cause: reported as one line, without a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError, ImportError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanogpt-pl data",
        description="Make token shards for training and seed the tokenizer cache.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "prepare",
        help="tokenize text/jsonl/parquet files into shards",
        description=prepare_mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="files, directories (searched recursively) or globs")
    p.add_argument("--output-dir", "-o", required=True, help="directory for the shards")
    p.add_argument("--name", default="data", help="shard name prefix: NAME_val_000000.bin, NAME_train_000001.bin, ...")
    p.add_argument("--shard-tokens", type=int, default=prepare_mod.DEFAULT_SHARD_TOKENS, help="tokens per shard")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--val-documents", type=int, default=None,
                       help="the first N documents form the validation split")
    split.add_argument(
        "--val-fraction", type=float, default=None,
        help="this fraction of the documents, spread evenly, forms the validation split "
        f"(default: document 0 and every {round(1 / prepare_mod.DEFAULT_VAL_FRACTION)}th after it)",
    )
    p.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    p.add_argument(
        "--txt-document-chars", type=int, default=prepare_mod.DEFAULT_TXT_DOCUMENT_CHARS,
        help="cut .txt files at blank lines (at line ends in a file without blank lines) into documents "
        "of at least this many characters (default %(default)s); 0 keeps each file one document",
    )
    p.add_argument(
        "--txt-separator", default=None,
        help=r"instead, split .txt files into documents on this string (escapes allowed, e.g. '\n\n\n')",
    )
    p.add_argument("--workers", type=int, default=prepare_mod.DEFAULT_WORKERS, help="tokenizer processes")
    p.add_argument("--overwrite", action="store_true", help="replace existing NAME_* shards in the output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    f = sub.add_parser(
        "fineweb",
        help="download the GPT-2-tokenized FineWeb-10B cache",
        description=fineweb_mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument(
        "--train-shards", type=int, default=fineweb_mod.DEFAULT_TRAIN_SHARDS,
        help=f"train shards of 100M tokens, 1..{fineweb_mod.MAX_TRAIN_SHARDS} (the val shard always comes too)",
    )
    f.add_argument("--local-dir", default=fineweb_mod.DEFAULT_LOCAL_DIR, help="destination directory")
    f.add_argument("--endpoint", default=None, help="hub URL (default: $HF_ENDPOINT or https://huggingface.co)")
    f.add_argument("--revision", default=None, help="branch, tag or commit of the dataset repo")
    f.add_argument("--no-progress", action="store_true", help="no progress output")

    t = sub.add_parser(
        "tokenizer",
        help="seed the offline tiktoken cache with GPT-2's r50k_base ranks",
        description=(
            "Put the verified r50k_base ranks file into the tiktoken cache. Without --source the "
            "openai-whisper sdist (which ships an identical copy) is downloaded from PyPI with pip."
        ),
    )
    t.add_argument("--source", default=None, help="a ranks file or an openai-whisper sdist (.tar.gz)")

    c = sub.add_parser("corpus", help="build the embedded quickstart corpus and print its paths and sizes")
    c.add_argument("--cache-dir", default=None, help="corpus cache (default ~/.cache/nanogpt-pl/corpus)")
    c.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    return parser


def _run(args: argparse.Namespace) -> None:
    if args.command == "prepare":
        sep = codecs.decode(args.txt_separator, "unicode_escape") if args.txt_separator else None
        result = prepare_mod.prepare(
            args.inputs,
            args.output_dir,
            name=args.name,
            shard_tokens=args.shard_tokens,
            val_documents=args.val_documents,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            txt_separator=sep,
            txt_document_chars=args.txt_document_chars,
            workers=args.workers,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        print(result.summary())
        if result.val_paths and result.train_paths:
            print(
                f"use: --data.train_files '{result.train_paths[0].parent / (args.name + '_train_*.bin')}' "
                f"--data.val_files '{result.val_paths[0].parent / (args.name + '_val_*.bin')}'"
            )
    elif args.command == "fineweb":
        paths = fineweb_mod.download(
            args.train_shards, args.local_dir, endpoint=args.endpoint, revision=args.revision,
            progress=not args.no_progress,
        )
        for p in paths:
            print(p)
    elif args.command == "tokenizer":
        from nanogpt_pl.data.tokenizer import seed_cache  # each sub-command loads only its own dependencies

        print(f"tokenizer cache seeded: {seed_cache(args.source)}")
    elif args.command == "corpus":
        from nanogpt_pl.data.corpus import build_corpus  # each sub-command loads only its own dependencies

        print(build_corpus(args.cache_dir, force=args.force, progress=True).summary())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``nanogpt-pl data`` with ``argv`` (the words after ``data``); returns the exit status."""
    try:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help, or a usage error argparse already reported
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        _run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
