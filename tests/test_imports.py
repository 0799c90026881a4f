"""The package's imports run one way. Every `import` of the package, at the top of a module or inside a function,
is read from the source (nothing is imported to find them) and checked against the layers:

* `hf_dscale/cache.py`, `hf_dscale/timing.py` and `kernels/` at the bottom: they import nothing of the package
  above them;
* the drafter's remote code (`models/dscale/`) and the diffusion LM (`models/dllm/`) each self-contained, as they
  ship in a model folder;
* the engine below the transformers-facing entry layer (`generation/`), which it never imports, and the
  diffusion-LM decoders (`dllm/`) apart from the drafter's remote code;
* nothing below the entry points imports them: the CLI, the benches (`evaluation.py`), the sweep, training and the
  Hub tools are imported by nothing but themselves and each other;
* no cycle between those parts.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hf_dscale"
TOP = ("hf_dscale.cli", "hf_dscale.evaluation", "hf_dscale.sweep", "hf_dscale.training", "hf_dscale.hub")


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The package's modules `path` imports (relative imports resolved), wherever in the file."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            if name.startswith("hf_dscale"):
                found |= {f"{name}.{alias.name}" for alias in node.names} if not node.module else {name}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hf_dscale")}
    return found


MODULES = {_module(path): _imports(path) for path in sorted(ROOT.rglob("*.py"))}


def _inside(name: str, *areas: str) -> bool:
    return any(name == area or name.startswith(area + ".") for area in areas)


def test_the_walk_finds_the_package():
    assert len(MODULES) > 40 and "hf_dscale.engine.loop" in MODULES
    assert "hf_dscale.kernels.tree_attention" in MODULES["hf_dscale.engine.attention"]


@pytest.mark.parametrize("layer, allowed", [
    ("hf_dscale.cache", ()),
    ("hf_dscale.timing", ()),
    ("hf_dscale.kernels", ("hf_dscale.kernels", "hf_dscale.cache")),
    ("hf_dscale.engine", ("hf_dscale.engine", "hf_dscale.kernels", "hf_dscale.models", "hf_dscale.cache",
                          "hf_dscale.timing")),
    ("hf_dscale.models.dscale", ("hf_dscale.models.dscale",)),
    ("hf_dscale.models.dllm", ("hf_dscale.models.dllm",)),
])
def test_the_bottom_and_the_remote_code_import_nothing_above_them(layer, allowed):
    upward = {module: sorted(n for n in names if not _inside(n, *allowed))
              for module, names in MODULES.items() if _inside(module, layer)}
    assert not {m: n for m, n in upward.items() if n}


def test_nothing_below_the_entry_points_imports_them():
    upward = {module: sorted(n for n in names if _inside(n, *TOP))
              for module, names in MODULES.items() if not _inside(module, *TOP) and module != "hf_dscale"}
    assert not {m: n for m, n in upward.items() if n}


def test_the_diffusion_lm_decoders_share_nothing_with_the_drafters_remote_code():
    dllm = [m for m in MODULES if _inside(m, "hf_dscale.dllm")]
    assert dllm and not {m: sorted(n for n in MODULES[m] if _inside(n, "hf_dscale.models.dscale")) for m in dllm
                         if any(_inside(n, "hf_dscale.models.dscale") for n in MODULES[m])}


PARTS = ("hf_dscale.cache", "hf_dscale.timing", "hf_dscale.kernels", "hf_dscale.models.dscale", "hf_dscale.models.dllm",
         "hf_dscale.models", "hf_dscale.engine", "hf_dscale.dllm", "hf_dscale.generation", *TOP)


def _part(name: str) -> str | None:
    return next((part for part in PARTS if _inside(name, part)), None)


def test_no_cycle_between_the_parts():
    graph: dict[str, set[str]] = {}
    for module, names in MODULES.items():
        here = _part(module)
        for name in names:
            there = _part(name)
            if here and there and here != there:
                graph.setdefault(here, set()).add(there)
    seen, path = set(), []

    def visit(part):
        if part in path:
            raise AssertionError(" -> ".join(path[path.index(part):] + [part]))
        if part in seen:
            return
        path.append(part)
        for nxt in sorted(graph.get(part, ())):
            visit(nxt)
        path.pop()
        seen.add(part)

    for part in PARTS:
        visit(part)
