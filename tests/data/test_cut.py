"""A record is cut by characters before it is tokenized (moe_tune.data.cut): what the tokenizer is given stays
bounded whatever one record's size, and the tokens a row keeps (the first train.seq_len) are those of the whole
record."""

from __future__ import annotations

import random

import pytest

from moe_tune.config import DataConfig
from moe_tune.data.encode import Encoder
from moe_tune.data.records import BadRecord, Chat, Completion, Text
from moe_tune.models.presets import CHAT_TOKENS, CHATML_TEMPLATE, build_tokenizer

SEQ_LEN = 64


class _Spy:
    """Stands in for a fast tokenizer's Rust backend: records the longest text it is asked to encode."""

    def __init__(self, backend):
        self.backend, self.longest = backend, 0

    def __getattr__(self, name):
        attr = getattr(self.backend, name)
        if name not in ("encode", "encode_batch"):
            return attr

        def encode(inputs, *args, **kwargs):
            texts = inputs if name == "encode_batch" else [inputs]
            self.longest = max([self.longest, *(len(t) if isinstance(t, str) else 0 for t in texts)])
            return attr(inputs, *args, **kwargs)

        return encode


def _bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on prose and long runs of '=' and spaces (so that some tokens span
    many characters), with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<eos>", *CHAT_TOKENS])
    tok.train_from_iterator([_prose(random.Random(i), 2000) for i in range(20)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _prose(rng: random.Random, n: int) -> str:
    words = ["the", "expert", "router", "token", "gradient", "loss", "=" * 24, " " * 16, "mixture", "scale", "\n"]
    return " ".join(rng.choice(words) for _ in range(n))


def _samples(text: str) -> list:
    chat = [{"role": "user", "content": "summarise"}, {"role": "assistant", "content": text}]
    return [
        Chat(chat, trainable=[False, True]),
        Chat([{"role": "system", "content": text}, *chat], trainable=[False, False, True]),
        Completion("q: " + text[:50], text),
        Completion(text, "a"),
        Text(text),
    ]


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_the_tokenizer_gets_a_bounded_text_whatever_a_records_size(train_on):
    """A 2 MB record: the longest text the tokenizer encodes is about max_chars (plus the template's own text),
    not the record; the sample still has more than SEQ_LEN tokens, and its loss within them is as uncut."""
    tokenizer = build_tokenizer()
    spy = tokenizer._tokenizer = _Spy(tokenizer._tokenizer)
    encoder = Encoder(tokenizer, DataConfig(train_on=train_on), SEQ_LEN)
    assert encoder.max_chars < 10_000
    for sample in _samples("x" * 2_000_000):
        spy.longest = 0
        try:
            ids, labels = encoder(sample)
        except BadRecord as bad:  # the huge part is prompt: nothing within SEQ_LEN carries loss, as uncut
            assert bad.reason == "no_trainable_token" and train_on == "assistant", bad.detail
        else:
            assert SEQ_LEN < len(ids) and any(label != -100 for label in labels[:SEQ_LEN])
        assert 0 < spy.longest <= encoder.max_chars + 200, (sample, spy.longest)


@pytest.mark.parametrize("train_on", ["assistant", "all", "last_assistant"])
def test_a_cut_record_keeps_the_tokens_of_the_whole_one(train_on):
    """Tokens and labels of the first SEQ_LEN positions are those of the whole record, tokenized uncut, with a
    tokenizer whose tokens span up to tens of characters; a record that fits is encoded exactly as before."""
    tokenizer = _bpe_tokenizer()
    cut = Encoder(tokenizer, DataConfig(train_on=train_on), SEQ_LEN)
    whole = Encoder(tokenizer, DataConfig(train_on=train_on), SEQ_LEN)
    whole.max_chars = 10**12  # nothing cut: every record encoded whole
    assert cut.max_chars < 20 * SEQ_LEN * 24  # the bound is in use below, with tokens of 16 and more characters
    for sample in _samples(_prose(random.Random(7), 20_000)):
        a, b = _encoded(cut, sample), _encoded(whole, sample)
        assert a[0] < b[0] or a[0] == b[0] == "bad"
        assert a[1:] == b[1:], sample
    for sample in _samples(_prose(random.Random(8), 40)):
        assert _encoded(cut, sample, SEQ_LEN * 100) == _encoded(whole, sample, SEQ_LEN * 100)


def _encoded(encoder: Encoder, sample, keep: int = SEQ_LEN) -> tuple:
    """(length, the first ``keep`` ids, their labels), or ("bad", its reason) for a record refused."""
    try:
        ids, labels = encoder(sample)
    except BadRecord as bad:
        return "bad", bad.reason
    return len(ids), ids[:keep], labels[:keep]


def test_roles_and_tool_names_are_never_cut():
    from moe_tune.data.cut import cut_sample

    calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "y" * 50}}}]
    messages = [
        {"role": "user", "content": "x" * 50},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": "lookup", "content": "z"},
    ]
    short, was_cut = cut_sample(Chat(messages, trainable=[False, True, False]), 60)
    assert was_cut and [m["role"] for m in short.messages] == ["user", "assistant", "tool"]
    assert short.messages[0]["content"] == "x" * 50 and short.messages[2] == {
        "role": "tool",
        "name": "lookup",
        "content": "",
    }
    assert short.messages[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"q": "y" * 10}}
    fits = Chat(messages[:1], trainable=[False])
    assert cut_sample(fits, 60) == (fits, False)
