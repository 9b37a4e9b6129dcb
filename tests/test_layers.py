"""Which layer may import which (docs/design.md), checked on the source.

- Each unit of ``kverr`` (a module or subpackage) imports only from its own layer or those below
  it, in :data:`LAYERS` order; a new unit must be placed in the table.
- ``kverr_kernels`` holds only ``@triton.jit`` code: it imports triton and its own modules.
- The kernel launchers (``kverr.gpu``) know nothing of calibration, evaluation or the CLI.
- Calibration knows nothing of the kernels (``kverr.gpu``, ``kverr_kernels``).
- Validation (kernels against the oracle) needs no transformers: RoPE is ``kverr.rope``'s.
- No library module imports the CLI (``kverr.cli``, ``kverr.commands``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, at any depth (function-local imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _modules(where: str) -> list[Path]:
    path = REPO / where
    assert path.exists(), f"{where} is not in the repository"
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


#: The library's layers, lowest first (units named as ``kverr.<unit>``; ``kverr`` itself is the
#: package's ``__init__``, whose public names are imported lazily by string).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"kverr", "exceptions", "dims", "progress", "rope"}),         # foundations
    frozenset({"quant", "config", "catalog", "memory", "cost", "io", "accessor", "engines", "peers"}),  # oracle, configs, bytes, cost, files, engines, peers
    frozenset({"error", "capturing", "gpu", "kernels", "hf"}),              # decomposition, models, kernels
    frozenset({"calibration", "evaluation", "retrieval", "validation"}),    # the stages
    frozenset({"pipeline"}),                                                # the stages in order
    frozenset({"cli", "commands"}),                                         # the command line
)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "kverr_kernels":
        return "kernels"
    if parts[0] != "kverr":
        return None
    return parts[1] if len(parts) > 1 else "kverr"


def _rank(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"kverr.{unit} is in no layer of LAYERS: place it there")


def test_each_unit_imports_only_its_layer_or_below():
    bad = []
    for path in _modules("kverr") + _modules("kverr_kernels"):
        rel = path.relative_to(REPO).with_suffix("").parts
        me = "kernels" if rel[0] == "kverr_kernels" else (rel[1] if len(rel) > 1 and rel[1] != "__init__" else "kverr")
        for module in _imports(path):
            other = _unit(module)
            if other is not None and _rank(other) > _rank(me):
                bad.append(f"{path.relative_to(REPO)} imports {module}")
    assert bad == []


def _offending(paths, forbidden):
    return {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.split(".")[0] in forbidden
                                              or any(m == f or m.startswith(f + ".") for f in forbidden))
            for p in paths if any(m == f or m.startswith(f + ".") for m in _imports(p) for f in forbidden)}


def test_kernels_import_only_triton_and_each_other():
    allowed = {"triton", "kverr_kernels", "__future__"}
    bad = {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.split(".")[0] not in allowed)
           for p in _modules("kverr_kernels")}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("folder, forbidden", [
    ("kverr/gpu", ("kverr.calibration", "kverr.evaluation", "kverr.cli", "kverr.commands", "kverr.capturing")),
    ("kverr/calibration", ("kverr.gpu", "kverr_kernels")),
    # validation needs the kernels and the oracle, not transformers (RoPE comes from kverr.rope)
    ("kverr/validation.py", ("kverr.hf", "transformers")),
])
def test_a_layer_does_not_reach_into_another(folder, forbidden):
    assert _modules(folder) and _offending(_modules(folder), forbidden) == {}


def test_no_library_module_imports_the_cli():
    library = [p for p in _modules("kverr") if "commands" not in p.parts and p.name != "cli.py"]
    assert library and _offending(library, ("kverr.cli", "kverr.commands")) == {}


def test_no_package_in_the_repository_shadows_an_installed_one():
    """Tests, notebooks and ``python -m`` run with the repository root first on ``sys.path``, so a
    top-level folder named like another distribution's package is imported in its place (a folder
    ``kernels/`` hid Hugging Face's ``kernels``, which transformers imports when it is installed)."""
    import importlib.metadata

    ours = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert "kverr" in ours
    theirs = {name: sorted(set(d) - {"kverr"})
              for name, d in importlib.metadata.packages_distributions().items()}
    assert {name: theirs[name] for name in ours if theirs.get(name)} == {}
