"""Tokenizers for the job's data: byte-level by default, or a local `tokenizers` JSON file.

Both present megatron-core's tokenizer interface (`MegatronTokenizerBase`): megatron's `GPTDataset` reads
`eod` (end of document) and `vocab_size`.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy

from megatron.core.tokenizers import MegatronTokenizerBase


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens 0..255 and end-of-document 256 (vocab 257). Needs no file and never fails."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__(path="", config={"library": "byte"})

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:
        return {chr(i): i for i in range(256)}

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def unique_identifiers(self) -> Dict[str, str]:
        """What megatron's dataset cache keys on."""
        return {"class": "ByteTokenizer", "vocab_size": "257"}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template")


class JsonFileTokenizer(MegatronTokenizerBase):
    """A HuggingFace `tokenizers` JSON file (needs the `tokenizers` package); end of document is `eod_token`
    if the file has it, else a new id after the vocabulary."""

    def __init__(self, path: str, eod_token: str = "<|endoftext|>") -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise RuntimeError(f"--tokenizer-file {path}: the `tokenizers` package is not installed") from err
        super().__init__(path=path, config={"library": "tokenizers"})
        self._tok = Tokenizer.from_file(path)
        found: Optional[int] = self._tok.token_to_id(eod_token)
        self._size = self._tok.get_vocab_size(with_added_tokens=True)
        self._eod = found if found is not None else self._size
        if found is None:
            self._size += 1

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self._eod])

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> Dict[str, str]:
        """What megatron's dataset cache keys on."""
        return {"class": "JsonFileTokenizer", "path": os.path.abspath(self.path), "vocab_size": str(self._size)}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("JsonFileTokenizer has no chat template")


def build_tokenizer(tokenizer_file: Optional[str] = None) -> MegatronTokenizerBase:
    """The byte-level tokenizer, or the one in `tokenizer_file`."""
    return JsonFileTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()


def token_dtype(vocab_size: int):
    """The smallest integer dtype megatron's indexed dataset stores these ids in."""
    return numpy.uint16 if vocab_size <= 65536 else numpy.int32
