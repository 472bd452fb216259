"""Byte-level BPE on a vocabulary's packed UTF-8 texts (numba; kvcli/bpe.py builds the tables and calls these).

Two open-addressing tables stand in for the tokenizers library's hash maps (a vocabulary as Rust strings and maps,
several times the size: benchmarks/README.md, "Memory and RSS"): `slots` maps a token's text (hashed from its bytes
in the packed buffer) to its id, `keys` / `values` map a merge's two ids to its rank and the id it makes. A word is
merged as llama.cpp's llm_tokenizer_bpe and the tokenizers library do: the adjacent pair of lowest rank first, the
leftmost of equal ranks.
"""

from __future__ import annotations

import numpy as np

from .compile import jit

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)  # FNV-1a, 64 bits
_FNV_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of a pair's key
_LOW32 = np.int64(0xFFFFFFFF)
NO_RANK = np.int64(1) << 62


@jit
def _text_hash(buf, a, z, mask):
    h = _FNV_OFFSET
    for i in range(a, z):
        h = (h ^ np.uint64(buf[i])) * _FNV_PRIME
    return np.int64(h & np.uint64(mask))


@jit
def _same(buf, a, z, q, qa, qz):
    if z - a != qz - qa:
        return False
    for i in range(z - a):
        if buf[a + i] != q[qa + i]:
            return False
    return True


@jit
def text_slots(buf, at, size):
    """buf (bytes,) u8, at (n + 1,) i64: the n texts; size a power of two > n -> (size,) i32, each text's id at its
    slot or -1; a text twice keeps its last id (as a dict built in id order)."""
    slots = np.full(size, -1, np.int32)
    for t in range(len(at) - 1):
        s = _text_hash(buf, at[t], at[t + 1], size - 1)
        while slots[s] >= 0 and not _same(buf, at[slots[s]], at[slots[s] + 1], buf, at[t], at[t + 1]):
            s = (s + 1) & (size - 1)
        slots[s] = t
    return slots


@jit
def find_text(slots, buf, at, q, qa, qz):
    """The id of the text q[qa:qz] (u8), or -1."""
    mask = len(slots) - 1
    s = _text_hash(q, qa, qz, mask)
    while slots[s] >= 0:
        u = slots[s]
        if _same(buf, at[u], at[u + 1], q, qa, qz):
            return u
        s = (s + 1) & mask
    return -1


@jit
def _pair_slot(keys, key):
    """The slot of key in keys (open addressing, -1 empty): its own or the empty one where it would go."""
    s = np.int64(((np.uint64(key) * _MIX) >> np.uint64(32)) & np.uint64(len(keys) - 1))
    while keys[s] >= 0 and keys[s] != key:
        s = (s + 1) & (len(keys) - 1)
    return s


@jit
def pair_tables(buf, at, slots, mbuf, mat, size):
    """The merges mbuf[mat[r]:mat[r + 1]] ("a b", split at the first space after the first byte, as llama.cpp) in
    rank order -> (keys (size,) i64: a << 32 | b or -1, values (size,) i64: rank << 32 | id of a+b, failed rank or
    -1, what failed: 0 no space, 1 a, 2 b, 3 a+b not a token). A pair listed twice keeps its first rank (llama.cpp's
    bpe_ranks.emplace)."""
    keys = np.full(size, -1, np.int64)
    values = np.zeros(size, np.int64)
    longest = 0
    for r in range(len(mat) - 1):
        longest = max(longest, mat[r + 1] - mat[r])
    joined = np.empty(longest, np.uint8)
    for r in range(len(mat) - 1):
        a, z = mat[r], mat[r + 1]
        space = -1
        for i in range(a + 1, z):
            if mbuf[i] == 32:
                space = i
                break
        if space < 0:
            return keys, values, r, 0
        left = find_text(slots, buf, at, mbuf, a, space)
        if left < 0:
            return keys, values, r, 1
        right = find_text(slots, buf, at, mbuf, space + 1, z)
        if right < 0:
            return keys, values, r, 2
        n = 0
        for i in range(a, z):
            if i != space:
                joined[n] = mbuf[i]
                n += 1
        made = find_text(slots, buf, at, joined, 0, n)
        if made < 0:
            return keys, values, r, 3
        key = (np.int64(left) << 32) | right
        s = _pair_slot(keys, key)
        if keys[s] < 0:
            keys[s] = key
            values[s] = (np.int64(r) << 32) | made
    return keys, values, -1, 0


@jit
def _merge(keys, values, left, right):
    """rank << 32 | id of the pair (left, right), or NO_RANK where it is no merge."""
    s = _pair_slot(keys, (np.int64(left) << 32) | right)
    return values[s] if keys[s] >= 0 else NO_RANK


@jit
def encode_words(text, starts, byte_ids, level, level_at, slots, buf, at, keys, values, whole_words):
    """The words text[starts[w]:starts[w + 1]] (raw UTF-8 bytes) -> their ids back to back, (n,) i32. byte_ids (256,)
    i32: each byte's token (-1: none, the byte is dropped as the tokenizers library does); level / level_at: each
    byte's byte-level character in UTF-8, for whole_words (a word that is a token is taken whole: ignore_merges)."""
    out = np.empty(len(text), np.int32)
    longest = 0
    for w in range(len(starts) - 1):
        longest = max(longest, starts[w + 1] - starts[w])
    word = np.empty(longest, np.int32)
    ranks = np.empty(longest, np.int64)  # ranks[i]: the merge of word[i] and word[i + 1]
    spelled = np.empty(2 * longest, np.uint8)
    n_out = 0
    for w in range(len(starts) - 1):
        a, z = starts[w], starts[w + 1]
        if whole_words:
            n = 0
            for i in range(a, z):
                for j in range(level_at[text[i]], level_at[text[i] + 1]):
                    spelled[n] = level[j]
                    n += 1
            t = find_text(slots, buf, at, spelled, 0, n)
            if t >= 0:
                out[n_out] = t
                n_out += 1
                continue
        m = 0
        for i in range(a, z):
            if byte_ids[text[i]] >= 0:
                word[m] = byte_ids[text[i]]
                m += 1
        for i in range(m - 1):
            ranks[i] = _merge(keys, values, word[i], word[i + 1])
        while m > 1:
            best = 0
            for i in range(1, m - 1):
                if ranks[i] < ranks[best]:
                    best = i
            if ranks[best] == NO_RANK:
                break
            word[best] = np.int32(ranks[best] & _LOW32)
            for i in range(best + 1, m - 1):  # word[best + 1] goes, and with it the pair that began there
                word[i] = word[i + 1]
            for i in range(best + 1, m - 2):
                ranks[i] = ranks[i + 1]
            m -= 1
            if best > 0:
                ranks[best - 1] = _merge(keys, values, word[best - 1], word[best])
            if best < m - 1:
                ranks[best] = _merge(keys, values, word[best], word[best + 1])
        out[n_out : n_out + m] = word[:m]
        n_out += m
    return out[:n_out]
