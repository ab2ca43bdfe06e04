"""A small generated instruction set on which a tiny model's loss clearly falls within a minute: integer
addition, string reversal and sorting of digits, each a prompt and a short exact answer."""

from __future__ import annotations

import random


def arithmetic_samples(num_samples: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_samples):
        task = rng.randrange(3)
        if task == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            out.append({"prompt": f"{a}+{b}=", "response": str(a + b)})
        elif task == 1:
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 7)))
            out.append({"prompt": f"reverse {word}:", "response": word[::-1]})
        else:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randrange(3, 7)))
            out.append({"prompt": f"sort {digits}:", "response": "".join(sorted(digits))})
    return out
