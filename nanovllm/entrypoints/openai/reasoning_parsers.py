"""Reasoning parsers: a thinking model's `<think>...</think>` -> `reasoning_content`, the rest `content`.

Registry by `--reasoning-parser` name (vLLM's names):

- `deepseek_r1`: the template opens the thinking in the prompt, so the output starts in it
  (a leading `<think>` is dropped) and leaves it at `</think>`;
- `qwen3`: the model opens it with `<think>` itself; an output that does not start with
  `<think>` is all content.

If the prompt already closed the thinking (`enable_thinking: false` templates write
`<think></think>` into it), the whole output is content. The end tag's token id goes to
the engine: a request's output constraint starts after it (StructuredOutputsParams'
`start_after_token_id`), so the thinking is free and the answer follows the schema.
A parser follows one choice's text: `feed(delta)` -> (reasoning, content) to send now.
"""
from dataclasses import dataclass

from nanovllm.entrypoints.openai.tool_parsers import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningConfig:
    name: str
    start_token_id: int
    end_token_id: int

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt closed the thinking after it last opened it."""
        ends = [i for i, t in enumerate(prompt_token_ids) if t == self.end_token_id]
        starts = [i for i, t in enumerate(prompt_token_ids) if t == self.start_token_id]
        return bool(ends) and (not starts or ends[-1] > starts[-1])

    def parser(self, prompt_token_ids: list[int]) -> "ReasoningParser":
        if self.prompt_ends_reasoning(prompt_token_ids):
            return ReasoningParser(state="content")
        return ReasoningParser(state="thinking" if self.name == "deepseek_r1" else "undecided")


class ReasoningParser:
    def __init__(self, state: str):
        self.state = state  # "undecided" (qwen3, nothing yet), "thinking" or "content"
        self.pending = ""
        self.seen_start = False

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "content":
            text, self.pending = self.pending + delta, ""
            return "", text
        self.pending += delta
        if self.state == "undecided":
            head = self.pending.lstrip()
            if START.startswith(head):
                return "", ""  # maybe the start tag, not complete yet
            self.state = "thinking" if head.startswith(START) else "content"
            if self.state == "content":
                text, self.pending = self.pending, ""
                return "", text
        return self._thinking()

    def _thinking(self) -> tuple[str, str]:
        if not self.seen_start:
            head = self.pending.lstrip()
            if START.startswith(head) and head != START:
                return "", ""
            if head.startswith(START):
                self.pending = head[len(START):]
            self.seen_start = True
        i = self.pending.find(END)
        if i >= 0:
            reasoning, content = self.pending[:i], self.pending[i + len(END):]
            self.pending, self.state = "", "content"
            return reasoning, content
        keep = held_back(self.pending, END)
        reasoning = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What is held back when the output ends: unfinished thinking stays thinking."""
        text, self.pending = self.pending, ""
        if self.state == "thinking":
            return text, ""
        return "", text


REASONING_PARSERS = ("deepseek_r1", "qwen3")


def reasoning_config(name: str, tokenizer) -> ReasoningConfig:
    """The parser `name` for this tokenizer; ValueError if unknown or the tags are not single tokens."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    ids = []
    for tag in (START, END):
        token_ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(token_ids) != 1:
            raise ValueError(f"reasoning parser {name!r}: {tag} is not one token of this tokenizer "
                             f"(it encodes to {token_ids})")
        ids.append(token_ids[0])
    return ReasoningConfig(name, *ids)
