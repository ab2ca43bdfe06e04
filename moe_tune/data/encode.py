"""Samples to token ids and labels (-100: no loss).

Chat samples are rendered with the chat template (the tokenizer's, or ``data.chat_template``). Which tokens carry
loss is exact whichever the template:
- a template with ``{% generation %}`` blocks: transformers' assistant mask (``return_assistant_tokens_mask``),
  the k-th marked span being the k-th assistant message;
- otherwise, the diff of renders: the tokens message i adds are those of ``render(messages[:i + 1])`` past
  ``render(messages[:i], add_generation_prompt=True)`` (so the assistant header stays prompt; an assistant turn that
  opens the conversation: past what precedes the part it adds after a probe user turn, so neither the header nor a
  system prompt the template adds by default carries loss). Both renders must be
  prefixes of the whole conversation's render, token for token. Where only their text is a prefix (a tokenizer
  merging across the boundary), the rule is the one transformers uses for generation blocks: a token is trainable
  if its characters overlap the message's text span. Where not even the text is (a template that renders a turn
  differently once later turns follow), the run stops at the record (whatever data.on_bad_record says) naming it
  and the fixes: masks are never guessed.
Qwen3's, GPT-OSS's, GLM-4-MoE's and DeepSeek-V3's own templates are such templates (moe_tune.data.templates):
with the tokenizer's template one of these (no data.chat_template), a record is rendered with the family's
training template wherever that gives the original's text (single-turn records), and for records with more than one
assistant turn carrying loss (data.train_on=assistant), where it keeps every turn's reasoning; its {% generation %}
blocks give the masks. A conversational prompt/completion record's prompt turns carry no loss: the original renders
its history, as for data.train_on=last_assistant.
An end-of-turn token outside a generation block's mask is warned about once: the model would not learn to stop; so
is a template that renders no special token between an answer and the next turn (one written for another tokenizer).
A template that closes no turn (GLM's) ends one with the next turn's special role token: it carries loss, and one
is appended after a final trained turn.
Completion samples are ``bos + prompt + completion + eos`` (loss on completion and eos), text samples
``bos + text + eos``; a prompt or text that starts with the bos token, or a completion or text that ends with the eos
token, already (text exported with its special tokens) does not get it twice. The first token of every sample has
no label: nothing in the row before it belongs to it.
"""

from __future__ import annotations

import logging

from moe_tune.config import DataConfig, DataError
from moe_tune.data.cut import CUT_MARGIN, cut_sample, longest_token_chars, max_record_chars
from moe_tune.data.records import BadRecord, Chat, Completion, Text
from moe_tune.data.templates import (
    GENERATION_BLOCK,
    end_of_turn_token,
    next_turn_token,
    render_chat,
    special_ids,
    takes_text_arguments,
    training_template,
    turn_end_text,
    with_text_arguments,
)

log = logging.getLogger("moe_tune")
IGNORE = -100


class Encoder:
    """``encoder(sample) -> (ids, labels)``; BadRecord for a record the template refuses or that has no token
    carrying loss within ``seq_len``."""

    def __init__(self, tokenizer, cfg: DataConfig, seq_len: int):
        self.tokenizer, self.train_on, self.seq_len = tokenizer, cfg.train_on, seq_len
        self.template = read_template(cfg.chat_template) if cfg.chat_template else tokenizer.chat_template
        self.markers = bool(self.template and GENERATION_BLOCK.search(self.template))
        self.training = None if cfg.chat_template else training_template(tokenizer, self.template)
        self.announced = False  # the training template's log line, once
        self.end_of_turn: dict[str, str | None] = {}  # template -> its end-of-turn token (warned about once)
        self.next_turn: dict[str, str | None] = {}  # template -> the token that ends a turn it closes with none
        self.special = special_ids(tokenizer)  # ids of the special tokens, read once, not per record
        self.text_arguments: bool | None = None  # whether the template renders tool calls' arguments as text only
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.max_chars = max_record_chars(tokenizer, seq_len)  # what is rendered and tokenized of a record
        self.noted_cut = False  # the cut's log line, once
        self.notes: list[tuple[int, str]] = []  # (level, line) of what the template's checks logged, kept with the data
        self.log_notes = True  # False while data.num_proc's workers encode: the main process says what they note
        self.said: set[str] = set()

    def __call__(self, sample: Chat | Completion | Text) -> tuple[list[int], list[int]]:
        sample, cut = self._cut(sample)
        if isinstance(sample, Chat):
            ids, labels = self.chat(sample)
        elif isinstance(sample, Completion):
            prompt = self._with_bos(self._tokens(sample.prompt))
            completion = self._with_eos(self._tokens(sample.completion))
            ids = prompt + completion
            labels = ids if self.train_on == "all" else [IGNORE] * len(prompt) + completion
        else:
            ids = self._with_eos(self._with_bos(self._tokens(sample.text)))
            labels = ids
        labels = [IGNORE] + labels[1:]
        if all(x == IGNORE for x in labels[: self.seq_len]):
            detail = f"no token carries loss (data.train_on={self.train_on})"
            if len(ids) <= self.seq_len:
                raise BadRecord("no_trainable_token", detail)
            n = len(ids)
            fix = f"raise train.seq_len to at least {n} (e.g. train.seq_len={1 << (n - 1).bit_length()})"
            if cut:  # its length is unknown: far above train.seq_len
                fix = f"raise train.seq_len above {n}, or shorten the record"
            size = f"over {n}" if cut else n
            raise BadRecord("no_trainable_token", f"{detail} within train.seq_len={self.seq_len} ({size} tokens)", fix)
        return ids, labels

    def _cut(self, sample: Chat | Completion | Text) -> tuple[Chat | Completion | Text, bool]:
        """(the sample cut to ``max_chars`` characters of text, whether it was); says once that records are cut."""
        sample, cut = cut_sample(sample, self.max_chars)
        if cut and not self.noted_cut:
            self.noted_cut = True
            log.info(
                "data: a record longer than %d characters (%d x the tokenizer's longest token, %d characters, x "
                "train.seq_len=%d) is cut to that before it is tokenized: its first train.seq_len tokens are the "
                "same, and memory stays bounded whatever a record's size",
                self.max_chars,
                CUT_MARGIN,
                longest_token_chars(self.tokenizer),
                self.seq_len,
            )
        return sample, cut

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        """``ids`` after the bos token, unless they start with it: a second would train the model on two."""
        return ids if ids[: len(self.bos)] == self.bos else self.bos + ids

    def _with_eos(self, ids: list[int]) -> list[int]:
        """``ids`` and the eos token, unless they end with it: a second would teach the model to emit it twice."""
        return ids if not self.eos or ids[-1:] == self.eos else ids + self.eos

    def render(self, messages: list[dict], tools, generation_prompt: bool = False, template: str | None = None) -> str:
        if self.template is None:
            raise DataError(
                "chat records need a chat template and the tokenizer has none; set data.chat_template=<jinja file> "
                "(e.g. the one in your model's tokenizer_config.json), or give prompt/response or text records"
            )
        try:
            return render_chat(
                self.tokenizer,
                messages,
                tools=tools,
                chat_template=template or self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja's own and the template's raise_exception (e.g. roles must alternate)
            fix = "give data.chat_template=<jinja file> that renders such records"  # the record may well be right
            raise BadRecord("template_error", f"the chat template refused it: {e}", fix) from None

    def chat(self, sample: Chat) -> tuple[list[int], list[int]]:
        sample = self._with_text_arguments(sample)
        text = self.render(sample.messages, sample.tools)
        if self.train_on == "all":
            ids = self._tokens(text)
            return ids, list(ids)
        encoded = self._with_training_template(sample, text) if self.training is not None else None
        if encoded is not None:
            return self._stopped(self.training.text, *encoded)
        encoded = self._marked(sample, self.template) if self.markers else None
        return self._stopped(self.template, *(encoded or self._diffed(sample, text)))

    def _with_text_arguments(self, sample: Chat) -> Chat:
        """``sample`` with its tool calls' arguments as JSON text where the template renders no object there
        (DeepSeek-V3's); records hold them as objects (a ShareGPT function_call's are read so)."""
        if not any(m.get("tool_calls") for m in sample.messages):
            return sample
        if self.text_arguments is None:
            self.text_arguments = takes_text_arguments(self.tokenizer, self.template)
        if not self.text_arguments:
            return sample
        messages = [
            {**m, "tool_calls": [with_text_arguments(c) for c in m["tool_calls"]]}
            if isinstance(m.get("tool_calls"), list)
            else m
            for m in sample.messages
        ]
        return Chat(messages, sample.tools, sample.trainable)

    def _stopped(self, template: str, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """A template that closes no assistant turn (GLM's: the next turn's role token ends it, and its generation
        config stops on <|user|> or <|observation|>): the special token right after each trained turn carries loss,
        and a trained final turn gets the token the template opens a next user turn with, so the model learns to
        stop. Other templates: as they are."""
        if template not in self.next_turn:
            self.next_turn[template] = next_turn_token(self.tokenizer, template)
            self._check_stop(template)
        if self.next_turn[template] is None:
            return ids, labels
        ends = [end for _, end in _runs([int(x != IGNORE) for x in labels])]
        labels = list(labels)
        for end in ends:
            if end < len(ids) and ids[end] in self.special:
                labels[end] = ids[end]
        if ends and ends[-1] == len(ids):
            stop = self.tokenizer.convert_tokens_to_ids(self.next_turn[template])
            ids, labels = ids + [stop], labels + [stop]
        return ids, labels

    def _with_training_template(self, sample: Chat, text: str) -> tuple[list[int], list[int]] | None:
        """The sample through the family's training template, if it renders the original's text or more than one of
        its assistant turns carries loss; else None (the tokenizer's template). Assistant turns that carry none (a
        conversational prompt's) are context: rendered as the original renders them, as inference will."""
        multi_turn = sum(sample.trainable) > 1
        if not multi_turn and self.render(sample.messages, sample.tools, template=self.training.text) != text:
            return None
        encoded = self._marked(sample, self.training.text)
        if encoded is not None and multi_turn and not self.announced:
            self.announced = True
            self.note(
                logging.INFO,
                f"data: chat template: {self.training.name} training template (keeps every turn's reasoning); set "
                "data.chat_template to use your own",
            )
        return encoded

    def _marked(self, sample: Chat, template: str) -> tuple[list[int], list[int]] | None:
        """Masks from the template's generation blocks; None if their spans do not pair with assistant messages."""
        out = render_chat(
            self.tokenizer,
            sample.messages,
            tools=sample.tools,
            chat_template=template,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        spans = _runs(mask)
        assistants = [t for m, t in zip(sample.messages, sample.trainable) if m["role"] == "assistant"]
        if len(spans) != len(assistants):
            return None
        labels = [IGNORE] * len(ids)
        for (start, end), trainable in zip(spans, assistants):
            if trainable:
                labels[start:end] = ids[start:end]
        self._check_end_of_turn(template, ids, [span for span, t in zip(spans, assistants) if t])
        return ids, labels

    def note(self, level: int, line: str) -> None:
        """Keeps ``line`` and logs it once in this process (``log_notes``): the data cache stores it with the
        records, and a run that reads them from there (tokenized by the command's quiet record check, or an earlier
        run) logs it again; data.num_proc's workers each note a check once, and the main process says it once."""
        if (level, line) not in self.notes:
            self.notes.append((level, line))
        if self.log_notes and line not in self.said:
            self.said.add(line)
            log.log(level, "%s", line)

    def _check_stop(self, template: str) -> None:
        """Warns if no special token ends an assistant turn (a template written for another tokenizer, whose
        <|eot_id|> this one reads as plain characters): the model has no token to learn to stop on, and
        generation_config.json none to stop at."""
        between = turn_end_text(self.tokenizer, template)
        if between is None or self.special & set(self._tokens(between)):
            return
        names = sorted(self.tokenizer.convert_ids_to_tokens(sorted(self.special)))
        specials = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        self.note(
            logging.WARNING,
            f"data: the chat template ends an assistant turn with {between!r}, which holds none of the tokenizer's "
            f"special tokens ({specials}): the model will learn no token to end its turns on, and generation will "
            "not stop there; give data.chat_template a template written for this tokenizer",
        )

    def _check_end_of_turn(self, template: str, ids: list[int], turns: list[tuple[int, int]]) -> None:
        """Warns once per template if its end-of-turn token follows an assistant turn's mask, outside it, before
        the next turn's (GPT-OSS ends earlier turns with <|end|>, the last with <|return|>: the absent token alone
        is not a fault)."""
        if template not in self.end_of_turn:
            self.end_of_turn[template] = end_of_turn_token(self.tokenizer, template)
        token = self.end_of_turn[template]
        if token is None:
            return
        eot = self.tokenizer.convert_tokens_to_ids(token)
        ends = [s for s, _ in turns[1:]] + [len(ids)]
        if any(eot not in ids[s:e] and eot in ids[e:after] for (s, e), after in zip(turns, ends)):
            self.note(
                logging.WARNING,
                f"data: the chat template's end-of-turn token {token} falls outside the assistant mask: the model will "
                "not learn to end its turns; close the {% generation %} block after it",
            )
            self.end_of_turn[template] = None  # once

    def _diffed(self, sample: Chat, text: str) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        labels = [IGNORE] * len(ids)
        for i, trainable in enumerate(sample.trainable):
            if not trainable:
                continue
            after = self.render(sample.messages[: i + 1], sample.tools)
            before = self.render(sample.messages[:i], sample.tools, True) if i else self._opening(sample, after)
            if not (text.startswith(after) and after.startswith(before)):
                raise BadRecord(
                    "template_rewrites_history",
                    f"the chat template renders message {i} differently once later messages follow (a shorter "
                    "conversation's render is not a prefix of the longer one), so its loss mask cannot be found "
                    "by diffing renders; use a template with {% generation %} blocks (data.chat_template=<file>) "
                    "or data.train_on=last_assistant|all",
                )
            start, end = self._token_prefix(before, ids), self._token_prefix(after, ids)
            if start is None or end is None:  # text prefixes, token boundaries merged: by character spans
                span = [j for j, (a, b) in enumerate(offsets) if a < len(after) and b > len(before)]
                start, end = (span[0], span[-1] + 1) if span else (0, 0)
            labels[start:end] = ids[start:end]
        return ids, labels

    def _opening(self, sample: Chat, after: str) -> str:
        """The text of ``after`` (message 0 rendered alone, an assistant's) before its trainable part: the template's
        preamble (a default system prompt) and the assistant header, none of which the message wrote. transformers
        renders no empty conversation to diff against, so the part is what the message adds after a probe user
        turn's generation prompt; ``after`` must end with it."""
        probe = [{"role": "user", "content": "?"}]
        prompt = self.render(probe, sample.tools, True)
        turn = self.render(probe + sample.messages[:1], sample.tools)
        part = turn[len(prompt) :] if turn.startswith(prompt) else ""
        if not part or not after.endswith(part):
            raise BadRecord(
                "template_rewrites_history",
                "the chat template renders an assistant turn that opens the conversation differently from one that "
                "follows a user turn, so its loss mask cannot be found by diffing renders; use a template with "
                "{% generation %} blocks (data.chat_template=<file>), or open the conversation with a user turn",
            )
        return after[: len(after) - len(part)]

    def _token_prefix(self, prefix: str, ids: list[int]) -> int | None:
        """len(tokens(prefix)) if they are the first tokens of ``ids``, else None."""
        head = self._tokens(prefix) if prefix else []
        return len(head) if ids[: len(head)] == head else None


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def read_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template={path} cannot be read ({e}); give a Jinja chat template file") from None
