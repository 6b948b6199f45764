"""Write docs/api.md: every public name of the packages, with its signature and docstring.

    python3 docs/gen_api.py          # rewrite docs/api.md
    python3 docs/gen_api.py --check  # exit 1 if docs/api.md is out of date or a public name has no docstring

Public names are the `__all__` of each module in `MODULES`. tests/test_docs.py runs the check, so a public
name without a docstring, or an api.md that does not match the code, fails the test suite.
"""
from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import List, Tuple

MODULES = [
    "fp8_parallel",
    "fp8_parallel.recipe",
    "fp8_parallel.megatron",
    "fp8_parallel.megatron_lm",
    "fp8_parallel.graphs",
    "fp8_parallel.pipeline",
    "fp8_parallel.native",
    "parallel_state",
]
OUT = Path(__file__).resolve().parent / "api.md"
HEADER = """# API reference

Generated from the docstrings by `python3 docs/gen_api.py`; `tests/test_docs.py` fails when this page is out
of date or a public name has no docstring. Guides: [guide](guide.md), [migrating from TransformerEngine](migrating-from-te.md).
"""


def _signature(obj) -> str:
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return ""  # an enum's call signature is the Enum machinery's, and it differs between Python versions
    target = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
    try:
        sig = str(inspect.signature(target))
    except (TypeError, ValueError):
        return ""
    if inspect.isclass(obj):
        sig = sig.replace("(self, ", "(").replace("(self)", "()")
    return re.sub(r" at 0x[0-9a-f]+", "", sig)  # default values' reprs carry addresses


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return "constant"


def _constant(name: str, obj) -> str:
    """A short, run-independent description of a module-level value."""
    text = repr(obj)
    if len(text) <= 80 and " at 0x" not in text:
        return f"constant `{name} = {text}`"
    return f"constant `{name}` (a `{type(obj).__name__}`)"


def _doc(obj, owner_doc: str) -> str:
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
        return inspect.getdoc(obj) or ""
    return owner_doc  # constants are documented by the module that defines them


def collect() -> Tuple[str, List[str]]:
    """The page text, and the public names that have no docstring."""
    parts, missing = [HEADER], []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        names = list(getattr(mod, "__all__", []))
        parts.append(f"\n## `{mod_name}`\n\n{(inspect.getdoc(mod) or '').strip()}\n")
        for name in names:
            obj = getattr(mod, name)
            doc = _doc(obj, "")
            if not doc.strip() and _kind(obj) != "constant":
                missing.append(f"{mod_name}.{name}")
            sig = _signature(obj) if _kind(obj) in ("class", "function") else ""
            title = f"### `{mod_name}.{name}`"
            body = f"{_kind(obj)} `{name}{sig}`" if sig or _kind(obj) != "constant" else _constant(name, obj)
            parts.append(f"{title}\n\n{body}\n\n{doc.strip()}\n")
    return "\n".join(parts).rstrip() + "\n", missing


def main(argv: List[str]) -> int:
    text, missing = collect()
    if missing:
        print("public names without a docstring: " + ", ".join(missing), file=sys.stderr)
    if "--check" in argv:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            import difflib

            diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), OUT.name, "generated now",
                                             lineterm="", n=1))
            print(f"{OUT.name} is out of date: run python3 docs/gen_api.py\n" + "\n".join(diff[:60]), file=sys.stderr)
            return 1
        return 1 if missing else 0
    OUT.write_text(text)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
