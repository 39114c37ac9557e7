"""The package's shape: the folders show the architecture (docs/layout.md), imports go one way, and the public
names keep working.

The import graph counts every `import` statement of src/imagerl, function-level ones included (a lazy import is
still a dependency). The only strongly connected groups allowed are the registries, whose `_import_builtin` imports
the modules that register themselves into them (families, rewards, algorithms)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "imagerl"
REGISTRIES = {"imagerl.families.registry", "imagerl.rewards.registry", "imagerl.algorithms.registry"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    edges = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("imagerl") else None
                if found and found != m:
                    edges[m].add(found)
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative; groups of more than one module."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = set()
                    while True:
                        w = stack.pop(); on_stack.discard(w); group.add(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return groups


def test_the_only_import_circles_are_the_registries():
    bad = [sorted(g) for g in strongly_connected(import_graph()) if not g & REGISTRIES]
    assert not bad, f"import circles outside the registries: {bad}"


def test_the_cycle_finder_finds_a_circle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_validation_is_imported_only_from_the_top():
    """validation composes every subsystem's settings checks; nothing it checks imports it back."""
    users = sorted(m for m, e in import_graph().items() if "imagerl.validation" in e)
    assert set(users) <= {"imagerl.train", "imagerl.cli", "imagerl.perf.bench", "imagerl.sample"}, users


def test_the_package_top_holds_at_most_ten_modules_besides_cli_and_config():
    top = sorted(p.name for p in SRC.glob("*.py") if p.name not in ("cli.py", "config.py"))
    assert len(top) <= 10, top


def test_public_names_import():
    import imagerl
    from imagerl import (__version__, flow_sde_step, flow_sigmas, group_advantages, ocr_reward,  # noqa: F401
                         register_reward, resolve_family)
    from imagerl.algorithms import register_algorithm  # noqa: F401
    from imagerl.cli import main  # noqa: F401
    from imagerl.config import RewardConfig  # noqa: F401
    from imagerl.rewards import ocr_reward as ocr, register_reward as register  # noqa: F401
    from imagerl.sft import SFTConfig, export_model, sft  # noqa: F401

    assert register is imagerl.register_reward


def test_the_command_line_help_and_every_recipe_load():
    from imagerl.config import load_config

    out = subprocess.run([sys.executable, "-m", "imagerl", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout
    recipes = sorted((SRC / "recipes").glob("*.yaml"))
    assert len(recipes) >= 11
    for recipe in recipes:
        assert load_config(recipe.stem).recipe == recipe.stem


@pytest.mark.parametrize("package", ["run", "data", "evaluation", "sft", "algorithms", "families", "rewards",
                                     "sampling", "distributed", "perf"])
def test_each_subpackage_says_what_it_holds(package):
    import importlib

    doc = importlib.import_module(f"imagerl.{package}").__doc__
    assert doc and len(doc.split()) >= 8, package
