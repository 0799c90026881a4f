"""Checkable tasks for training and evaluating small diffusion LMs, with their word-level tokenizer.

`arithmetic`: a three-step word problem (multiply, add, subtract) whose answer is a worked solution of
about 100 tokens (digits are single tokens) that adds and subtracts digit by digit, with carries and
borrows spelled out, and ends in "The answer is N .". Problems are split by a hash
of their numbers: training draws only from the train split, evaluation (any `--seed`) only from the
held-out split, so evaluated problems are never trained on.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

SPECIALS = ["[PAD]", "[MASK]", "[EOS]", "[BOS]"]
NAMES = ["Ana", "Ben", "Carla", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "marbles", "stickers", "cards", "pens", "books", "coins", "shells"]
WORDS = ("has buys bags with in each bag and then gives away how many does have now ? starts , so . "
         "after buying the answer is * + - = Each After Then How The So Add Take ones tens write carry "
         "borrow :").split()


@dataclass
class Problem:
    prompt: str
    solution: str
    answer: int


def _heldout(a: int, k: int, m: int, g: int) -> bool:
    return zlib.crc32(f"{a},{k},{m},{g}".encode()) % 10 == 0


def _digits(n: int) -> str:
    return " ".join(str(n))


def _add_steps(x: int, y: int) -> str:
    """Column addition of two numbers below 100 whose sum is below 100, carries spelled out."""
    ones = x % 10 + y % 10
    carry = ones // 10
    tens = x // 10 + y // 10 + carry
    return (f"ones {x % 10} + {y % 10} = {_digits(ones)} , write {ones % 10} carry {carry} . "
            f"tens {x // 10} + {y // 10} + {carry} = {tens} .")


def _subtract_steps(x: int, y: int) -> str:
    """Column subtraction of a one-digit y from a two-digit x (x > y), borrows spelled out."""
    if x % 10 >= y:
        return f"ones {x % 10} - {y} = {x % 10 - y} . tens {x // 10} - 0 = {x // 10} ."
    return (f"ones {x % 10} - {y} , borrow , {_digits(10 + x % 10)} - {y} = {10 + x % 10 - y} . "
            f"tens {x // 10} - 1 = {x // 10 - 1} .")


def arithmetic_problem(rng: random.Random, heldout: bool) -> Problem:
    while True:
        a, k, m, g = rng.randint(10, 49), rng.randint(2, 5), rng.randint(2, 9), rng.randint(1, 9)
        if _heldout(a, k, m, g) == heldout:
            break
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    km, s = k * m, a + k * m
    r = s - g
    prompt = (f"{name} has {a} {item} . {name} buys {k} bags with {m} {item} in each bag and then gives away "
              f"{g} {item} . How many {item} does {name} have now ?")
    solution = (f"{name} starts with {a} {item} . Each bag has {m} {item} , so {k} bags have {k} * {m} = {km} "
                f"{item} . Add : {a} + {km} : {_add_steps(a, km)} So {name} has {s} {item} . Take away {g} : "
                f"{_subtract_steps(s, g)} So {name} has {r} {item} . The answer is {r} .")
    return Problem(prompt, solution, r)


TASKS = {"arithmetic": arithmetic_problem}


def make_problems(task: str, n: int, seed: int, heldout: bool) -> list[Problem]:
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; known: {sorted(TASKS)}.")
    rng = random.Random(seed)
    return [TASKS[task](rng, heldout) for _ in range(n)]


def final_answer(text: str) -> int | None:
    """The number after the last "The answer is" in decoded text (digits may be space-separated)."""
    found = re.findall(r"The answer is ((?:\d\s*)+)", text)
    return int(found[-1].replace(" ", "")) if found else None


def build_tokenizer():
    """A word-level tokenizer over the tasks' words, single digits and the specials ([MASK] = 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [str(d) for d in range(10)] + sorted(set(WORDS + NAMES + ITEMS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", mask_token="[MASK]",
                                   eos_token="[EOS]", bos_token="[BOS]")
