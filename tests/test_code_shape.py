"""Every function in src/ and bench/ is at most 80 lines (docs/design/modules.md): a function longer
than a screen holds more than one concept; split it by concept, not by line count."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# Declarative tables (a long literal, no logic) may be longer; none needs to be today. Each
# entry: "path::function" with a comment saying which table it is.
ALLOWED: set[str] = set()


def long_functions(roots=("src", "bench")) -> list[str]:
    out = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    name = f"{path.relative_to(ROOT)}::{node.name}"
                    if lines > MAX_LINES and name not in ALLOWED:
                        out.append(f"{name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_80_lines():
    assert long_functions() == []


def test_the_check_sees_a_long_function(tmp_path, monkeypatch):
    """The check cannot pass vacuously: a 90-line function in a scanned tree is reported."""
    body = "".join(f"    x{i} = {i}\n" for i in range(89))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(f"def too_long():\n{body}")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions(("src",)) == ["src/m.py::too_long (90 lines)"]
