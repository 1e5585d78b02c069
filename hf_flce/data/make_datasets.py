"""Regenerate the bundled toy datasets: ``python -m hf_flce.data.make_datasets``.

The examples are templated facts and small sums, short enough for a tiny model to learn in a few hundred steps on a
CPU. Preference pairs put a correct answer against a wrong one. The output is deterministic (fixed seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Chile": "Santiago",
    "Cuba": "Havana",
    "Poland": "Warsaw",
    "Ireland": "Dublin",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
}
COLORS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a lemon": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
}
ANIMALS = {"dog": "barks", "cat": "meows", "cow": "moos", "duck": "quacks", "lion": "roars", "owl": "hoots"}
WORDS = ["apple", "river", "stone", "cloud", "train", "light", "paper", "green", "music", "table", "honey", "tiger"]
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _qa(rng: random.Random) -> tuple[str, str, str]:
    """One (question, right answer, wrong answer) triple."""
    kind = rng.randrange(5)
    if kind == 0:
        country = rng.choice(list(CAPITALS))
        wrong = rng.choice([c for k, c in CAPITALS.items() if k != country])
        q = rng.choice(["What is the capital of {}?", "Name the capital of {}.", "Which city is the capital of {}?"])
        return (
            q.format(country),
            f"The capital of {country} is {CAPITALS[country]}.",
            f"The capital of {country} is {wrong}.",
        )
    if kind == 1:
        a, b = rng.randrange(7), rng.randrange(6)
        wrong = (a + b + rng.choice([1, 2, 3])) % 13
        return (
            f"What is {a} plus {b}?",
            f"{a} plus {b} is {NUMBER_WORDS[a + b]}.",
            f"{a} plus {b} is {NUMBER_WORDS[wrong]}.",
        )
    if kind == 2:
        thing = rng.choice(list(COLORS))
        wrong = rng.choice([c for t, c in COLORS.items() if t != thing])
        return (
            f"What color is {thing}?",
            f"{thing.capitalize()} is {COLORS[thing]}.",
            f"{thing.capitalize()} is {wrong}.",
        )
    if kind == 3:
        animal = rng.choice(list(ANIMALS))
        wrong = rng.choice([s for a, s in ANIMALS.items() if a != animal])
        return f"What sound does a {animal} make?", f"A {animal} {ANIMALS[animal]}.", f"A {animal} {wrong}."
    word = rng.choice(WORDS)
    spelled = " ".join(word)
    wrong = " ".join(rng.sample(word, len(word)))
    return f"Spell the word {word}.", f"{word} is spelled {spelled}.", f"{word} is spelled {wrong}."


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    rng = random.Random(0)
    chat, prompt_completion, preference = [], [], []
    for _ in range(400):
        q, good, _bad = _qa(rng)
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": good}]
        if rng.random() < 0.3:  # some two-turn conversations, so assistant masks have gaps
            q2, good2, _ = _qa(rng)
            turns += [{"role": "user", "content": q2}, {"role": "assistant", "content": good2}]
        chat.append({"messages": turns})
    for _ in range(300):
        q, good, _bad = _qa(rng)
        prompt_completion.append(
            {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": good}]}
        )
    for _ in range(300):
        q, good, bad = _qa(rng)
        preference.append(
            {
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
        )
    _write(HERE / "sft_chat.jsonl", chat)
    _write(HERE / "sft_prompt_completion.jsonl", prompt_completion)
    _write(HERE / "preference.jsonl", preference)


if __name__ == "__main__":
    main()
