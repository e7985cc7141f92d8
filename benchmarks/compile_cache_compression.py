"""Size and time of compressing ``torch.compile`` cache artifacts, per format (``CompileCache``).

    python benchmarks/compile_cache_compression.py ARTIFACTS [MORE_PARTS...]

``ARTIFACTS``: a file ``CompileCache`` saved (xz, gzip or raw), or the parts of one split for
transfer (``split -b``), concatenated in the order given. A gzip stream cut short (the parts that
arrived) is decompressed as far as it goes. The raw bytes are then compressed with each format
``CompileCache`` can write, and read back; each row gives the size, the seconds to write and to
read, and the size against gzip level 1 (``CompileCache``'s format before xz).
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from callbacks.compile_cache import GZIP_MAGIC, XZ_MAGIC, pack, unpack  # noqa: E402

# the rows: CompileCache's two formats (its own pack) and gzip at its default level for comparison
FORMATS = {
    "gzip 1": lambda raw: pack(raw, "gzip"),
    "gzip 6": lambda raw: gzip.compress(raw, compresslevel=6),
    "xz 1": lambda raw: pack(raw, "xz"),
}


def raw_bytes(data: bytes) -> tuple[bytes, str]:
    """The uncompressed artifacts and what they were read from."""
    if data[:2] == GZIP_MAGIC:  # read as a stream: the first parts of a split file decompress as far as they go
        stream = zlib.decompressobj(16 + zlib.MAX_WBITS)
        raw = stream.decompress(data)
        return raw, "gzip" + ("" if stream.eof else ", cut short: the part that decompresses")
    if data[:6] == XZ_MAGIC:
        return unpack(data), "xz"
    return data, "raw"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for part in args.parts:
        if not part.is_file():
            print(f"compile_cache_compression: {part} is not a file", file=sys.stderr)
            return 2
    data = b"".join(part.read_bytes() for part in args.parts)
    raw, source = raw_bytes(data)
    print(f"{len(raw) / 2**20:.1f} MiB of artifacts ({source})")
    print(f"{'format':<8} {'MiB':>7} {'write s':>8} {'read s':>7} {'size / gzip 1':>14}")
    base = None
    for name, compress in FORMATS.items():
        start = time.perf_counter()
        packed = compress(raw)
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        back = unpack(packed)
        read = time.perf_counter() - start
        assert back == raw, name
        base = base or len(packed)
        print(f"{name:<8} {len(packed) / 2**20:>7.1f} {wrote:>8.1f} {read:>7.1f} {len(packed) / base:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
