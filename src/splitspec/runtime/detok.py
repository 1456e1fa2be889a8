"""Incremental detokenisation with stop strings: text deltas that never split a UTF-8 character,
never repeat or drop text when several tokens arrive at once, and never pass a stop string."""

from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes the whole output each time (exact for byte-level BPE, whose pieces may cut a multi-byte
    character) and releases only text that is final: a trailing U+FFFD (an incomplete UTF-8 sequence)
    and any tail that could still become one of ``stop`` strings are held back.

    Args:
        decode: token ids → text (special tokens skipped).
        stop: stop strings; output ends right before the first one (it is not included).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None):
        self.decode, self.stop = decode, [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of text already released
        self.stopped = False
        self.tokens_to_stop: int | None = None  # tokens needed to complete the stop string

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly final text (empty if nothing is final yet).

        After a stop string is found, :attr:`stopped` is True, :attr:`tokens_to_stop` says how many
        tokens (of all added) were needed to produce it, and later calls return ''.
        """
        if self.stopped:
            return ""
        start = len(self.ids)
        self.ids += new_ids
        text = self.decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                # the fewest tokens whose text contains the stop string
                self.tokens_to_stop = next(n for n in range(start + 1, len(self.ids) + 1) if s in self.decode(self.ids[:n]))
                cut = min(at, *(i for i in (text.find(t) for t in self.stop) if i >= 0))
                out, self.sent = text[self.sent:cut], cut
                return out
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a tail that may be the start of a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
