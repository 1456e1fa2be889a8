"""Decoding a request body's ``Content-Encoding`` as it arrives, bounded: both HTTP front ends read compressed bodies
through it (:class:`~splitspec.serving.body_reader.BodyReader`), rather than their frameworks' own decoders.

aiohttp decoded the guard's bodies itself and did it loosely: a gzip body cut short (its 8-byte trailer missing, or
cut mid-stream) was taken, and the part decompressed forwarded (a 200, or tritonserver's 500); ``zstd`` got its
``text/plain`` 400 asking to install a package. Starlette does not decode at all: the OpenAI front end read ``zstd``
as plain text and a gzip body as bad JSON.

**Encodings.** ``identity`` (also no header, or an empty one), ``gzip`` (RFC 1952; members one after another are one
body, as the format allows) and ``deflate`` (RFC 9110: zlib-wrapped, RFC 1950; the raw deflate stream that some
clients send instead is taken too, told apart by the zlib header's check bits as browsers and curl do); names are
case-insensitive. Anything else — ``zstd``, ``br``, ``x-gzip``, codings stacked (``gzip, gzip``) — is refused with
415 by :func:`check_encoding`.

**Bounds.** :meth:`Decoder.feed` never produces more than the limit and one byte (zlib's ``max_length``): a bomb
(250 MB of zeros in 250 KB of gzip) is refused with 413 after the limit's worth of work. A stream that does not end
cleanly — not ended when the body is (cut short), a bad CRC or length in its trailer, bytes after its end that are
not another gzip member — is refused with 400 naming ``Content-Encoding`` (:meth:`Decoder.end`).
"""

from __future__ import annotations

import zlib

from splitspec.serving.http_bounds import Refusal, check_read

#: The ``Content-Encoding`` values read (case-insensitive); no header means ``identity``.
ENCODINGS = ("identity", "gzip", "deflate")


def check_encoding(header: str | None) -> str:
    """The body's coding named by a ``Content-Encoding`` ``header`` (several headers joined with ``, ``; None: not
    sent), lower case: one of :data:`ENCODINGS`.

    Raises:
        Refusal: 415 for any other value (an unknown coding, or more than one).
    """
    name = (header or "").strip().lower() or "identity"
    if name not in ENCODINGS:
        raise Refusal(415, f"Content-Encoding: {header[:40]!r}: expected one of {', '.join(ENCODINGS)}")
    return name


def _zlib_wrapped(head: bytes) -> bool:
    """Whether a deflate body starting with ``head`` (2 bytes) has RFC 1950's zlib header: method 8 with a window of
    at most 32 KiB, and the two bytes a multiple of 31."""
    return head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0


class Decoder:
    """Decodes one body sent with ``encoding`` (:func:`check_encoding`'s), chunk by chunk, to at most ``limit`` bytes
    (``max_prompt_bytes``: what the limit was derived from, named in the 413). :meth:`feed` each chunk as it arrives,
    then call :meth:`end`."""

    def __init__(self, encoding: str, limit: int, max_prompt_bytes: int | None):
        self.encoding, self.limit, self.max_prompt_bytes = encoding, limit, max_prompt_bytes
        #: bytes decoded so far
        self.size = 0
        self._inflate = None  # zlib's decompressobj, once the stream's first bytes tell which
        self._head = b""  # a deflate body's first byte, until the second tells raw from zlib-wrapped

    def _refuse(self, why: str) -> Refusal:
        return Refusal(400, f"request body (Content-Encoding: {self.encoding}): {why}; expected one whole "
                            f"{self.encoding} stream")

    def _start(self, data: bytes) -> bytes:
        """Open the decompressor for a stream starting with ``data``; return what of ``data`` to feed it (b"": wait
        for more)."""
        if self.encoding == "gzip":
            self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return data
        data = self._head + data
        if len(data) < 2:
            self._head = data
            return b""
        self._head = b""
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS if _zlib_wrapped(data) else -zlib.MAX_WBITS)
        return data

    def feed(self, chunk: bytes) -> bytes:
        """The bytes ``chunk`` decodes to (identity: ``chunk`` itself), counted in :attr:`size`.

        Raises:
            Refusal: 413 once the bytes decoded pass the limit (the rest not decompressed); 400 when ``chunk`` is not
                of the encoding, or follows the end of the stream (and is not another gzip member).
        """
        if self.encoding == "identity" or not chunk:
            self.size += len(chunk)
            return chunk
        out = []
        data = chunk if self._inflate is not None else self._start(chunk)
        while data:
            after_end = self._inflate.eof  # a stream ended, and more follows
            if after_end:
                if self.encoding != "gzip":
                    raise self._refuse("bytes after the end of its deflate stream")
                self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # the next gzip member, if it is one
            try:
                part = self._inflate.decompress(data, self.limit - self.size + 1)
            except zlib.error as e:
                if after_end:
                    raise self._refuse("bytes after the end of its gzip stream that are not another gzip member") \
                        from None
                raise self._refuse(f"not {self.encoding} data ({e})") from None
            self.size += len(part)
            check_read(self.size, self.limit, self.max_prompt_bytes, "decompressed request body")
            out.append(part)
            data = self._inflate.unconsumed_tail or self._inflate.unused_data
        return b"".join(out)

    def end(self) -> None:
        """The body has ended: refuse it unless its stream did too (identity: nothing to check; an empty body is a
        body of no bytes, whatever its encoding).

        Raises:
            Refusal: 400, the body ends before its compressed stream does.
        """
        if self.encoding == "identity" or (self._inflate is None and not self._head):
            return
        if self._inflate is None or not self._inflate.eof:
            raise self._refuse(f"it ends before its {self.encoding} stream does (cut short, or its trailer missing)")
