"""Prepare a corpus into token files for train_fsdp.py (fsdp_gpt/data/prepare.py does the work).

    python data.py prepare DATA_PATH SOURCE [SOURCE ...] [--tokenizer cl100k_base] [--workers N]
                   [--text_field text] [--skip_bad_lines]

SOURCE: text files (one document each), .jsonl / .jsonl.gz (a `text` field per line), .parquet
(a `text` column), folders of them, globs, or `stdlib` (the offline corpus). Formats: docs/data.md.
"""
import argparse
import os
import sys

from fsdp_gpt.config import UserError, exit_code
from fsdp_gpt.data.prepare import is_prepared, prepare_data


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Prepare a corpus into token files for train_fsdp.py")
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("data_path")
    parser.add_argument("sources", nargs="+", help="files, folders, globs, or 'stdlib'")
    parser.add_argument("--tokenizer", default="cl100k_base", help="a tiktoken encoding name, 'bytes', or a Hugging "
                        "Face tokenizer (a folder holding tokenizer.json, or the file)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes (default: cores)")
    parser.add_argument("--text_field", default="text", help="the jsonl field / parquet column holding the text")
    parser.add_argument("--skip_bad_lines", action="store_true", help="count and skip malformed documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers must be 1 or more, got {args.workers}")
    if is_prepared(args.data_path):
        print(f"{args.data_path} is prepared already: remove it to prepare it again")
        return 0
    prepare_data(args.data_path, args.sources, args.tokenizer, workers=args.workers, text_field=args.text_field,
                 skip_bad=args.skip_bad_lines)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))
