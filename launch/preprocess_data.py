"""Turn a text or JSONL file into a megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) for --data-path.

    python launch/preprocess_data.py --input corpus.txt --output-prefix data/corpus
    python launch/preprocess_data.py --input docs.jsonl --json-key text --output-prefix data/docs \\
        [--tokenizer-file tokenizer.json]

Text input: one document per blank-line-separated paragraph (`--document-per-line`: one per line). JSONL
input (a `.jsonl` / `.json` name, or `--jsonl`): one JSON object per line, the document under `--json-key`.
Byte-level tokens by default (vocab 257, end of document 256); `--tokenizer-file` uses a HuggingFace
`tokenizers` JSON file instead (needs the `tokenizers` package). Pass the same `--tokenizer-file` to the job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List, Optional

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def read_documents(path: str, jsonl: bool, json_key: str, document_per_line: bool) -> Iterator[str]:
    """The documents of `path`.

    Raises:
        ValueError: a JSONL line that is not an object with `json_key` (the message names the line).
    """
    with open(path, encoding="utf-8") as f:
        if jsonl:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{number}: expected a JSON object with key {json_key!r} ({err})") from None
                yield str(text)
        elif document_per_line:
            for line in f:
                if line.strip():
                    yield line.rstrip("\n")
        else:
            paragraph: List[str] = []
            for line in f:
                if line.strip():
                    paragraph.append(line.rstrip("\n"))
                elif paragraph:
                    yield "\n".join(paragraph)
                    paragraph = []
            if paragraph:
                yield "\n".join(paragraph)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--jsonl", action="store_true", help="read JSON lines (default for .jsonl / .json names)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--document-per-line", action="store_true")
    p.add_argument("--tokenizer-file", default=None)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"preprocess_data.py: error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    from launch.train.indexed import write_indexed_dataset
    from launch.train.tokenizer import build_tokenizer, token_dtype

    tok = build_tokenizer(args.tokenizer_file)
    jsonl = args.jsonl or args.input.endswith((".jsonl", ".json"))
    docs = read_documents(args.input, jsonl, args.json_key, args.document_per_line)
    try:
        count = write_indexed_dataset(args.output_prefix, (tok.tokenize(d) for d in docs),
                                      dtype=token_dtype(tok.vocab_size), eod=tok.eod)
    except ValueError as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {count} documents to {args.output_prefix}.bin/.idx (vocab {tok.vocab_size}, eod {tok.eod})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
