"""The code's shape: every function in src/ and bench/ is at most 80 lines (docs/design/modules.md:
a function longer than a screen holds more than one concept; split it by concept, not by line
count), and every run-config parameter in src/ is typed with its section."""

import ast
import re
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


# A run-config parameter is named `cfg` (the whole Config) or `<section>_cfg` (one section); a
# model's config (HF, DFlashConfig) is named `*config`. Each run-config parameter carries its
# section's type (or a protocol of what it reads), so mypy (check_untyped_defs, pyproject.toml)
# checks every config access.
CONFIG_PARAM = re.compile(r"^(cfg|[a-z_]+_cfg)$")
CONFIG_TYPE = re.compile(r"^(?!Any\b)[A-Z][A-Za-z]*( \| None)?$")  # a named type, not Any


def untyped_config_params(roots=("src",)) -> list[str]:
    out = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = node.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs:
                    ann = ast.unparse(arg.annotation) if arg.annotation else ""
                    if CONFIG_PARAM.match(arg.arg) and not CONFIG_TYPE.match(ann):
                        where = f"{path.relative_to(ROOT)}::{node.name}"
                        out.append(f"{where}({arg.arg}: {ann or 'untyped'})")
    return out


def test_every_config_parameter_is_typed_with_its_section():
    assert untyped_config_params() == []


def test_the_check_sees_an_untyped_config_parameter(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(
        "def a(cfg): pass\ndef b(data_cfg: Any): pass\ndef c(cfg: Config, eval_cfg: EvalConfig):"
        " pass\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert untyped_config_params() == ["src/m.py::a(cfg: untyped)", "src/m.py::b(data_cfg: Any)"]
