"""GGUF string arrays kept packed (kvcli/packed_strings.py): a list's reads, and the reader's UTF-8 checks per element."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvcli.errors import KvcliError
from kvcli.gguf_file import _scan
from kvcli.packed_strings import PackedStrings

ITEMS = ["ab", "", "héllo", "<|im_end|>", "\u2581the", "日本", "x"]


def test_packed_strings_read_as_the_list():
    p = PackedStrings.of(ITEMS)
    assert len(p) == len(ITEMS) and list(p) == ITEMS and p == ITEMS and p == PackedStrings.of(ITEMS)
    assert [p[i] for i in range(-len(ITEMS), len(ITEMS))] == ITEMS + ITEMS
    assert p[1:4] == ITEMS[1:4] and p[::-2] == ITEMS[::-2]
    assert p.index("日本") == 5 and "x" in p and "y" not in p
    assert p != ITEMS[:-1] and p != "abx"
    for i in (len(ITEMS), -len(ITEMS) - 1):
        with pytest.raises(IndexError):
            p[i]
    assert p.nbytes() == len("".join(ITEMS).encode()) + 8 * (len(ITEMS) + 1)


def _scan_file(path) -> dict:
    return _scan(np.fromfile(path, np.uint8), str(path))[0]


def _write(path, items: list[str]) -> bytes:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", items)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_reader_packs_string_arrays(tmp_path):
    _write(tmp_path / "a.gguf", ITEMS)
    got = _scan_file(tmp_path / "a.gguf")["test.strings"]
    assert isinstance(got, PackedStrings) and got == ITEMS


@pytest.mark.parametrize("patches, element, at", [
    ([(2, 0, 0xFF)], 2, 0),  # a byte no UTF-8 text holds
    ([(1, 3, 0xC3), (2, 0, 0xA9)], 1, 3),  # a character split over two elements: the whole reads as valid UTF-8
    ([(2, 0, 0xA9)], 2, 0),  # an element that starts inside a character
])
def test_reader_names_the_element_that_is_not_utf8(tmp_path, patches, element, at):
    """patches: (element, byte within it, new byte); the error names the first bad element and its file byte."""
    items = ["aaaa", "bbbb", "cccc", "dddd"]
    raw = bytearray(_write(tmp_path / "a.gguf", items))
    start = [raw.index(text.encode()) for text in items]  # each element's bytes, after its 8-byte length
    for i, j, b in patches:
        raw[start[i] + j] = b
    (tmp_path / "b.gguf").write_bytes(bytes(raw))
    with pytest.raises(KvcliError, match=rf"element {element} of test\.strings is not valid UTF-8 "
                                          rf"\(byte {start[element] + at}\)"):
        _scan_file(tmp_path / "b.gguf")
