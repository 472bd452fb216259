"""A GGUF string array kept as one UTF-8 buffer and its offsets: a vocabulary's 150k tokens and merges.

As Python objects (a list of str) each element costs ~50 bytes of header besides its few bytes of text: Qwen2.5's
151,936 tokens and 151,387 merges held ~25 MiB that way, against ~5 MiB here (benchmarks/README.md, peak RSS). An
element is decoded where it is read (a token's text when it is printed, the whole array once where a tokenizer is
built), so reads cost a slice and a decode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class PackedStrings(Sequence):
    """An immutable sequence of str: element i is buf[at[i]:at[i + 1]] decoded as UTF-8. buf: bytes whose every element
    is valid UTF-8 (`invalid` finds one that is not; kvcli/gguf_file.py refuses such a file); at: (n + 1,) int64
    offsets, at[0] = 0, ascending."""

    __slots__ = ("_buf", "_at")

    def __init__(self, buf: bytes, at: np.ndarray):
        self._buf, self._at = buf, at

    @classmethod
    def joined(cls, pieces: Sequence) -> "PackedStrings":
        """The elements from their UTF-8 bytes (bytes-like pieces; `invalid` says whether each is valid)."""
        at = np.zeros(len(pieces) + 1, np.int64)
        np.cumsum([len(p) for p in pieces], out=at[1:])
        return cls(b"".join(pieces), at)

    @classmethod
    def of(cls, items: Sequence[str]) -> "PackedStrings":
        """items packed (a PackedStrings, as a file's arrays are, is returned as it is)."""
        return items if isinstance(items, PackedStrings) else cls.joined([s.encode("utf-8") for s in items])

    def invalid(self) -> tuple[int, int] | None:
        """(element, offset in it) where the first element that is not valid UTF-8 fails to decode, or None. Every
        element is valid where the whole buffer is and no element starts inside a character (on a continuation
        byte); only otherwise is each element tried."""
        nonempty = self._at[:-1][np.diff(self._at) > 0]
        try:
            self._buf.decode("utf-8")
            if not np.any((np.frombuffer(self._buf, np.uint8)[nonempty] & 0xC0) == 0x80):
                return None
        except UnicodeDecodeError:
            pass
        for i in range(len(self)):
            try:
                self._buf[self._at[i] : self._at[i + 1]].decode("utf-8")
            except UnicodeDecodeError as e:
                return i, e.start
        return None

    def __len__(self) -> int:
        return len(self._at) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} strings")
        i = i + n if i < 0 else i
        return self._buf[self._at[i] : self._at[i + 1]].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        # The whole buffer decoded at once and sliced at each element's first character (its byte offset less the
        # continuation bytes before it): 2-3x faster than a decode per element over a vocabulary.
        text = self._buf.decode("utf-8")
        if len(text) == len(self._buf):  # ASCII
            at = self._at.tolist()
        else:
            lead = np.zeros(len(self._buf) + 1, np.int32)
            np.cumsum((np.frombuffer(self._buf, np.uint8) & 0xC0) != 0x80, out=lead[1:])
            at = lead[self._at].tolist()
        for a, z in zip(at, at[1:]):
            yield text[a:z]

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedStrings):
            return self._buf == other._buf and np.array_equal(self._at, other._at)
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # a sequence compared by value, as a list

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings, {len(self._buf)} bytes)"

    def utf8(self) -> tuple[np.ndarray, np.ndarray]:
        """(buf (bytes,) u8, at (n + 1,) i64): the elements' bytes back to back and their offsets, as kept."""
        return np.frombuffer(self._buf, np.uint8), self._at

    def nbytes(self) -> int:
        return len(self._buf) + self._at.nbytes
