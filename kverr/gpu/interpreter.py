"""Triton's interpreter (``TRITON_INTERPRET=1``), without its redundant work.

The interpreter runs a kernel by patching ``triton.language`` (every builtin of ``tl``,
``tl.tensor``, ``tl.math`` and ``tl.core``) to interpreted versions for the launch, and restores
the module after it. Triton 3.9 patches it again at *every* call of a ``@triton.jit`` helper
inside the kernel -- an ``inspect.getmembers`` walk over the whole language each time,
whose changes are the ones already in place. kverr's kernels call small helpers inside their
loops (the compensated store rounds a key channel by channel), where that walk is a large share
of their time on the CPU (``docs/kernels.md`` has the figures).

:func:`install` wraps the interpreter's patch step so that, during a launch, a helper whose
language modules are already patched skips it; one that reads a module not yet patched (the
standard library's helpers read ``tl.core``) is patched as before, once per launch. What the
kernels compute is unchanged: the same interpreted builtins are in place at every call.
"""

from __future__ import annotations

import inspect
import os

_STATE = {"installed": False, "depth": 0, "patched": set()}


def interpreting() -> bool:
    """Whether triton runs its kernels in the interpreter (``TRITON_INTERPRET`` set, not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _languages(fn, tl) -> frozenset[int]:
    """The language modules the interpreter patches for ``fn``: those of ``tl``, ``tl.core`` its
    globals hold (as :func:`triton.runtime.interpreter._patch_lang` picks them)."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Wrap the interpreter's patch step (once per process); False where this triton has no such
    step to wrap (then it runs as shipped)."""
    if _STATE["installed"]:
        return True
    try:
        import triton.language as tl
        import triton.runtime.interpreter as ti
    except ImportError:
        return False
    original = getattr(ti, "_patch_lang", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type, "restore"):
        return False

    def patch_lang(fn):
        langs = _languages(fn, tl)
        if _STATE["depth"] and langs <= _STATE["patched"]:
            return scope_type()  # already in place for this launch: nothing to patch, nothing to restore
        scope = original(fn)
        if not hasattr(scope, "restore"):
            return scope  # not the patch step this wraps: run as shipped
        _STATE["patched"] |= langs
        if _STATE["depth"]:
            return scope  # a helper's patch: the interpreter drops its scope, as it does unwrapped
        _STATE["depth"] = 1  # the launch's own patch: it restores the module when the launch ends
        restore = scope.restore

        def leave():
            try:
                restore()
            finally:
                _STATE["depth"], _STATE["patched"] = 0, set()

        scope.restore = leave
        return scope

    ti._patch_lang = patch_lang
    _STATE["installed"] = True
    return True
