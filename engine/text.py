"""Streaming detokenization and stop strings.

Decoding token by token loses characters two ways: a multi-byte character
split over byte-level tokens decodes as U+FFFD until its last byte arrives,
and SentencePiece drops the leading space of the first token decoded alone.
`IncrementalDecoder` decodes a small window with context and emits only the
text that is complete (the approach of text-generation-inference and vLLM).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, context: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        # A few tokens of context so the first reply token keeps its leading space.
        self.ids: list[int] = list(context[-4:]) if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text

    def add(self, token_id: int) -> str:
        """The text token_id completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of a reply)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that could begin a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best
