"""A generated chat set with lognormal lengths, for the benchmarks that compare stacks on the same records.

Each record is ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}`` with one to three
user/assistant turns. Its length in characters (one token each with moe_tune's built-in tokenizer, plus the chat
template's few per message) is drawn lognormal (median ``--median``, sigma ``--sigma``), at least 16 and at most
what fits ``--seq-len`` with the template; about a quarter of each turn is the user's, the rest the assistant's
(the tokens that carry loss with data.train_on=assistant). Deterministic for a seed.

    python benchmarks/chat_lognormal.py OUT.jsonl --records 2000 --median 900 --sigma 0.7 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import math
import random

ALPHABET = "abcdefghijklmnopqrstuvwxyz      "  # spaces six times as often as a letter: word-like runs
TEMPLATE_TOKENS_PER_MESSAGE = 16  # ChatML's <|im_start|>, role, newlines, <|im_end|>, with room to spare


def record(rng: random.Random, median: float, sigma: float, seq_len: int) -> dict:
    turns = rng.choice((1, 1, 2, 3))
    room = seq_len - 2 * turns * TEMPLATE_TOKENS_PER_MESSAGE
    length = min(room, max(16, round(rng.lognormvariate(math.log(median), sigma))))
    messages = []
    for i in range(turns):
        share = length // turns + (length % turns if i == turns - 1 else 0)
        user = max(1, share // 4)
        for role, n in (("user", user), ("assistant", max(1, share - user))):
            messages.append({"role": role, "content": "".join(rng.choice(ALPHABET) for _ in range(n)).strip() or "a"})
    return {"messages": messages}


def write(path: str, records: int, median: float, sigma: float, seq_len: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps(record(rng, median, sigma, seq_len)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--median", type=float, default=900.0)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.records, args.median, args.sigma, args.seq_len, args.seed)


if __name__ == "__main__":
    main()
