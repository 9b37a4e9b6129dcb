"""Which layer may import which (the README's design section), checked on the source.

- ``kernels/`` holds only ``@triton.jit`` code: it imports triton and its own modules.
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
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def _offending(paths, forbidden):
    return {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.split(".")[0] in forbidden
                                              or any(m == f or m.startswith(f + ".") for f in forbidden))
            for p in paths if any(m == f or m.startswith(f + ".") for m in _imports(p) for f in forbidden)}


def test_kernels_import_only_triton_and_each_other():
    allowed = {"triton", "kverr_kernels", "__future__"}
    bad = {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.split(".")[0] not in allowed)
           for p in _modules("kernels")}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("folder, forbidden", [
    ("kverr/gpu", ("kverr.calibration", "kverr.evaluation", "kverr.cli", "kverr.commands", "kverr.capturing")),
    ("kverr/calibration", ("kverr.gpu", "kverr_kernels")),
    # validation needs the kernels and the oracle, not transformers (RoPE comes from kverr.rope)
    ("kverr/validation.py", ("kverr.cache", "transformers")),
])
def test_a_layer_does_not_reach_into_another(folder, forbidden):
    assert _modules(folder) and _offending(_modules(folder), forbidden) == {}


def test_no_library_module_imports_the_cli():
    library = [p for p in _modules("kverr") if "commands" not in p.parts and p.name != "cli.py"]
    assert library and _offending(library, ("kverr.cli", "kverr.commands")) == {}
