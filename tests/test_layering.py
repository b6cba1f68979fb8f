"""The package's layers, read from its import statements: the core never imports a scheme folder, schemes depend on the
core and never on models or integrations, no module-level import circle, no import hidden in a function.

Layers, lowest first:

- core: ``checks``, ``grid``, ``tokens``, ``base``, ``registry``, ``contract``, ``attention`` and ``interfaces/``
  (the typed states attention talks to schemes through), and ``parallel/`` (sequence-parallel sharding and
  attention, on torch.distributed);
- schemes: ``absolute/``, ``rotary/``, ``bias/``, ``camera/``, ``multimodal/``, each importing the core and itself;
- ``models/``: the ViTs, on the core and the schemes;
- ``integrations/``: timm, Hugging Face, open_clip, on everything below;
- ``training/``: imports the library as a user would (anything but its own callers).

``visionpe/__init__.py`` imports every layer to register the schemes and models; it is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "visionpe"
CORE = {"checks", "grid", "tokens", "base", "registry", "contract", "attention", "interfaces", "parallel"}
SCHEMES = {"absolute", "rotary", "bias", "camera", "multimodal"}
# what each layer may import besides itself
ALLOWED = {
    "core": {"core"},
    **{folder: {"core"} for folder in SCHEMES},
    "models": {"core", *SCHEMES},
    "integrations": {"core", *SCHEMES, "models"},
    "training": {"core", *SCHEMES, "models", "integrations"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str | None:
    """The layer of ``visionpe.<first>...``; None for the package itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return "core" if parts[1] in CORE else parts[1]


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported visionpe module, line, at module level) of every import statement in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    top |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif (node.module or "").startswith("visionpe"):
                names = [node.module]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("visionpe")]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


FILES = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


def _known(module: str, modules: set[str]) -> str:
    """``module``, or the package it names an attribute of (``from . import x`` of a non-module name)."""
    while module not in modules and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def test_every_module_has_a_layer():
    assert {_layer(_module_name(p)) for p in FILES} <= set(ALLOWED), "a new top-level folder needs a layer here"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    module = _module_name(path)
    layer = _layer(module)
    wrong = [
        f"line {line}: {target}"
        for target, line, _ in _imports(path)
        if (other := _layer(target)) is not None and other != layer and other not in ALLOWED[layer]
    ]
    assert not wrong, f"{module} ({layer}) imports a layer it may not: {wrong}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_visionpe_import_inside_a_function(path):
    """An import inside a function is how a module-level circle gets hidden: every visionpe import is at the top."""
    hidden = [f"line {line}: {target}" for target, line, top in _imports(path) if not top]
    assert not hidden, f"{_module_name(path)} imports visionpe modules inside functions: {hidden}"


def test_no_module_level_import_circle():
    modules = {_module_name(p) for p in FILES} | {"visionpe"}
    graph = {
        _module_name(p): {_known(t, modules) for t, _, top in _imports(p) if top} - {_module_name(p)} for p in FILES
    }
    # a package's __init__ importing its submodules is the package being built, not a circle through it
    graph = {m: {t for t in targets if not m.startswith(f"{t}.")} for m, targets in graph.items()}
    state, stack = {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError(f"module-level import circle: {' -> '.join(circle)}")
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
