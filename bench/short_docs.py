"""A corpus of short documents, offline: Python's standard library cut at its top-level definitions
(each `def`, `class` or decorated one, and the module text before the first), one document per
jsonl line. Rows of the demo's 128 tokens then hold several documents: what doc_mask is about.

    python bench/short_docs.py OUT.jsonl [--dirs json email ...]    # default: the whole stdlib
    python data.py prepare data/stdlib_short OUT.jsonl --tokenizer bytes
"""
import argparse
import glob
import json
import os
import re
import sysconfig

TOP_LEVEL = re.compile(r"^(?=(?:def |class |async def |@))", re.M)  # where a top-level definition starts
SHORTEST, LONGEST = 40, 4000  # characters: shorter pieces are noise, longer ones are rarely "short"


def short_documents(path: str):
    """The pieces of one source file, in order, that fall within SHORTEST..LONGEST characters."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for piece in TOP_LEVEL.split(text):
        piece = piece.strip("\n")
        if SHORTEST <= len(piece) <= LONGEST:
            yield piece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dirs", nargs="*", help="stdlib folders to read (default: all of it)")
    args = parser.parse_args()
    stdlib = sysconfig.get_paths()["stdlib"]
    patterns = [os.path.join(stdlib, d, "*.py") for d in args.dirs] if args.dirs else [
        os.path.join(stdlib, "*.py"), os.path.join(stdlib, "*", "*.py")]
    files = sorted(p for pattern in patterns for p in glob.glob(pattern) if "/test" not in p)
    count = chars = 0
    with open(args.out, "w") as out:
        for path in files:
            for doc in short_documents(path):
                out.write(json.dumps({"text": doc}) + "\n")
                count, chars = count + 1, chars + len(doc)
    print(f"{count:,} documents of {chars / max(count, 1):,.0f} characters on average from {len(files)} files: {args.out}")


if __name__ == "__main__":
    main()
