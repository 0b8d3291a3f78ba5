"""Writes sft-tiny: a small, formulaic chat dataset a ~3M-parameter byte-level model can learn.

    python scripts/make_sft_tiny.py                    # writes data/sft_tiny/{train,eval}.jsonl, template.jinja
    python scripts/make_sft_tiny.py --out /tmp/sft     # somewhere else

Deterministic (a fixed seed): the committed files are this script's output byte for byte
(tests/data/test_sft_tiny.py checks it). Every example is a user question and an assistant answer
(under 60 bytes) from seven small tables (capitals, colours, animal sounds, greetings, sums,
plurals, opposites); about a third have a system prompt and some are two-turn conversations. The
eval set asks about items held out of the training set, in the same patterns, so its loss shows
what was learned beyond memorizing: the answers' pattern always, the fact where it can be copied
or computed (greetings, plurals, sums).

Use it with ``data.format: chat``, ``data.tokenizer: byte`` and
``data.chat_template: data/sft_tiny/template.jinja``.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SEED = 1234
HELD_OUT = 0.15  # share of each table's items kept for the eval set
TRAIN_TWO_TURN, EVAL_SINGLE, EVAL_TWO_TURN = 60, 36, 4

# The byte tokenizer's special names <|bos|> and <|eos|> become its special ids; the assistant's
# turn ends with eos, so generation stops there.
TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}
{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- '\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}
"""

SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer in one short sentence.", "Be brief."]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Austria": "Vienna", "Poland": "Warsaw", "Greece": "Athens", "Sweden": "Stockholm",
    "Norway": "Oslo", "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin",
    "Belgium": "Brussels", "Hungary": "Budapest", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Russia": "Moscow", "Peru": "Lima",
    "Chile": "Santiago", "Cuba": "Havana", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Turkey": "Ankara", "Iran": "Tehran", "Iraq": "Baghdad", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "Argentina": "Buenos Aires", "Colombia": "Bogota", "Nepal": "Kathmandu",
    "Ghana": "Accra", "Morocco": "Rabat", "Romania": "Bucharest", "Ukraine": "Kyiv",
    "Iceland": "Reykjavik", "Australia": "Canberra",
}
COLOURS = {
    "banana": "yellow", "lemon": "yellow", "strawberry": "red", "tomato": "red", "cherry": "red",
    "lime": "green", "frog": "green", "leaf": "green", "cucumber": "green", "carrot": "orange",
    "orange": "orange", "pumpkin": "orange", "plum": "purple", "grape": "purple", "crow": "black",
    "coal": "black", "swan": "white", "cloud": "white", "snowball": "white", "chocolate bar": "brown",
    "walnut": "brown", "flamingo": "pink", "clear sky": "blue", "blueberry": "blue", "sapphire": "blue",
    "emerald": "green", "ruby": "red", "pearl": "white", "raven": "black", "canary": "yellow",
}
SOUNDS = {
    "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink",
    "horse": "neigh", "owl": "hoot", "lion": "roar", "snake": "hiss", "bee": "buzz", "mouse": "squeak",
    "frog": "ribbit", "goat": "maa", "crow": "caw", "donkey": "hee-haw", "rooster": "cock-a-doodle-doo",
    "wolf": "howl", "chick": "cheep", "dove": "coo",
}
NAMES = [
    "Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo",
    "Mia", "Noah", "Olga", "Paul", "Quinn", "Rosa", "Sam", "Tina", "Umar", "Vera", "Will", "Xena",
    "Yusuf", "Zoe", "Amir", "Bella", "Carl", "Dora", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade",
    "Karl", "Lina", "Max", "Nina",
]
PLURALS = [
    "cat", "dog", "book", "tree", "car", "bird", "apple", "chair", "table", "house", "river", "cup",
    "lamp", "shoe", "door", "road", "ship", "star", "hat", "pen", "ring", "boat", "cake", "hill",
    "desk", "coin", "bell", "kite", "drum", "rock",
]
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "old": "new",
    "happy": "sad", "light": "dark", "open": "closed", "full": "empty", "hard": "soft", "early": "late",
    "high": "low", "long": "short", "rich": "poor", "loud": "quiet", "wet": "dry", "thick": "thin",
    "left": "right", "near": "far", "strong": "weak", "clean": "dirty", "first": "last", "win": "lose",
}


def _article(noun: str) -> str:
    return ("An " if noun[0] in "aeiou" else "A ") + noun


def _pairs() -> dict[str, list[tuple[str, str]]]:
    """Every (question, answer) of each table, in a fixed order."""
    sums = [(a, b) for a in range(10) for b in range(10)]
    return {
        "capitals": [(f"What is the capital of {c}?", f"The capital of {c} is {city}.")
                     for c, city in CAPITALS.items()],
        "colours": [(f"What colour is {_article(x).lower()}?", f"{_article(x)} is {colour}.")
                    for x, colour in COLOURS.items()],
        "sounds": [(f"What sound does {_article(x).lower()} make?", f"{_article(x)} says {sound}.")
                   for x, sound in SOUNDS.items()],
        "greetings": [(f"Say hello to {n}.", f"Hello, {n}! Nice to meet you.") for n in NAMES],
        "sums": [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in sums],
        "plurals": [(f"What is the plural of {w}?", f"The plural of {w} is {w}s.") for w in PLURALS],
        "opposites": [(f"What is the opposite of {w}?", f"The opposite of {w} is {o}.")
                      for w, o in OPPOSITES.items()],
    }


def _split(rng: random.Random) -> tuple[list, list]:
    """Each table's items shuffled, the first HELD_OUT share kept for eval."""
    train, held_out = [], []
    for items in _pairs().values():
        items = list(items)
        rng.shuffle(items)
        k = max(1, round(HELD_OUT * len(items)))
        held_out += items[:k]
        train += items[k:]
    return train, held_out


def _conversation(rng: random.Random, turns: list[tuple[str, str]]) -> dict:
    messages = []
    if rng.random() < 1 / 3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def make_examples(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """The train and eval conversations: every training item once, plus two-turn conversations."""
    rng = random.Random(seed)
    train_items, held_out = _split(rng)
    train = [_conversation(rng, [item]) for item in train_items]
    train += [_conversation(rng, rng.sample(train_items, 2)) for _ in range(TRAIN_TWO_TURN)]
    rng.shuffle(train)
    rng.shuffle(held_out)
    single, rest = held_out[:EVAL_SINGLE], held_out[EVAL_SINGLE:]
    evaluation = [_conversation(rng, [item]) for item in single]
    evaluation += [_conversation(rng, [rest[i % len(rest)], single[i]]) for i in range(EVAL_TWO_TURN)]
    return train, evaluation


def write(out: str, seed: int = SEED) -> list[str]:
    """Writes train.jsonl, eval.jsonl and template.jinja into ``out``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    train, evaluation = make_examples(seed)
    paths = []
    for name, records in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        paths.append(path)
    path = os.path.join(out, "template.jinja")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(TEMPLATE)
    return paths + [path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "sft_tiny")
    parser.add_argument("--out", default=os.path.normpath(default), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
