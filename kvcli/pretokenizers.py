"""llama.cpp's pre-tokenizers for byte-level BPE vocabularies (``tokenizer.ggml.model`` 'gpt2').

Before BPE, llama.cpp cuts the text into words with a list of regexes chosen by the file's
``tokenizer.ggml.pre`` name; each regex splits the pieces the previous one left, keeping both
the matches and the text between them (llama-vocab.cpp, llm_tokenizer_bpe and
llama_vocab::impl::load). The regexes below are llama.cpp's, verbatim (CR and LF written as
escapes). `for_onig` rewrites the few constructs that HF tokenizers' regex engine (Oniguruma)
reads differently from llama.cpp, which runs them through std::regex on text collapsed to one
character per Unicode category (unicode.cpp, unicode_regex_split), or through hand-written
matchers for the common ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvcli.errors import KvcliError


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a token is taken whole, without merges
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_CJK_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
_DEEPSEEK3_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FINNISH = r" ?[^(\s|.,!?…。，、।۔،)]+"

# (names, PreTokenizer), grouped as llama.cpp's LLAMA_VOCAB_PRE_TYPE_* values.
_TABLE: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",),  # DEFAULT; also a file without the key
     PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), PreTokenizer((LLAMA3,))),  # DBRX, SMAUG, CHATGLM4
    (("glm4", "glm5"), PreTokenizer((LLAMA3,), ignore_merges=True)),  # CHATGLM4
    (("jais-2",), PreTokenizer((  # JAIS2: LLAMA3 with whitespace runs cut in powers of two
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",))),
    (("minicpm5",), PreTokenizer((
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        ignore_merges=True)),
    (("deepseek-llm",), PreTokenizer((
        r"[\r\n]",
        # some letters are spelled \u escapes: an editor normalising to NFC would change them
        r"\s?[A-Za-z"
        "µÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
        "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇ"
        "ℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗ"
        "Ａ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-퟿]+",
        r"\p{N}+"))),
    (("deepseek-coder",), PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),  # DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
     PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS))),
    (("spark2_5",), PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _SPARK_WORDS, r"\p{N}"))),
    (("youtu",), PreTokenizer((
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer((r"\p{N}", GPT2))),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
      "granite-docling"),
     PreTokenizer((GPT2,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
     PreTokenizer((QWEN2,))),
    (("qwen35",), PreTokenizer((QWEN35,))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_FINNISH,))),
    (("viking",), PreTokenizer((_FINNISH, r"\p{N}"))),
    (("tekken",), PreTokenizer((  # upper-then-lower letter runs, spelled with lookaheads for std::regex
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True, add_bos=True)),
    (("chameleon",), PreTokenizer((
        r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]", GPT2), add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((_GPT4O,))),
    (("granite-embed-multi-97m",), PreTokenizer((_GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),),
                                                ignore_merges=True)),
    (("superbpe",), PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))"))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
    (("seed-coder",), PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("ufakzeka",), PreTokenizer((  # QWEN2 without the contractions
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("laguna",), PreTokenizer((r"[^\n]+|[\n]+", QWEN2))),
    (("exaone-moe",), PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: spec for names, spec in _TABLE for name in names}

# Names llama.cpp knows for 'gpt2' files that kvcli refuses, with the reason.
_NOT_BYTE_LEVEL = "is BPE over raw UTF-8 with '▁' for spaces (SentencePiece style), not byte-level BPE"
_DIGIT_GROUPS = ("needs llama.cpp's hand-written digit splitter (it also joins the text before a number to "
                 "the number's first digits)")
REFUSED: dict[str, str] = {
    "gemma4": _NOT_BYTE_LEVEL, "granite-embed-multi-311m": _NOT_BYTE_LEVEL, "sarvam-moe": _NOT_BYTE_LEVEL,
    "mmbert": _NOT_BYTE_LEVEL + " (and splits words at each space)",
    "whitespace": "splits on whitespace only and is not byte-level BPE",
    "kimi-k2": "needs llama.cpp's hand-written Kimi-K2 splitter (letter classes that exclude Han characters)",
    "afmoe": _DIGIT_GROUPS, "tiny_aya": _DIGIT_GROUPS, "cohere2moe": _DIGIT_GROUPS,
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` name, or a KvcliError naming it."""
    if name in REFUSED:
        raise KvcliError(f"tokenizer.ggml.pre {name!r} is not supported: it {REFUSED[name]}")
    if name not in PRE_TOKENIZERS:
        raise KvcliError(f"unknown tokenizer.ggml.pre {name!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[name]


_WHITESPACE = "\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # Unicode's, beyond ASCII


def for_onig(regex: str) -> str:
    """`regex` as Oniguruma must read it to split text where llama.cpp does."""
    # llama.cpp matches this one by hand (unicode_regex_split_custom_gpt2), which ends a run of
    # whitespace that \s+(?!\S) leaves as \s+ would, like GPT-2's own regex.
    if regex == GPT2:
        return regex + r"|\s+"
    # llama.cpp collapses every letter to one stand-in character, so \p{Lu}, \p{Ll}, ... all mean \p{L}.
    regex = re.sub(r"\\p\{L[ultmo]\}", r"\\p{L}", regex)
    # std::regex's \d is ASCII only, Oniguruma's is any decimal digit; its $ is the end of the piece
    # (Oniguruma's also matches before a newline).
    regex = regex.replace(r"\d", "[0-9]")
    # llama.cpp hands std::regex non-ASCII whitespace as \v (its \s knows only ASCII), so a class such
    # as deepseek's [ࠀ-一] matches U+3000 only through \s: take that whitespace out of such classes.
    regex = re.sub(r"(?<!\\)\[(?!\^)((?:[^\]\\]|\\.)*)\]",
                   lambda m: f"[{m[1]}&&[^{_WHITESPACE}]]" if re.search(r"[^\x00-\x7f]", m[1]) else m[0], regex)
    return regex[:-1] + r"\z" if regex.endswith("$") else regex
