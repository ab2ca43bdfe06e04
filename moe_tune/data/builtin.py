"""A small generated instruction set on which a tiny model's loss clearly falls within a minute: integer
addition, string reversal and sorting of digits, each a chat record (a user question, the assistant's short exact
answer, and on one record in four a system message) rendered through the tokenizer's chat template."""

from __future__ import annotations

import random

SYSTEM = "Answer exactly."


def arithmetic_samples(num_samples: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_samples):
        task = rng.randrange(3)
        if task == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            question, answer = f"{a}+{b}=", str(a + b)
        elif task == 1:
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 7)))
            question, answer = f"reverse {word}:", word[::-1]
        else:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randrange(3, 7)))
            question, answer = f"sort {digits}:", "".join(sorted(digits))
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.randrange(4) == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        out.append({"messages": messages})
    return out
