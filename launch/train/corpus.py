"""The job's built-in data: a generated English-like corpus with learnable structure.

Sentences come from a fixed random walk over a small word-level Markov chain: 60 words, each followed by
one of 3 fixed successors (chosen by a seeded generator), sentences of 4-12 words, documents of 3-8
sentences. A byte-level model learns the spelling of the words first (loss drops quickly from ln 257), then
the successor structure. Everything is derived from `CORPUS_SEED`, so every machine generates the same bytes;
it is written once per machine as a megatron indexed dataset (byte-level tokens) in a cache directory.
"""
from __future__ import annotations

import os
import random
from typing import Iterator, List

from .datapath import dataset_exists
from .indexed import write_indexed_dataset
from .tokenizer import ByteTokenizer, token_dtype

CORPUS_SEED = 20261130
CORPUS_VERSION = "markov-v1"
NUM_DOCUMENTS = 2000

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "po", "de", "ga", "fi", "zu", "be", "ho", "ya"]


def _words(rng: random.Random, n: int) -> List[str]:
    words: List[str] = []
    while len(words) < n:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        if w not in words:
            words.append(w)
    return words


def generate_documents(num_documents: int = NUM_DOCUMENTS, seed: int = CORPUS_SEED) -> Iterator[str]:
    """The corpus as text documents (deterministic for a seed)."""
    rng = random.Random(seed)
    words = _words(rng, 60)
    successors = {w: rng.sample(words, 3) for w in words}
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            w = rng.choice(words)
            sentence = [w]
            for _ in range(rng.randint(3, 11)):
                w = rng.choice(successors[w])
                sentence.append(w)
            sentences.append(" ".join(sentence).capitalize() + ".")
        yield " ".join(sentences)


def default_cache_dir() -> str:
    """`$FP8P_DATA_CACHE`, else `~/.cache/fp8_parallel`."""
    return os.environ.get("FP8P_DATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fp8_parallel")


def ensure_default_corpus(cache_dir: str) -> str:
    """Write the corpus under `cache_dir` unless it is there; returns its dataset prefix. Call it on one rank
    per machine (the write is atomic, so two writers of the same bytes are harmless)."""
    prefix = os.path.join(cache_dir, CORPUS_VERSION, "corpus_text_document")
    if not dataset_exists(prefix):
        tok = ByteTokenizer()
        write_indexed_dataset(prefix, (tok.tokenize(d) for d in generate_documents()),
                              dtype=token_dtype(tok.vocab_size), eod=tok.eod)
    return prefix
