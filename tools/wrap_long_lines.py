"""Re-wrap the lines of Python files that are wider than a limit: comments, docstrings and string literals.

Usage::

    python tools/wrap_long_lines.py [--width 109] [--check | --diff] [--format] PATH...

A PATH is a Python file, or a directory whose ``*.py`` files are taken (recursively). Only what holds a line
wider than ``--width`` columns (default 109) is touched, so a second run changes nothing:

- a trailing comment that makes a code line too wide moves onto its own line above it; a pragma (``# type:``,
  ``# noqa``, ``# fmt:``, ``# pragma:`` ...) stays where it is;
- a block of ``#`` comments (consecutive lines of one indentation) is rewrapped paragraph by paragraph, from
  the paragraph's first line that is too wide on, keeping the ``# `` prefix. A bare ``#`` line, a list item,
  a line indented deeper than its paragraph or one that reads as code starts a new paragraph; the last two
  are kept as they are. A comment with a rule in it (``# --- Part -----``) is not wrapped: its longest rule
  is shortened;
- a docstring's prose paragraphs are rewrapped the same way. A list item, or an item of an ``Args:``,
  ``Raises:``, ``Attributes:`` (and the like) section, keeps its hanging indent: a continuation line gets the
  indent its item's continuation lines already have, else the one the file's other items use (4 where none
  does). Doctests (``>>>``, ``...`` and their output), literal blocks after ``::``, fenced code, tables,
  directives, section headers and a ``{placeholder}`` alone on its line are kept as they are, and so is the
  summary line of a module, class or function docstring, which pydocstyle wants on one line (it is reported
  instead);
- a string literal in code is cut at spaces into implicitly concatenated parts with the same text, one a line
  (the space starts the next part; an f-string part without a replacement field loses its ``f``, and its
  ``{{``/``}}`` become ``{``/``}``); one outside brackets is put in parentheses. In a concatenation laid out
  one part a line, what a cut leaves over is carried into the next part, not left as a short piece.

Statements under ``# fmt: skip`` and regions between ``# fmt: off`` and ``# fmt: on`` are left as they are.

Code itself is ruff's: ``--format`` runs ``ruff format --line-length WIDTH`` on the files after the rewrap,
then rewraps again (a string literal is cut once ruff has laid its line out), until nothing changes. Before a
file is written its syntax tree is compared with the original's: only the whitespace inside docstrings may
differ, or the file is left as it was and the error reported.

What is still too wide is listed on stdout as ``path:line: width N: why``. Exit status: 0; with ``--check``
(which writes nothing) 1 when a line is still too wide; 2 when a file cannot be read, parsed or safely
rewritten.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import re
import shutil
import subprocess
import sys
import tokenize
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WIDTH = 109

PRAGMA = re.compile(
    r"#\s*(type:|noqa\b|fmt:|pragma:|pyright:|pylint:|mypy:|ruff:|isort:|flake8:|nosec\b)", re.IGNORECASE
)
"""A comment that tools read: it stays on its line, never wrapped or moved."""
LIST_ITEM = re.compile(r"([-*+\u2022]|\d{1,3}[.)]|#\.|\([0-9A-Za-z]{1,3}\))\s+")
"""The marker that starts a list item, with the space after it."""
FIELD_ITEM = re.compile(r":[^:\s`][^:`]*:(\s+|$)")
"""An RST field (``:param x: ...``): an item with a hanging indent."""
SECTION = re.compile(
    r"(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Raises|Exceptions"
    r"|Except|Attributes|Warns|Methods|Returns|Return|Yields|Yield|Example|Examples|Note|Notes|Warning"
    r"|Warnings|See Also|Todo|References)\s*:\s*"
)
"""A Google-style section header, alone on its line."""
ITEM_SECTIONS = frozenset(
    (
        "Args",
        "Arguments",
        "Parameters",
        "Params",
        "Keyword Args",
        "Keyword Arguments",
        "Other Parameters",
        "Raises",
        "Exceptions",
        "Except",
        "Attributes",
        "Warns",
        "Methods",
    )
)
"""The sections whose lines at their first indentation each start an item (``name: what``)."""
TABLE_LINE = re.compile(r"(\||\+[-=]|=+(\s+=+)*\s*$|-+(\s+-+)+\s*$)")
"""A line of a Markdown or RST table."""
UNDERLINE = re.compile(r"([-=~^\"'`#*+:.])\1{2,}\s*$")
"""An RST title's underline, or a rule."""
RULE = re.compile(r"([-=~#*_+])\1{3,}")
"""A rule in a comment (``# --- Part ------``): the comment is never wrapped, its longest rule shortened."""
PLACEHOLDER = re.compile(r"\{[A-Za-z_][\w.]*\}$")
"""A ``str.format`` field alone on its line: what replaces it may be a block."""
CODE_LIKE = re.compile(
    r"(>>>|\$ |[{}\[\]()]+$|(def|class|if|elif|else|for|while|with|try|except|finally|async def)\b.*:$"
    r"|[A-Za-z_][\w.]*(\[[^\]]*\])?\s*(=|\+=|-=|:=)\s*\S|[A-Za-z_][\w.]*\(.*\)$)"
)
"""A comment line that reads as code: kept as it is, never joined."""
WORD = re.compile(r"(?:``.+?``|`[^`\s][^`]*`|[^\s`]+|`+)+")
"""A word to wrap: an inline literal in backticks stays whole where it fits on a line."""
DOC_STARTERS = re.compile(r"([-*+\u2022|]|\d{1,3}[.)]|#\.|>>>|\.\.\.?|=+|-+|\+[-=]+.*|:[^:\s`][^:`]*:)$")
"""What must not start a wrapped docstring line (a list item, doctest, table or directive would)."""
COMMENT_STARTERS = re.compile(
    r"([-*+\u2022]|\d{1,3}[.)]|type:|noqa:?|fmt:|pragma:|pyright:|pylint:|mypy:|ruff:|isort:|flake8:"
    r"|nosec)$",
    re.IGNORECASE,
)
"""What must not start a wrapped comment line (it would read as a list item or a pragma)."""
_NOT_SIGNIFICANT = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
# Python 3.12 tokenizes an f-string (3.14 a t-string too) as a start, its pieces and an end.
_FSTRING_STARTS = tuple(getattr(tokenize, name, -1) for name in ("FSTRING_START", "TSTRING_START"))
_FSTRING_ENDS = tuple(getattr(tokenize, name, -1) for name in ("FSTRING_END", "TSTRING_END"))
_PROSE = "prose: this tool rewraps it (a line is left too wide only where one word is)"
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
"""What pydocstyle checks the docstring of."""
_DOCSTRING_SUMMARY = (
    "docstring summary line: pydocstyle wants it on one line; shorten it, or end it sooner and move the rest"
    " into the description"
)


def text_width(text: str) -> int:
    """The columns ``text`` takes as ruff counts them: East Asian wide and full-width characters take two."""
    if text.isascii():
        return len(text)
    return sum(2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)


@dataclass(frozen=True)
class Leftover:
    """A line still too wide: where, how wide and why it was left."""

    path: str
    row: int
    width: int
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.row}: width {self.width}: {self.why}"


class UnsafeRewriteError(Exception):
    """A rewrite that would change what the code does (a bug of this tool): the file is left as it was."""


@dataclass(frozen=True)
class _Edit:
    """Rows ``first`` to ``last`` (1-based, inclusive) replaced by ``lines``."""

    first: int
    last: int
    lines: list[str]


def _apply(lines: list[str], edits: Iterable[_Edit]) -> list[str]:
    """``lines`` with the edits made, bottom up (an edit overlapping one made waits for the next pass)."""
    out = list(lines)
    taken: set[int] = set()
    for edit in sorted(edits, key=lambda e: e.first, reverse=True):
        rows = set(range(edit.first, edit.last + 1))
        if not rows & taken:
            taken |= rows
            out[edit.first - 1 : edit.last] = edit.lines
    return out


# --- Filling -----------------------------------------------------------------------------------------------


def _units(text: str, starters: re.Pattern[str]) -> list[str]:
    """``text`` as units a line may end after: words, one that must not start a line glued to the last."""
    units: list[str] = []
    for word in WORD.findall(text):
        if units and starters.match(word):
            units[-1] = f"{units[-1]} {word}"
        else:
            units.append(word)
    return units


def _fill(units: Sequence[str], first_lead: str, lead: str, width: int, tail: str = "") -> list[str]:
    """Greedy fill: the first line starts with ``first_lead``, the others with ``lead``.

    ``tail`` ends the last line.

    A unit (an inline literal, words glued together) too wide for a line of its own is cut into its words.
    """
    pending = list(units)
    if not pending:
        return [first_lead + tail]
    pending[-1] += tail
    lines: list[str] = []
    current, empty = first_lead, True
    while pending:
        unit = pending.pop(0)
        joined = current + ("" if empty else " ") + unit
        if text_width(joined) <= width:
            current, empty = joined, False
        elif not empty:
            lines.append(current)
            current, empty = lead, True
            pending.insert(0, unit)
        elif " " in unit:
            pending[:0] = unit.split()
        else:
            current, empty = joined, False
    lines.append(current)
    return lines


@dataclass(frozen=True)
class _Item:
    """A significant token (an f-string as one): its start, its end and the brackets open around it."""

    start: tuple[int, int]
    end: tuple[int, int]
    string: str
    is_literal: bool
    depth: int


# --- A parsed file -----------------------------------------------------------------------------------------


@dataclass
class _Source:
    """A file's lines with its tokens and syntax tree."""

    lines: list[str]
    tokens: list[tokenize.TokenInfo]
    tree: ast.Module

    @classmethod
    def parse(cls, lines: list[str]) -> _Source:
        """Parse ``lines`` (raises ``SyntaxError``)."""
        text = "".join(line + "\n" for line in lines)
        return cls(lines, list(tokenize.generate_tokens(io.StringIO(text).readline)), ast.parse(text))

    def items(self) -> list[_Item]:
        """The significant tokens, an f-string as one item, with the brackets open around each."""
        items: list[_Item] = []
        depth, nested = 0, 0
        start = (0, 0)
        for token in self.tokens:
            if token.type in _FSTRING_STARTS:
                start = token.start if nested == 0 else start
                nested += 1
            elif token.type in _FSTRING_ENDS:
                nested -= 1
                if nested == 0:
                    items.append(_Item(start, token.end, "", True, depth))
            elif not nested and token.type not in (*_NOT_SIGNIFICANT, tokenize.ENDMARKER):
                closing = token.type == tokenize.OP and token.string in (")", "]", "}")
                depth -= closing
                is_literal = token.type == tokenize.STRING
                items.append(_Item(token.start, token.end, token.string, is_literal, depth))
                depth += token.type == tokenize.OP and token.string in ("(", "[", "{")
        return items

    def string_token(self, start: tuple[int, int]) -> tokenize.TokenInfo | None:
        """The plain (not f-) string token that starts at ``start``, if one does."""
        for token in self.tokens:
            if token.type == tokenize.STRING and token.start == start:
                return token
        return None

    def covered_rows(self) -> set[int]:
        """Rows that start inside a token (a multi-line string) or after a backslash continuation."""
        rows: set[int] = set()
        for token in self.tokens:
            rows.update(range(token.start[0] + 1, token.end[0] + 1))
        rows.update(row + 1 for row, line in enumerate(self.lines, start=1) if line.rstrip().endswith("\\"))
        return rows

    def bare_strings(self) -> list[tuple[ast.Expr, bool]]:
        """Every statement that is a string alone (docstrings), and whether pydocstyle checks it."""
        found: list[tuple[ast.Expr, bool]] = []
        for node in ast.walk(self.tree):
            for name in ("body", "orelse", "finalbody"):
                block = getattr(node, name, None)
                if not isinstance(block, list):
                    continue
                for index, statement in enumerate(block):
                    if (
                        isinstance(statement, ast.Expr)
                        and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str)
                    ):
                        checked = name == "body" and index == 0 and isinstance(node, _DOCUMENTED)
                        found.append((statement, checked))
        return found

    def unformatted_rows(self) -> set[int]:
        """Rows ruff leaves alone: ``# fmt: skip`` statements, ``# fmt: off`` to ``# fmt: on`` regions."""
        rows: set[int] = set()
        start, off_since = 1, None
        for token in self.tokens:
            if token.type == tokenize.COMMENT:
                directive = token.string[1:].strip().lower()
                if directive == "fmt: off":
                    off_since = token.start[0] if off_since is None else off_since
                elif directive == "fmt: on" and off_since is not None:
                    rows.update(range(off_since, token.start[0] + 1))
                    off_since = None
                elif re.search(r"\bfmt:\s*skip\b", directive):
                    rows.update(range(start, token.start[0] + 1))
            if token.type == tokenize.NEWLINE:
                start = token.end[0] + 1
        if off_since is not None:
            rows.update(range(off_since, len(self.lines) + 1))
        return rows

    def docstring_rows(self) -> set[int]:
        """The rows of the string statements."""
        rows: set[int] = set()
        for statement, _ in self.bare_strings():
            rows.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
        return rows


# --- Paragraphs --------------------------------------------------------------------------------------------


@dataclass
class _Para:
    """Lines wrapped together: the indent of the first, that of the others, and whether that one hangs."""

    rows: list[int]
    first: int
    cont: int | None
    hanging: bool

    def takes(self, indent: int, may_hang: bool) -> bool:
        """Whether a line at ``indent`` continues the paragraph.

        The second line fixes the continuation indent. An item's second line is deeper than its first; a
        plain paragraph's is as deep or, with ``may_hang``, deeper (an RST definition, a ``type: what``
        return value), and then its indent hangs.
        """
        if len(self.rows) > 1:
            return indent == self.cont
        if self.hanging:
            if indent > self.first:
                self.cont = indent
                return True
            return False
        if indent == self.first or (may_hang and indent > self.first):
            self.cont, self.hanging = indent, indent > self.first
            return True
        return False


# --- Trailing comments -------------------------------------------------------------------------------------


def _move_trailing_comments(src: _Source, width: int) -> list[_Edit]:
    """A trailing comment of a code line too wide moved onto its own lines above it (not a pragma)."""
    edits: list[_Edit] = []
    covered = src.covered_rows() | src.unformatted_rows()
    for token in src.tokens:
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        line = src.lines[row - 1]
        code = line[:col]
        if not code.strip() or text_width(line) <= width or PRAGMA.search(token.string) or row in covered:
            continue
        lead = line[: len(line) - len(line.lstrip())]
        comment = _fill(_units(token.string[1:].strip(), COMMENT_STARTERS), f"{lead}# ", f"{lead}# ", width)
        edits.append(_Edit(row, row, [*comment, code.rstrip()]))
    return edits


# --- Comment blocks ----------------------------------------------------------------------------------------


def _wrap_comment_blocks(src: _Source, width: int, reasons: dict[int, str] | None = None) -> list[_Edit]:
    """Paragraphs of full-line comments with a line too wide, rewrapped from that line on.

    ``reasons`` gets why each comment line that is not in a paragraph is kept as it is.
    """
    reasons = {} if reasons is None else reasons
    full: dict[int, tokenize.TokenInfo] = {}
    for token in src.tokens:
        row, col = token.start
        if token.type == tokenize.COMMENT and not src.lines[row - 1][:col].strip():
            if row <= 2 and (token.string.startswith("#!") or re.match(r"#.*coding[:=]", token.string)):
                continue
            full[row] = token
    paras: list[_Para] = []
    texts: dict[int, str] = {}
    edits: list[_Edit] = []
    current: _Para | None = None
    for row in sorted(full):
        token = full[row]
        if current is not None and full[current.rows[-1]].start != (row - 1, token.start[1]):
            current = None
        body = token.string[1:]
        reasons[row] = "comment kept as it is (a pragma, a rule, or no space after '#')"
        stripped = body.strip()
        rule = max(RULE.finditer(token.string), key=lambda m: len(m.group()), default=None)
        excess = text_width(src.lines[row - 1]) - width
        if rule and excess > 0 and len(rule.group()) - excess >= 3:
            shorter = rule.group(1) * (len(rule.group()) - excess)
            comment = token.string[: rule.start()] + shorter + token.string[rule.end() :]
            edits.append(_Edit(row, row, [src.lines[row - 1][: token.start[1]] + comment]))
        kept = rule or PRAGMA.match(token.string) or UNDERLINE.match(stripped)
        if kept or not body.startswith(" ") or not stripped:
            current = None
            continue
        text = body[1:]
        indent = len(text) - len(text.lstrip())
        texts[row] = text.strip()
        marker = LIST_ITEM.match(texts[row])
        reasons[row] = _PROSE
        if marker:
            current = _Para([row], indent, indent + marker.end(), True)
            paras.append(current)
        elif CODE_LIKE.match(texts[row]):
            current, reasons[row] = None, "comment that reads as code, kept as it is"
        elif current is not None and current.takes(indent, may_hang=False):
            current.rows.append(row)
        elif indent > 0:
            current = None  # deeper than its paragraph: code, or a quote
            reasons[row] = "comment indented deeper than its paragraph (code, a quote), kept as it is"
        else:
            current = _Para([row], indent, None, False)
            paras.append(current)
    for para in paras:
        wide = [row for row in para.rows if text_width(src.lines[row - 1]) > width]
        if not wide:
            continue
        start = para.rows.index(wide[0])
        rows = para.rows[start:]
        hash_lead = src.lines[rows[0] - 1][: full[rows[0]].start[1]]
        cont = para.cont if para.cont is not None else para.first
        own = para.first if start == 0 else cont
        units = _units(" ".join(texts[row] for row in rows), COMMENT_STARTERS)
        new = _fill(units, f"{hash_lead}# {' ' * own}", f"{hash_lead}# {' ' * cont}", width)
        edits.append(_Edit(rows[0], rows[-1], new))
    return edits


# --- Docstrings --------------------------------------------------------------------------------------------


@dataclass
class _DocLine:
    """One line of a docstring: its leading whitespace and text, the quotes on the first and the last."""

    row: int
    lead: str
    text: str
    opening: str = ""
    closing: str = ""
    fixed: str = ""
    """Why the line is kept as it is ("" where it may be rewrapped)."""

    @property
    def indent(self) -> int:
        """Its indentation, in columns."""
        return len(self.lead.expandtabs(8))


def _doc_lines(src: _Source, statement: ast.Expr) -> list[_DocLine] | None:
    """The docstring's lines; ``None`` where it is not a lone triple-quoted string that starts its line."""
    token = src.string_token((statement.lineno, statement.col_offset))
    if token is None or token.end[0] != statement.end_lineno:
        return None
    (first_row, col), (last_row, end_col) = token.start, token.end
    match = re.match(r"([rRuU]?)(\"\"\"|''')", token.string)
    lines = src.lines
    if not match or lines[first_row - 1][:col].strip() or len(token.string) < 6:
        return None
    quote = match.group(2)
    raw = match.group(1) in ("r", "R")
    trailing = lines[last_row - 1][end_col:]
    out: list[_DocLine] = []
    for row in range(first_row, last_row + 1):
        line = lines[row - 1]
        start = col + len(match.group(0)) if row == first_row else 0
        stop = end_col - 3 if row == last_row else len(line)
        lead = line[:col] if row == first_row else line[: len(line) - len(line.lstrip())]
        doc = _DocLine(row, lead, line[start:stop].strip())
        if row == first_row:
            doc.opening = match.group(0)
        if row == last_row:
            doc.closing = quote
            if trailing.strip():
                doc.closing, doc.fixed = quote + trailing, "code after the docstring on its line"
        if not raw and doc.text.endswith("\\"):
            doc.fixed = "a backslash ends the line"
        out.append(doc)
    return out


def _doc_paras(doc: list[_DocLine], checked: bool, item_offset: int) -> list[_Para]:
    """The docstring's paragraphs that may be rewrapped; a line kept as it is gets its ``fixed`` reason."""
    tables: set[int] = set()
    chunk: list[_DocLine] = []
    for line in [*doc, _DocLine(0, "", "")]:
        if line.text:
            chunk.append(line)
        else:
            if any(TABLE_LINE.match(c.text) for c in chunk):
                tables.update(c.row for c in chunk)
            chunk = []
    paras: list[_Para] = []
    current: _Para | None = None
    mode, literal_base, fence = "", -1, ""
    section: tuple[int, bool] | None = None  # the header's indent, whether its lines are items
    item_indent: int | None = None
    for index, line in enumerate(doc):
        text, indent = line.text, line.indent
        if not text:
            current = None
            mode = "" if mode == "doctest" else mode
            continue
        if mode == "fence":
            line.fixed = "fenced code"
            mode = "" if text.startswith(fence) else mode
            continue
        if mode == "literal":
            if indent > literal_base:
                line.fixed = "literal block"
                continue
            mode = ""
        if mode == "doctest":
            line.fixed = "doctest"
            continue
        if section is not None and indent <= section[0]:
            section, item_indent = None, None
        if index == 0 and checked:
            line.fixed = _DOCSTRING_SUMMARY
        elif line.fixed:
            pass
        elif text.startswith(">>>"):
            line.fixed, mode = "doctest", "doctest"
        elif text.startswith(("```", "~~~")):
            line.fixed, mode, fence = "fenced code", "fence", text[:3]
        elif line.row in tables:
            line.fixed = "table"
        elif PLACEHOLDER.match(text):
            line.fixed = "placeholder"
        elif text.startswith(".. "):
            line.fixed, mode, literal_base = "directive", "literal", indent
        elif UNDERLINE.match(text):
            line.fixed = "title underline"
        elif SECTION.fullmatch(text):
            line.fixed = "section header"
            section, item_indent = (indent, text.rstrip(": ") in ITEM_SECTIONS), None
        if line.fixed:
            current = None
            if text.endswith("::") and not mode:
                mode, literal_base = "literal", indent
            continue
        starter: int | None = None  # where an item that starts here continues
        if section is not None and section[1] and indent > section[0]:
            item_indent = indent if item_indent is None else item_indent
            if indent == item_indent:
                starter = indent + item_offset
        marker = LIST_ITEM.match(text)
        if marker:
            starter = indent + marker.end()
        elif FIELD_ITEM.match(text):
            starter = indent + item_offset
        if starter is None and current is not None and current.takes(indent, may_hang=True):
            current.rows.append(line.row)
        else:
            current = _Para([line.row], indent, starter, starter is not None)
            paras.append(current)
        if text.endswith("::"):
            mode, literal_base, current = "literal", current.first, None
    return paras


def _item_offset(src: _Source, docs: list[tuple[ast.Expr, bool]]) -> int:
    """The hanging indent the file's docstrings give an item's continuation lines (4 where none has one)."""
    offsets: Counter[int] = Counter()
    for statement, _ in docs:
        section: int | None = None
        item: int | None = None
        for line in _doc_lines(src, statement) or []:
            if not line.text:
                continue
            if SECTION.fullmatch(line.text):
                section = line.indent if line.text.rstrip(": ") in ITEM_SECTIONS else None
                item = None
            elif section is None or line.indent <= section:
                section = None
            elif item is None or line.indent <= item:
                item = line.indent
            else:
                offsets[line.indent - item] += 1
    return offsets.most_common(1)[0][0] if offsets else 4


def _wrap_docstrings(src: _Source, width: int, reasons: dict[int, str]) -> list[_Edit]:
    """Docstring paragraphs with a line too wide, rewrapped from that line on.

    ``reasons`` gets, for every docstring line, why it would be kept as it is.
    """
    docs = src.bare_strings()
    offset = _item_offset(src, docs)
    edits: list[_Edit] = []
    for statement, checked in docs:
        doc = _doc_lines(src, statement)
        if doc is None:
            for row in range(statement.lineno, (statement.end_lineno or statement.lineno) + 1):
                reasons[row] = "a string statement that is not one triple-quoted string"
            continue
        paras = _doc_paras(doc, checked, offset)
        by_row = {line.row: line for line in doc}
        for line in doc:
            reasons[line.row] = line.fixed or _PROSE
        for para in paras:
            wide = [row for row in para.rows if text_width(src.lines[row - 1]) > width]
            if not wide:
                continue
            start = para.rows.index(wide[0])
            rows = para.rows[start:]
            head = by_row[rows[0]]
            if start > 0:
                cont_lead = head.lead  # the first line rewrapped continues the paragraph itself
            elif len(para.rows) > 1:
                cont_lead = by_row[para.rows[1]].lead
            else:
                cont_lead = " " * (para.cont if para.cont is not None else para.first)
            units = _units(" ".join(by_row[row].text for row in rows), DOC_STARTERS)
            new = _fill(units, head.lead + head.opening, cont_lead, width, by_row[rows[-1]].closing)
            edits.append(_Edit(rows[0], rows[-1], new))
    return edits


# --- String literals ---------------------------------------------------------------------------------------


_Atoms = list[tuple[str, bool]]
"""A literal's text as atoms: ``(text, is_field)``, a character or escape sequence, or a replacement
field."""


@dataclass(frozen=True)
class _Literal:
    """A string literal on one line: where it is, its prefix less ``f``, its quote and its atoms.

    An atom is a character (or an escape sequence) of the text as a plain string writes it, or a replacement
    field, whole: ``(text, is_field)``.
    """

    row: int
    col: int
    end_col: int
    letters: str
    quote: str
    atoms: list[tuple[str, bool]]

    @property
    def kind(self) -> tuple[str, str]:
        """What two literals must share to be merged: their prefix (less ``f``) and their quote."""
        return "".join(sorted(self.letters.lower())), self.quote


def _field_end(body: str, start: int) -> int:
    """Where the replacement field that starts at ``body[start]`` ends (its closing brace included)."""
    depth, i = 0, start
    while i < len(body):
        char = body[i]
        if char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
            if depth == 0:
                return i + 1
        elif char in "'\"":
            end = body.find(char, i + 1)
            i = end + 1 if end >= 0 else len(body)
            continue
        i += 1
    return len(body)


def _literal(line: str, item: _Item) -> _Literal | None:
    """The one-line, single-quoted string literal ``item`` is, parsed; ``None`` for anything else."""
    (row, col), (end_row, end_col) = item.start, item.end
    text = line[col:end_col]
    match = re.match(r"([A-Za-z]*)('|\")", text)
    if row != end_row or not match or text[match.end() - 1 :].startswith(match.group(2) * 3):
        return None
    prefix, quote = match.group(1), match.group(2)
    is_f = "f" in prefix.lower()
    body = text[match.end() : -1]
    atoms: list[tuple[str, bool]] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            end = (body.find("}", i) + 1 or len(body)) if body.startswith("\\N{", i) else i + 2
            atoms.append((body[i:end], False))
            i = end
        elif is_f and body.startswith(("{{", "}}"), i):
            atoms.append((char, False))
            i += 2
        elif is_f and char == "{":
            end = _field_end(body, i)
            atoms.append((body[i:end], True))
            i = end
        else:
            atoms.append((char, False))
            i += 1
    return _Literal(row, col, end_col, prefix.replace("f", "").replace("F", ""), quote, atoms)


def _emit(letters: str, quote: str, atoms: Sequence[tuple[str, bool]]) -> str:
    """The literal that holds ``atoms``: an f-string where one is a field (its braces then doubled)."""
    if not any(field for _, field in atoms):
        return f"{letters}{quote}{''.join(text for text, _ in atoms)}{quote}"
    doubled = [text if field or len(text) > 1 else text.replace("{", "{{") for text, field in atoms]
    body = "".join(text if len(text) > 1 else text.replace("}", "}}") for text in doubled)
    return f"{letters}f{quote}{body}{quote}"


def _reflow(
    parts: list[_Atoms], kind: tuple[str, str], leads: tuple[str, str], after: str, width: int
) -> tuple[list[_Atoms], int]:
    """The parts rewrapped: each cut where too wide, the rest carried into the next.

    ``([], 0)`` where a part cannot be cut to fit. The first line starts with ``leads[0]``, the others with
    ``leads[1]``, and ``after`` ends the last. Once a part gets nothing carried into it, it and the parts
    after it stay as they are: the count of parts rewrapped comes with the new ones.
    """
    out: list[_Atoms] = []
    carry: _Atoms = []
    i = 0
    while i < len(parts) or carry:
        if i < len(parts) and out and not carry:
            return out, i
        atoms = carry + (parts[i] if i < len(parts) else [])
        tail = after if i >= len(parts) - 1 else ""
        i = min(i + 1, len(parts))
        lead = leads[1] if out else leads[0]
        if _fits(lead, _emit(*kind, atoms) + tail, width):
            out.append(atoms)
            carry = []
            continue
        spaces = [p for p, atom in enumerate(atoms) if p > 0 and atom == (" ", False)]
        fitting = [p for p in spaces if _fits(lead, _emit(*kind, atoms[:p]), width)]
        if not fitting:
            return [], 0
        out.append(atoms[: fitting[-1]])
        carry = atoms[fitting[-1] :]
    return out, len(parts)


def _fits(lead: str, text: str, width: int) -> bool:
    return text_width(lead + text) <= width


def _split_strings(src: _Source, width: int) -> list[_Edit]:
    """The string literal that makes a code line too wide, cut into concatenated parts, one a line.

    Where it is a part of such a concatenation already, laid out one part a line, it and the parts after it
    are merged and cut again, so that no short piece is left over.
    """
    edits: list[_Edit] = []
    skip = src.docstring_rows() | src.unformatted_rows()
    items = src.items()
    lines = src.lines
    taken: set[int] = set()
    for index, item in enumerate(items):
        row = item.start[0]
        line = lines[row - 1]
        if not item.is_literal or row in skip or row in taken or text_width(line) <= width:
            continue
        on_row = [i for i in range(index, len(items)) if items[i].start[0] == row and items[i].is_literal]
        limit = 0  # the first column past the width
        while limit < len(line) and text_width(line[: limit + 1]) <= width:
            limit += 1
        starting = [i for i in on_row if items[i].start[1] < limit]
        crossing = [i for i in starting if items[i].end[1] > limit]
        chosen = crossing[0] if crossing else starting[-1] if starting else None
        if chosen != index:
            continue  # the row's literal to cut is another
        literal = _literal(line, item)
        previous = items[index - 1] if index > 0 else None
        if literal is None or (previous is not None and previous.string in ("->", "case", "match", "type")):
            continue  # not a one-line literal, an annotation, a pattern
        parts = [literal]
        while index + len(parts) < len(items):
            last = parts[-1]
            following = items[index + len(parts)]
            nxt = _literal(lines[following.start[0] - 1], following) if following.is_literal else None
            if (
                nxt is None
                or nxt.row != last.row + 1
                or nxt.kind != literal.kind
                or lines[last.row - 1][last.end_col :].strip()
                or lines[nxt.row - 1][: nxt.col].strip()
            ):
                break
            parts.append(nxt)
        lead = line[: len(line) - len(line.lstrip())]
        before, after = line[: literal.col], lines[parts[-1].row - 1][parts[-1].end_col :]
        neighbours = (previous, items[index + len(parts)] if index + len(parts) < len(items) else None)
        next_to_string = any(t is not None and t.is_literal for t in neighbours)
        kind = (literal.letters, literal.quote)
        if item.depth > 0:
            # The indent of the parts after the first: theirs, else the first's where it starts its line.
            cont = lines[parts[1].row - 1][: parts[1].col] if len(parts) > 1 else lead
            new_parts, used = _reflow([part.atoms for part in parts], kind, (before, cont), after, width)
        elif len(parts) == 1 and before.strip() and not next_to_string:
            cont = lead + "    "  # put in parentheses
            new_parts, used = _reflow([literal.atoms], kind, (cont, cont), "", width)
        else:
            continue  # a statement of its own, or a concatenation outside brackets
        if len(new_parts) < 2:
            continue
        texts = [_emit(*kind, atoms) for atoms in new_parts]
        end = after if used == len(parts) else ""
        if item.depth > 0:
            new = [before + texts[0], *(cont + text for text in texts[1:-1]), cont + texts[-1] + end]
        else:
            new = [before + "(", *(cont + text for text in texts), lead + ")" + after]
        last_row = parts[used - 1].row
        taken.update(range(row, last_row + 1))
        edits.append(_Edit(row, last_row, new))
    return edits


# --- A file ------------------------------------------------------------------------------------------------


def _normalized(text: str) -> str:
    """The syntax tree as ``ast.dump`` shows it, with the whitespace of every string statement collapsed."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            value.value = " ".join(value.value.split())
    return ast.dump(tree)


def _split_lines(text: str) -> tuple[list[str], str, bool]:
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.replace("\r\n", "\n").split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    return lines, newline, ends_with_newline


def rewrap(text: str, width: int = DEFAULT_WIDTH) -> str:
    """``text`` (a module's source) with its comments, docstrings and string literals rewrapped to ``width``.

    Raises:
        SyntaxError: ``text`` is not valid Python.
        UnsafeRewriteError: the rewrite changed the syntax tree beyond docstrings' whitespace (a bug here).
    """
    lines, newline, ends_with_newline = _split_lines(text)
    original = _normalized(text)
    steps = (
        _move_trailing_comments,
        _wrap_comment_blocks,
        lambda src, width: _wrap_docstrings(src, width, {}),
        _split_strings,
    )
    for _ in range(8):
        changed = False
        for step in steps:
            new = _apply(lines, step(_Source.parse(lines), width))
            changed, lines = changed or new != lines, new
        if not changed:
            break
    out = newline.join(lines) + (newline if ends_with_newline else "")
    if _normalized(out) != original:
        raise UnsafeRewriteError("rewrapping would change the syntax tree; the file is left as it was")
    return out


def leftovers(path: str, text: str, width: int = DEFAULT_WIDTH) -> list[Leftover]:
    """The lines of ``text`` still wider than ``width``, each with why this tool leaves it."""
    lines = _split_lines(text)[0]
    wide = [row for row, line in enumerate(lines, start=1) if text_width(line) > width]
    if not wide:
        return []
    src = _Source.parse(lines)
    doc_reasons: dict[int, str] = {}
    _wrap_docstrings(src, width, doc_reasons)
    comment_reasons: dict[int, str] = {}
    _wrap_comment_blocks(src, width, comment_reasons)
    comments = {t.start[0]: t for t in src.tokens if t.type == tokenize.COMMENT}
    unformatted = src.unformatted_rows()
    string_rows = {item.start[0] for item in src.items() if item.is_literal}
    out: list[Leftover] = []
    for row in wide:
        line = lines[row - 1]
        comment = comments.get(row)
        if row in doc_reasons:
            why = doc_reasons[row]
            if why in ("doctest", "fenced code", "table", "literal block", "directive", "placeholder"):
                why = f"docstring {why}: shorten it by hand"
        elif row in comment_reasons:
            why = comment_reasons[row]
        elif row in unformatted:
            why = "code that ruff leaves as it is (`# fmt: skip`, `# fmt: off`): lay it out by hand"
        elif comment is not None and PRAGMA.search(comment.string):
            why = f"code with a pragma comment ({comment.string.strip()}): shorten the code by hand"
        elif row in string_rows:
            why = "code with a string: run ruff format, then this tool again (else there is no safe cut)"
        else:
            why = f"code: run `ruff format --line-length {width}`, or shorten it by hand"
        out.append(Leftover(path, row, text_width(line), why))
    return out


# --- Command line ------------------------------------------------------------------------------------------


def python_files(paths: Iterable[str]) -> list[Path]:
    """The files given and the ``*.py`` files under the directories given, in order, each once."""
    found: dict[Path, None] = {}
    for name in paths:
        path = Path(name)
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            found[file] = None
    return list(found)


def _ruff_format(files: Sequence[Path], width: int) -> None:
    ruff = shutil.which("ruff")
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    arguments = ["format", "--quiet", "--line-length", str(width), *map(str, files)]
    subprocess.run([*command, *arguments], check=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="wrap_long_lines.py",
        description=(__doc__ or "").split("\n", 1)[0],
        epilog="See the module docstring.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files, or directories of them")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="the widest line (default 109)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if a line is too wide")
    mode.add_argument("--diff", action="store_true", help="write nothing; print what would change")
    fmt_help = "run `ruff format --line-length WIDTH` between rewraps, until stable"
    parser.add_argument("--format", action="store_true", help=fmt_help)
    args = parser.parse_args(argv)
    files = python_files(args.paths)
    writes = not (args.check or args.diff)
    status = 0
    failed: set[Path] = set()
    for _ in range(4 if args.format and writes else 1):
        changed = False
        for path in files:
            if path in failed:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
                new = rewrap(text, args.width) if not args.check else text
            except (OSError, UnicodeDecodeError, SyntaxError, UnsafeRewriteError) as error:
                print(f"{path}: {type(error).__name__}: {error}", file=sys.stderr)
                failed.add(path)
                status = 2
                continue
            if new == text:
                continue
            if args.diff:
                old_lines, new_lines = text.splitlines(keepends=True), new.splitlines(keepends=True)
                sys.stdout.writelines(difflib.unified_diff(old_lines, new_lines, str(path), str(path)))
            else:
                path.write_text(new, encoding="utf-8", newline="")
                changed = True
        if args.format and writes:
            formatted = [path for path in files if path not in failed]
            before = [path.read_bytes() for path in formatted]
            _ruff_format(formatted, args.width)
            changed = changed or before != [path.read_bytes() for path in formatted]
        if not changed:
            break
    left: list[Leftover] = []
    for path in files:
        if path in failed:
            continue
        text = path.read_bytes().decode("utf-8")
        left += leftovers(str(path), rewrap(text, args.width) if args.diff else text, args.width)
    for item in left:
        print(item)
    return max(status, 1) if args.check and left else status


if __name__ == "__main__":
    sys.exit(main())
