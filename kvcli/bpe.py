"""Byte-level BPE (a ``gpt2`` vocabulary) over the GGUF's packed tokens and merges, as llama.cpp's llm_tokenizer_bpe.

The text is cut into words by the file's pre-tokenizer regexes (kvcli/pretokenizers.py, run by the tokenizers
library's Split, which reads them as llama.cpp does); each word's bytes are merged in kvcli/kernels/cpu/bpe.py
against two hash tables over the packed strings (a fraction of what the tokenizers library's BPE model held:
benchmarks/README.md, "Memory and RSS"). GPT-2's byte-level alphabet spells each byte as one printable character in
the vocabulary; the words are merged as raw bytes and spelled that way only to look a whole word up (ignore_merges).
"""

from __future__ import annotations

import numpy as np

from kvcli.errors import KvcliError
from kvcli.kernels.cpu.bpe import encode_words, find_text, pair_tables, text_slots
from kvcli.packed_strings import PackedStrings


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies, in GPT-2's
    order (the printable bytes first): a byte-level vocabulary's first 256 tokens, as tests and benchmarks build them."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _table_size(n: int) -> int:
    """A power of two at least 1.5 n: open addressing's probes stay short."""
    return 1 << max(4, (3 * n // 2).bit_length())


class ByteLevelBPE:
    """tokens, merges: the file's tokenizer.ggml.tokens and .merges ("a b" by rank); regexes: the pre-tokenizer's, in
    Oniguruma's spelling (pretokenizers.for_onig); ignore_merges: a word that is a token is taken whole."""

    def __init__(self, tokens: PackedStrings, merges: PackedStrings, regexes: list[str], ignore_merges: bool):
        from tokenizers import Regex, pre_tokenizers

        self._words = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])
        self._buf, self._at = tokens.utf8()
        self._slots = text_slots(self._buf, self._at, _table_size(len(tokens)))
        spelled = [c.encode("utf-8") for _, c in sorted(bytes_to_unicode().items())]
        self._level = np.frombuffer(b"".join(spelled), np.uint8)
        self._level_at = np.zeros(257, np.int64)
        np.cumsum([len(c) for c in spelled], out=self._level_at[1:])
        self._byte_ids = np.array([find_text(self._slots, self._buf, self._at, self._level, self._level_at[b],
                                             self._level_at[b + 1]) for b in range(256)], np.int32)
        mbuf, mat = merges.utf8()
        self._keys, self._values, bad, part = pair_tables(self._buf, self._at, self._slots, mbuf, mat,
                                                          _table_size(len(merges)))
        if bad >= 0:
            what = ("has no space between its two tokens", "names a first token not in the vocabulary",
                    "names a second token not in the vocabulary", "makes a token not in the vocabulary")[part]
            raise KvcliError(f"bad BPE merges in GGUF metadata: merge {bad} ({merges[bad]!r}) {what}")
        self._whole_words = ignore_merges

    def words(self, text: str) -> list[str]:
        """text cut by the pre-tokenizer's regexes, each in turn splitting what the previous left."""
        return [w for w, _ in self._words.pre_tokenize_str(text)]

    def encode(self, text: str) -> list[int]:
        """The ids of text (no special tokens: the caller splits them out first)."""
        words = [w.encode("utf-8") for w in self.words(text)]
        starts = np.zeros(len(words) + 1, np.int64)
        np.cumsum([len(w) for w in words], out=starts[1:])
        raw = np.frombuffer(b"".join(words), np.uint8)
        return encode_words(raw, starts, self._byte_ids, self._level, self._level_at, self._slots, self._buf,
                            self._at, self._keys, self._values, self._whole_words).tolist()
