"""Streaming detokenization and stop strings.

Decoding token by token loses characters two ways: a multi-byte character
split over byte-level tokens decodes as U+FFFD until its last byte arrives,
and SentencePiece drops the leading space of the first token decoded alone.
`IncrementalDecoder` decodes a small window with context and emits only the
text that is complete (the approach of text-generation-inference and vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Generic, Protocol, TypeVar

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(
        self, tokenizer: Any, context: list[int] | None = None, unfinished: int = 0
    ) -> None:
        """`context`: the ids before the first one added; its last `unfinished` ids
        have not been turned into text yet (a reply cut inside a character)."""
        self.tokenizer = tokenizer
        # A few tokens of context so the first reply token keeps its leading space.
        self.ids: list[int] = list(context[-(4 + unfinished) :]) if context else []
        self.prefix_offset = 0
        self.read_offset = max(0, len(self.ids) - unfinished)

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

    @property
    def unfinished(self) -> int:
        """How many added ids have not been turned into text yet (a character still open)."""
        return len(self.ids) - self.read_offset

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


class _HasText(Protocol):
    @property
    def text(self) -> str: ...


T = TypeVar("T", bound=_HasText)


class ReplyFilter(Generic[T]):
    """Releases a reply's token events as their text may be shown.

    Holds back the events whose text could begin a stop string and cuts the
    reply at the first stop string (the events' text trimmed to it). Each push searches
    only the new text and the stop length before it, not the whole reply.
    Items are dataclasses with a `text` field.
    """

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._reach = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # the released text of the reply
        self.held: list[T] = []
        self._held_text = ""
        self.stopped = False  # a stop string ended the reply

    def push(self, item: T) -> list[T]:
        """Add the next event; returns the events released by it."""
        self.held.append(item)
        self._held_text += item.text
        if self.stops:
            start, window = self._window()
            hit = find_stop(window, self.stops)
            if hit >= 0:  # never inside released text: a stop's prefix is held back
                if self._could_start_before(window, hit):
                    return []  # a longer stop may begin earlier: the next text decides
                return self._cut(start + hit - len(self.text))
            if held_back(window, self.stops):
                return []
        return self.release()

    def _window(self) -> tuple[int, str]:
        """Where the searched text starts in the reply, and the text: the held text and
        the released text a stop string could reach back into."""
        start = max(0, len(self.text) - self._reach)
        return start, self.text[start:] + self._held_text

    def _could_start_before(self, window: str, hit: int) -> bool:
        """Whether window's tail from some j < hit still begins an unfinished stop string."""
        return any(
            len(window) - j < len(s) and s.startswith(window[j:])
            for j in range(hit)
            for s in self.stops
        )

    def release(self) -> list[T]:
        """Everything held, now."""
        out, self.held = self.held, []
        self.text += self._held_text
        self._held_text = ""
        return out

    def finish(self) -> list[T]:
        """The end of the reply: release what is held (nothing after a stop string)."""
        if self.stopped:
            return []
        if self.stops:  # a stop found while a longer one might still have begun earlier
            start, window = self._window()
            hit = find_stop(window, self.stops)
            if hit >= 0:
                return self._cut(start + hit - len(self.text))
        return self.release()

    def _cut(self, keep: int) -> list[T]:
        out: list[T] = []
        for item in self.held:
            text = item.text[: max(0, keep)]
            keep -= len(text)
            out.append(replace(item, text=text))  # type: ignore[type-var]
        self.text += "".join(i.text for i in out)
        self.held, self._held_text, self.stopped = [], "", True
        return out


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a chat ready for the assistant's reply: through the tokenizer's chat
    template where it has one, else the messages' contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
    plain: list[int] = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    return plain
