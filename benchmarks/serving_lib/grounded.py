"""Input-grounded prompts: answers that copy spans of the prompt (the workload where drafting from
the prompt, n-gram / prompt lookup speculation, pays).

Four tasks, in turn, as completion prompts a base or instruct model continues by copying: repeat a
passage word for word, quote the one note that mentions a word, rewrite a passage with one word
replaced, and rename a function in a piece of Python. Passages and code are made of the workload's
single-token words (``workload.WORDS``), drawn from a seeded generator, so the prompts are the same
in every run and for every server compared.
"""

from __future__ import annotations

import random

TASKS = ("repeat", "extract", "replace", "rename")


def sentence(rng: random.Random, words: tuple[str, ...], count: int) -> str:
    """``count`` words as a sentence: capitalised, with a comma in the middle, ending in a period."""
    chosen = rng.choices(words, k=count)
    chosen[count // 2] += ","
    return " ".join(chosen).capitalize() + "."


def passage(rng: random.Random, words: tuple[str, ...], num_words: int) -> str:
    """Sentences of 8 to 14 words, about ``num_words`` in all."""
    sentences, total = [], 0
    while total < num_words:
        n = rng.randint(8, 14)
        sentences.append(sentence(rng, words, n))
        total += n
    return " ".join(sentences)


def code(rng: random.Random, words: tuple[str, ...], name: str, num_lines: int) -> str:
    """A Python function ``name`` of about ``num_lines`` lines over variables named after words."""
    a, b, c = rng.sample(words, 3)
    lines = [f"def {name}({a}, {b}):", f"    {c} = {a} + {b}"]
    while len(lines) < num_lines:
        x, y = rng.sample([a, b, c], 2)
        op = rng.choice(["+", "-", "*"])
        if rng.random() < 0.3:
            lines += [f"    if {x} > {rng.randint(1, 99)}:", f"        {c} = {x} {op} {y}"]
        else:
            lines.append(f"    {c} = {c} {op} {x}")
    lines.append(f"    return {c}")
    return "\n".join(lines)


def grounded_prompt(rng: random.Random, words: tuple[str, ...], task: str, num_words: int) -> str:
    """One prompt of ``task`` whose grounding text (passage, notes or code) has about ``num_words``
    words; the prompt ends where the copied answer begins."""
    if task == "repeat":
        text = passage(rng, words, num_words)
        return f"Here is a passage:\n\n{text}\n\nThe same passage, copied word for word:\n\n"
    if task == "extract":
        notes = [sentence(rng, words, rng.randint(8, 14)) for _ in range(max(2, num_words // 11))]
        pick = rng.randrange(len(notes))
        key = notes[pick].split()[1].strip(",.")
        listed = "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes))
        return f"Notes:\n{listed}\n\nNote {pick + 1}, which mentions the {key}, quoted exactly:\n\n"
    if task == "replace":
        text = passage(rng, words, num_words)
        old = rng.choice(text.lower().replace(",", "").replace(".", "").split())
        new = rng.choice([w for w in words if w != old])
        return f"Text:\n\n{text}\n\nThe same text with every '{old}' replaced by '{new}':\n\n"
    if task == "rename":
        old, new = (f"{w}_{v}" for w, v in (rng.sample(words, 2), rng.sample(words, 2)))
        body = code(rng, words, old, max(4, num_words // 6))
        ask = f"The same code with the function {old} renamed to {new}:"
        return f"```python\n{body}\n```\n\n{ask}\n\n```python\n"
    raise ValueError(f"unknown grounded task {task!r}; choose one of {TASKS}")
