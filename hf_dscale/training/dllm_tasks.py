"""Checkable tasks for training and evaluating small diffusion LMs, with their word-level tokenizer.

`arithmetic`: a three-step word problem (multiply, add, subtract) whose answer is a worked solution of
about 100 tokens (digits are single tokens) that adds and subtracts digit by digit, with carries and
borrows spelled out, and ends in "The answer is N .". One wording, one order: a trained model writes most of it
in a few parallel steps.

`stories`: the same quantities (start with a, get k containers of m, give away g) told in three prompt
templates, and answered freely: one of three valid solution orders (multiply, add, subtract; multiply,
subtract, add; subtract, multiply, add), either operand order in the product and the sum, and a free choice
between two words of equal length at about a dozen places ("starts"/"begins", "so"/"thus", "ones"/"units",
...). Nothing in the prompt decides those choices, so a decoder must settle them one by one: each is a coin
flip the model cannot make confidently in parallel. Only the final number is checked.

Problems are split by a hash
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


def draw_numbers(rng: random.Random, heldout: bool) -> tuple[int, int, int, int]:
    """(a, k, m, g): start with a, k containers of m each, give away g; from the train or held-out split."""
    while True:
        a, k, m, g = rng.randint(10, 49), rng.randint(2, 5), rng.randint(2, 9), rng.randint(1, 9)
        if _heldout(a, k, m, g) == heldout:
            return a, k, m, g


def arithmetic_problem(rng: random.Random, heldout: bool) -> Problem:
    a, k, m, g = draw_numbers(rng, heldout)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    km, s = k * m, a + k * m
    r = s - g
    prompt = (f"{name} has {a} {item} . {name} buys {k} bags with {m} {item} in each bag and then gives away "
              f"{g} {item} . How many {item} does {name} have now ?")
    solution = (f"{name} starts with {a} {item} . Each bag has {m} {item} , so {k} bags have {k} * {m} = {km} "
                f"{item} . Add : {a} + {km} : {_add_steps(a, km)} So {name} has {s} {item} . Take away {g} : "
                f"{_subtract_steps(s, g)} So {name} has {r} {item} . The answer is {r} .")
    return Problem(prompt, solution, r)


CONTAINERS = [("bag", "bags"), ("box", "boxes"), ("pack", "packs")]
STORY_WORDS = ("begins Every holds hold thus Join units put Now Give owns gets of them had at first giving "
               "boxes box packs pack it").split()


def _pick(rng: random.Random, *words: str) -> str:
    return rng.choice(words)


def _story_add(rng: random.Random, x: int, y: int) -> str:
    ones, write = _pick(rng, "ones", "units"), _pick(rng, "write", "put")
    return _add_steps(x, y).replace("ones", ones, 1).replace("write", write, 1)


def _story_subtract(rng: random.Random, x: int, y: int) -> str:
    return _subtract_steps(x, y).replace("ones", _pick(rng, "ones", "units"), 1)


def stories_problem(rng: random.Random, heldout: bool) -> Problem:
    return tell_story(rng, *draw_numbers(rng, heldout))


def tell_story(rng: random.Random, a: int, k: int, m: int, g: int) -> Problem:
    """One `stories` problem about these numbers, its prompt and answer worded at random."""
    n, item = rng.choice(NAMES), rng.choice(ITEMS)
    one, many = rng.choice(CONTAINERS)
    km, r = k * m, a + k * m - g
    prompt = rng.choice([
        f"{n} has {a} {item} . {n} buys {k} {many} with {m} {item} in each {one} and then gives away {g} {item} . "
        f"How many {item} does {n} have now ?",
        f"{n} owns {a} {item} and gives away {g} of them . Then {n} gets {k} {many} of {m} {item} each . "
        f"How many {item} does {n} have now ?",
        f"After giving away {g} {item} , {n} buys {k} {many} with {m} {item} in each {one} . {n} had {a} {item} "
        f"at first . How many {item} does {n} have now ?",
    ])

    def start() -> str:
        return f"{n} {_pick(rng, 'starts', 'begins')} with {a} {item} ."

    def multiply() -> str:
        x, y = (k, m) if rng.random() < 0.5 else (m, k)
        return (f"{_pick(rng, 'Each', 'Every')} {one} {_pick(rng, 'has', 'holds')} {m} {item} , {_pick(rng, 'so', 'thus')} "
                f"{k} {many} {_pick(rng, 'have', 'hold')} {x} * {y} = {km} {item} .")

    def add(x: int, y: int) -> str:
        x, y = (x, y) if rng.random() < 0.5 else (y, x)
        return (f"{_pick(rng, 'Add', 'Join')} : {x} + {y} : {_story_add(rng, x, y)} "
                f"{_pick(rng, 'So', 'Now')} {n} has {x + y} {item} .")

    def subtract(x: int) -> str:
        return (f"{_pick(rng, 'Take', 'Give')} away {g} : {_story_subtract(rng, x, g)} "
                f"{_pick(rng, 'So', 'Now')} {n} has {x - g} {item} .")

    order = rng.randrange(3)
    if order == 0:  # multiply, add, subtract
        steps = [start(), multiply(), add(a, km), subtract(a + km)]
    elif order == 1:  # multiply, subtract, add
        steps = [start(), multiply(), subtract(a), add(a - g, km)]
    else:  # subtract, multiply, add
        steps = [start(), subtract(a), multiply(), add(a - g, km)]
    return Problem(prompt, " ".join(steps + [f"The answer is {r} ."]), r)


TASKS = {"arithmetic": arithmetic_problem, "stories": stories_problem}
TASK_WORDS = {"arithmetic": [], "stories": STORY_WORDS}


def make_problems(task: str, n: int, seed: int, heldout: bool) -> list[Problem]:
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; known: {sorted(TASKS)}.")
    rng = random.Random(seed)
    return [TASKS[task](rng, heldout) for _ in range(n)]


def final_answer(text: str) -> int | None:
    """The number after the last "The answer is" in decoded text (digits may be space-separated)."""
    found = re.findall(r"The answer is ((?:\d\s*)+)", text)
    return int(found[-1].replace(" ", "")) if found else None


def build_tokenizer(task: str = "arithmetic"):
    """A word-level tokenizer over a task's words, single digits and the specials ([MASK] = 1).

    Every task's vocabulary extends the arithmetic one (same ids first, its own words after), so a model
    trained on arithmetic can be continued on another task with its embeddings kept.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; known: {sorted(TASKS)}.")
    base = SPECIALS + [str(d) for d in range(10)] + sorted(set(WORDS + NAMES + ITEMS))
    vocab = {t: i for i, t in enumerate(base + sorted(set(TASK_WORDS[task]) - set(base)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", mask_token="[MASK]",
                                   eos_token="[EOS]", bos_token="[BOS]")
