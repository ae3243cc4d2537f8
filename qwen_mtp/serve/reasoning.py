"""Thinking apart from the answer (`server.reasoning_parser: qwen3`): a chat answer's text before `</think>` is its
`reasoning_content`, the text after it its `content`, as vLLM's and SGLang's `qwen3` reasoning parsers return them.

Whether an answer starts inside a think block is read off the prompt: Qwen3 / Qwen3.5 chat templates open one at the
end of the generation prompt (`<|im_start|>assistant\\n<think>\\n`) when thinking is on, and close an empty one there
(`<think>\\n\\n</think>\\n\\n`) when `chat_template_kwargs.enable_thinking` is false. An answer that does not start
inside one may still open it with its first characters (older templates). So one rule serves streamed and whole
answers alike: reasoning runs from the answer's start (or its opening `<think>`) to the first `</think>`; an answer
cut before it (`finish_reason` "length") is all reasoning; an answer that never opens one is all content. The newlines
a model writes after `</think>` are not part of the content.

`ReasoningSplitter.push` takes the answer's text as it becomes final and returns the (reasoning, content) text that
became final: a possible beginning of a tag is held back until the next text (or `finish`) decides it. This works
on text, so the tags need not be single tokens.
"""

from __future__ import annotations

from qwen_mtp.serve.text import held_back

START, END = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a chat prompt ends inside a think block its template opened (the answer starts as reasoning)."""
    return prompt_text.rstrip().endswith(START)


class ReasoningSplitter:
    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "start"  # start: the answer may still open a think block
        self.pending = ""  # text held back: it may begin a tag
        self.after_end = False  # content has not started yet since `</think>`: its leading newlines are dropped

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) text that `text`, the answer's next final text, makes final."""
        return self._advance(self.pending + text, final=False)

    def finish(self) -> tuple[str, str]:
        """What is left at the answer's end."""
        return self._advance(self.pending, final=True)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer: (reasoning_content, content), None for an empty part."""
        reasoning, content = self.push(text)
        more = self.finish()
        return (reasoning + more[0]) or None, (content + more[1]) or None

    def _advance(self, text: str, final: bool) -> tuple[str, str]:
        self.pending = ""
        reasoning = ""
        if self.state == "start":
            if text.startswith(START):
                self.state, text = "reasoning", text[len(START) :]
            elif START.startswith(text) and not final:
                self.pending = text  # "" or a beginning of "<think>"
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = text.find(END)
            if end < 0:
                held = 0 if final else held_back(text, (END,))
                self.pending = text[len(text) - held :]
                return text[: len(text) - held], ""
            reasoning, text = text[:end], text[end + len(END) :]
            self.state, self.after_end = "content", True
        if self.after_end:
            text = text.lstrip("\n")
            self.after_end = not text
        return reasoning, text
