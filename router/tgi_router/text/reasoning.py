"""Reasoning models' thoughts apart from their answers (`--reasoning-parser`).

A reasoning model writes its thinking between markers, `<think>` and
`</think>`, before the answer. With a parser the OpenAI chat routes return
the text between the markers as `reasoning_content` (streamed as
`delta.reasoning_content`) and the text after the end marker as `content`,
split exactly at the markers (the markers themselves are in neither).
Styles, as vLLM names them:
- `qwen3`: the output opens its thoughts with `<think>`; an output that does
  not open with it has no thoughts (Qwen3 with enable_thinking false, or a
  model that answered at once): all content.
- `deepseek_r1`: the chat template already opened the thoughts in the
  prompt, so the output is thinking until `</think>` (an opening `<think>`
  it writes anyway is dropped); an output with no end marker is all thought
  (cut off by max_tokens while thinking)."""

from dataclasses import dataclass

START, END = "<think>", "</think>"
STYLES = ("qwen3", "deepseek_r1")


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    style: str  # one of STYLES

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the output has no thoughts, content)."""
        body = text[len(START):] if text.startswith(START) else None
        if self.style == "qwen3" and body is None:
            return None, text
        body = text if body is None else body
        end = body.find(END)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(END):]

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.style)


class ReasoningStream:
    """The same split over streamed text: `feed(text)` returns the pieces
    that can be sent now, ("reasoning", text) or ("content", text); a piece
    that may be the start of a marker is held back until the next feed or
    `finish()`."""

    def __init__(self, style: str):
        self._mode = "open"  # "open": before the first characters decide; then "reasoning" or "content"
        self._style = style
        self._buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        parts: list[tuple[str, str]] = []
        if self._mode == "open":
            if START.startswith(self._buffer):
                return []  # it may yet open with the marker
            if self._buffer.startswith(START):
                self._buffer = self._buffer[len(START):]
                self._mode = "reasoning"
            else:
                self._mode = "reasoning" if self._style == "deepseek_r1" else "content"
        if self._mode == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                keep = _held(self._buffer, END)
                cut = len(self._buffer) - keep
                sendable, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return [("reasoning", sendable)] if sendable else []
            if end:
                parts.append(("reasoning", self._buffer[:end]))
            self._buffer = self._buffer[end + len(END):]
            self._mode = "content"
        if self._buffer:
            parts.append(("content", self._buffer))
            self._buffer = ""
        return parts

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, as what it turned out to be."""
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        if self._mode == "open":  # the whole output was a prefix of the start marker
            return [("reasoning" if self._style == "deepseek_r1" else "content", text)]
        return [(self._mode, text)]
