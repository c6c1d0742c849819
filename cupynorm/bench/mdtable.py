"""Cells and tables of the results page (:mod:`.markdown`), shared by its sections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .report import format_ms


def fmt_ms(value: Any) -> str:
    return format_ms(value) if isinstance(value, (int, float)) else "-"


def fmt_ratio(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "-"


def fmt_number(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Markdown lines: `left` columns left-aligned, the rest right-aligned."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return lines


class Footnotes:
    """Numbered notes under a table: `ref(text)` gives the marker to put in a cell."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        if not self.texts:
            return []
        return [""] + [f"[{i}] {md_cell(t)}  " for i, t in enumerate(self.texts, 1)]


def impl_of(row: dict[str, Any], name: str) -> dict[str, Any]:
    """One implementation's entry of a kernel row (empty when it did not run)."""
    return next((i for i in row.get("impls") or [] if i.get("impl") == name), {})
