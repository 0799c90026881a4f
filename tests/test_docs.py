"""The README's, model cards' and examples' code stays in step with the package: names, fields, flags."""

import ast
import importlib
import inspect
import pathlib
import re
import shlex

import pytest

from hf_dscale.cli import build_parser
from hf_dscale.generation import DecodeStats

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


PYTHON = {f"README block {i}": code for i, code in enumerate(_blocks("python"))}
for card in sorted((ROOT / "model_cards").glob("*/README.md")):
    PYTHON |= {f"{card.parent.name} block {i}": code for i, code in enumerate(_blocks("python", card.read_text()))}
PYTHON |= {path.name: path.read_text() for path in sorted((ROOT / "examples").glob("*.py"))}
SHELL = "\n".join(_blocks("bash") + [path.read_text() for path in sorted((ROOT / "examples").glob("*.sh"))])


def _commands(text: str) -> list[list[str]]:
    """Every `hf-dscale ...` invocation in shell text, continuation lines joined, split into argv.

    A script's `NAME=${NAME:-default}` settings are filled in; other variables stand for themselves.
    """
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, flags=re.M))
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(1)), text)
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line)  # comments, whole-line or trailing
        for part in re.split(r"&&|\|\||;", line):
            words = shlex.split(part)
            if words[:1] == ["hf-dscale"]:
                commands.append(words[1:])
    return commands


def test_the_docs_hold_code_to_check():
    assert len(PYTHON) >= 10 and len(_commands(SHELL)) >= 5


def _imported(name: str, tree: ast.AST) -> dict:
    """The `from hf_dscale... import x` names of a snippet and what they are; each must exist."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_dscale"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{name}: {node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


@pytest.mark.parametrize("name", sorted(PYTHON))
def test_python_imports_and_stats_fields_exist(name):
    tree = ast.parse(PYTHON[name])
    _imported(name, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "stats":
            assert hasattr(DecodeStats(), node.attr), f"{name}: DecodeStats has no field {node.attr}"


@pytest.mark.parametrize("name", sorted(PYTHON))
def test_custom_generate_keywords_exist(name):
    from transformers import GenerationConfig

    tree = ast.parse(PYTHON[name])
    imported = _imported(name, tree)
    for node in ast.walk(tree):
        decoder = next((k.value for k in node.keywords if k.arg == "custom_generate"), None) \
            if isinstance(node, ast.Call) else None
        if not isinstance(decoder, ast.Name) or decoder.id not in imported:
            continue
        accepted = set(inspect.signature(imported[decoder.id]).parameters) | set(vars(GenerationConfig()))
        accepted |= {"input_ids", "attention_mask", "custom_generate", "trust_remote_code"}
        unknown = {k.arg for k in node.keywords if k.arg is not None} - accepted
        assert not unknown, f"{name}: generate(custom_generate={decoder.id}) does not take {sorted(unknown)}"


@pytest.mark.parametrize("argv", _commands(SHELL), ids=lambda argv: " ".join(argv[:3]))
def test_documented_commands_parse(argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"`hf-dscale {' '.join(argv)}` does not parse (exit {exit_.code})")
