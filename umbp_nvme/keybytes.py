"""The one encoding between str keys (what callers pass) and key bytes (what the index, archives
and CLI output hold).

UTF-8 with ``surrogateescape``: every byte string decodes (a key written by an older or crashed
process, or damaged on disk, is still a str the store can evict, delete and print), and a str
encodes only when decoding its bytes gives the same str back. That makes the map a bijection
between accepted strs and bytes: ``"\\udcc3\\udca9"`` would encode to the bytes of ``"é"``, so it is
refused instead of aliasing another key. Lone surrogates outside U+DC80..U+DCFF do not encode at
all and are refused the same way, each key alone.
"""

from __future__ import annotations

_CODEC = "utf-8"
_ERRORS = "surrogateescape"


class KeyEncodingError(ValueError):
    """A str key that has no unambiguous byte form (it is refused alone, never the batch)."""


def encode_key(key: str) -> bytes:
    """The key's bytes; raises KeyEncodingError (a ValueError) for a key with no lossless form."""
    if type(key) is not str:
        raise KeyEncodingError(f"keys are str, got {type(key).__name__}")
    if key.isascii():
        return key.encode("ascii")
    try:
        b = key.encode(_CODEC, _ERRORS)
    except UnicodeEncodeError as e:
        raise KeyEncodingError(f"key has a lone surrogate at {e.start} ({key[e.start]!r}) that no byte form holds") from None
    if b.decode(_CODEC, _ERRORS) != key:
        raise KeyEncodingError("key mixes escaped bytes (U+DC80..U+DCFF) that would read back as another key")
    return b


def key_error(key) -> str | None:
    """Why ``key`` cannot be stored (not a str, empty, no lossless byte form), or None."""
    if type(key) is not str:
        return f"keys are str, got {type(key).__name__}"
    if not key:
        return "empty key"
    if key.isascii():
        return None
    try:
        encode_key(key)
    except KeyEncodingError as e:
        return str(e)
    return None


def decode_key(b: bytes) -> str:
    """The str for key bytes from the index or an archive; never fails."""
    return b.decode(_CODEC, _ERRORS)


def decode_keys(keys: list[bytes]) -> list[str]:
    """decode_key over a list (one call per key: no joining on a byte a key may contain)."""
    return [k.decode(_CODEC, _ERRORS) for k in keys]


def printable_key(key: str) -> str:
    """A key (or a name from a source) for logs and CLI text: escaped bytes shown as ``\\xNN``, never
    a lone surrogate, and no control or separator character (a newline or ESC in a key or file name
    would forge a line of the summary or drive the terminal) but as ``\\xNN`` / ``\\uNNNN``."""
    if key.isascii() and key.isprintable():
        return key
    shown = key if key.isascii() else encode_key_lenient(key).decode(_CODEC, "backslashreplace")
    return shown if shown.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in shown)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def encode_key_lenient(key: str) -> bytes:
    """Bytes for display only: surrogates that cannot be escaped become ``?``."""
    try:
        return key.encode(_CODEC, _ERRORS)
    except UnicodeEncodeError:
        return key.encode(_CODEC, "replace")
