"""A record cut by characters before it is rendered and tokenized: only its first ``train.seq_len`` tokens can be
trained on, and rendering and tokenizing a whole record costs many times more memory than its text (token lists,
offsets, several renders per chat record). The tokenizer is given at most
``max_chars`` characters of a record's own text, whatever its size, and the first ``seq_len`` tokens stay those
of the whole record.

Why they stay: a token covers at most as many characters as its text in the vocabulary has (byte-level BPE spells
each byte as one character, and a character is at least one byte; SentencePiece, Unigram and the built-in
tokenizer spell the characters themselves), so the first ``seq_len`` tokens of a text lie within its first
``longest token x seq_len`` characters. Strings are cut in the order templates render them (tools, then each
message's fields in order), each to what is left of the budget, so every character dropped would have been
rendered after at least ``max_chars`` characters of the record's text. ``CUT_MARGIN`` times that bound keeps the
cut far from the tokens kept (a merge across the cut changes only tokens near it), and covers templates that
render the tools after the system message. Strings that name structure
(a message's role, a tool's name and type) are never cut, so a template renders the same turns.
"""

from __future__ import annotations

from moe_tune.data.records import Chat, Completion, Text

CUT_MARGIN = 2
NEVER_CUT = ("role", "name", "type")


def max_record_chars(tokenizer, seq_len: int) -> int:
    """The characters of a record's text that can hold its first ``seq_len`` tokens, with ``CUT_MARGIN``."""
    return CUT_MARGIN * longest_token_chars(tokenizer) * seq_len


def longest_token_chars(tokenizer) -> int:
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def cut_sample(sample: Chat | Completion | Text, max_chars: int) -> tuple[Chat | Completion | Text, bool]:
    """(``sample`` with its text cut to ``max_chars`` characters in rendering order, whether anything was cut); the
    sample itself when it fits."""
    cut = _Cut(max_chars)
    if isinstance(sample, Text):
        short = Text(cut(sample.text))
    elif isinstance(sample, Completion):
        short = Completion(cut(sample.prompt), cut(sample.completion))
    else:
        short = Chat(tools=cut(sample.tools), messages=cut(sample.messages), trainable=sample.trainable)
    return (short, True) if cut.cut else (sample, False)


class _Cut:
    """Cuts strings in the order it is called on them, keeping ``left`` characters in all."""

    def __init__(self, max_chars: int):
        self.left, self.cut = max_chars, False

    def __call__(self, value, key: str | None = None):
        if isinstance(value, str):
            if key in NEVER_CUT:
                return value
            if len(value) > self.left:
                value, self.cut = value[: self.left], True
            self.left -= len(value)
            return value
        if isinstance(value, dict):
            return {k: self(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value
