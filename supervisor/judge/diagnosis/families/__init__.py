"""One module per failure family: its patterns and its `find(seg, t, exc, exc_form, hits)`.

`rules.FAMILIES` is the order they are asked in (the precedence table); a new family is a new
module here, a row there, its trigger words in `TRIGGERS` and its tests in tests/diagnosis.
"""
