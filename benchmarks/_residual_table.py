"""The generated residual tables that planner/uncertainty.py and planner/serving_uncertainty.py read: one module with a
docstring and one dict of name -> residuals, written by the validations' --write-intervals."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_residual_table(path: Path, docstring: str, name: str, table: dict[str, list[float]]) -> None:
    """`path`: `docstring` (its text, without quotes) and `name: dict[str, tuple[float, ...]]` holding `table`,
    four decimals a residual, wrapped at 120 columns."""
    lines = [f'    "{key}": ({", ".join(f"{value:.4f}" for value in values)},),' for key, values in table.items()]
    wrapped = "\n".join(textwrap.fill(line, 120, subsequent_indent=" " * 8, break_long_words=False) for line in lines)
    path.write_text(f'"""{docstring}"""\n\n{name}: dict[str, tuple[float, ...]] = {{\n{wrapped}\n}}\n')
