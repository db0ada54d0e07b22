"""Issue 28's house rule, held by a test rather than by a note: no function over 80 lines and no
module over 700 in supervisor/ (the generated LLaMA-Factory key list aside). A person adding a
diagnosis family or a policy rung should find one small module to change, not a crowded room."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "supervisor"
MAX_FUNCTION, MAX_MODULE = 80, 700
GENERATED = {"lf_keys.py"}


def _sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in GENERATED]


def test_no_module_is_over_700_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_MODULE}
    assert not long, long


def test_no_function_is_over_80_lines():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    long[f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, long
