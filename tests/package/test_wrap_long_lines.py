"""`tools/wrap_long_lines.py`: what it rewraps, what it leaves alone, and that a rerun changes nothing."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from wrap_long_lines import leftovers, rewrap  # noqa: E402

WIDTH = 60


def _wrap(source: str) -> str:
    out = rewrap(textwrap.dedent(source), WIDTH)
    assert rewrap(out, WIDTH) == out  # idempotent
    return out


def test_a_docstring_paragraph_is_rewrapped_and_a_short_one_is_not():
    source = '''
    def f():
        """Summary.

        A paragraph long enough to need a second line, and then a third line too, at sixty.
        Short and untouched.
        """
    '''
    out = _wrap(source)
    assert all(len(line) <= WIDTH for line in out.splitlines())
    assert " ".join(ast.get_docstring(ast.parse(out).body[0]).split()) == (  # type: ignore[arg-type]
        "Summary. A paragraph long enough to need a second line, and then a third line too, at sixty. "
        "Short and untouched."
    )
    untouched = _wrap('def f():\n    """Summary.\n\n    Short.\n    Lines.\n    """\n')
    assert untouched == 'def f():\n    """Summary.\n\n    Short.\n    Lines.\n    """\n'


def test_an_argument_keeps_its_hanging_indent():
    source = '''
    def f(a, b):
        """Summary.

        Args:
            a: what a is, at length, so that the line is longer than sixty.
            b: what b is.
                A continuation at eight.
        """
    '''
    out = _wrap(source)
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("a:"))
    assert lines[first].startswith("        a: ")
    assert lines[first + 1].startswith("            ")
    assert not lines[first + 1].strip().startswith("b:")


def test_doctests_literal_blocks_tables_and_placeholders_are_left_alone():
    source = '''
    def f():
        """Summary.

        >>> x = "a doctest line that is much longer than sixty characters"
        >>> x
        'a doctest line that is much longer than sixty characters'

        Example::

            a literal block line that is much longer than sixty characters

        | a table row that is much longer than sixty characters | x |
        |---|---|

        {logged_metrics}
        """
    '''
    assert _wrap(source) == textwrap.dedent(source)
    why = {item.why.split(":")[0] for item in leftovers("f.py", textwrap.dedent(source), WIDTH)}
    assert why == {"docstring doctest", "docstring literal block", "docstring table"}


def test_a_summary_line_is_reported_not_wrapped():
    source = 'def f():\n    """A summary line that is too long for sixty characters, by far."""\n'
    assert _wrap(source) == source
    (item,) = leftovers("f.py", source, WIDTH)
    assert item.row == 2
    assert item.why.startswith("docstring summary line")


def test_a_comment_block_is_rewrapped_by_paragraph():
    source = """
    # A comment paragraph that is longer than sixty characters, quite a bit.
    # Its second line.
    #
    # - a list item that is also longer than sixty characters, so it wraps.
    # x = compute(a, b)  # code in a comment, longer than sixty characters too
    x = 1
    """
    out = _wrap(source)
    assert out.splitlines()[1:] == [
        "# A comment paragraph that is longer than sixty characters,",
        "# quite a bit. Its second line.",
        "#",
        "# - a list item that is also longer than sixty characters,",
        "#   so it wraps.",
        "# x = compute(a, b)  # code in a comment, longer than sixty characters too",
        "x = 1",
    ]


def test_a_trailing_comment_moves_above_its_line_and_a_pragma_stays():
    source = """
    value = compute_something(1, 2)  # why it is computed, at length
    other = compute_something(1, 2)  # type: ignore[arg-type]  # a pragma, long
    """
    out = _wrap(source)
    assert out.splitlines()[1:3] == ["# why it is computed, at length", "value = compute_something(1, 2)"]
    assert "other = compute_something(1, 2)  # type: ignore[arg-type]  # a pragma, long" in out


@pytest.mark.parametrize(
    "source",
    [
        'raise ValueError(f"`f(a={a!r})` is not valid: {b!r} is not what was expected, {{x}} no.")\n',
        'message = f"a string assigned directly, too long for sixty {n} characters ok"\n',
        'raise ValueError(\n    f"the first part of a message {a}, long enough to wrap"\n'
        '    " and its second part"\n)\n',
        'x = [r"a raw\\ string with a backslash and more than sixty characters in it"]\n',
    ],
)
def test_a_string_literal_is_cut_at_spaces_into_the_same_text(source):
    out = _wrap(source)
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(source))
    assert all(len(line) <= WIDTH for line in out.splitlines())


def test_what_a_cut_part_carries_joins_the_next_part_of_its_concatenation():
    first = '    f"the first part of a message {a}, long enough to wrap here"'
    source = f'raise ValueError(\n{first}\n    " and its second part"\n)\n'
    assert _wrap(source).splitlines()[1:3] == [
        '    f"the first part of a message {a}, long enough to wrap"',
        '    " here and its second part"',
    ]


def test_a_rule_comment_is_shortened_not_wrapped():
    source = "# --- Part " + "-" * 70 + "\nx = 1\n"
    out = _wrap(source)
    assert out.splitlines()[0] == "# --- Part " + "-" * (WIDTH - 11)


def test_the_check_mode_exits_1_on_a_line_too_wide_and_writes_nothing(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Module."""\n\n# ' + "word " * 30 + "\nx = 1\n")
    before = path.read_text()
    tool = [sys.executable, str(ROOT / "tools" / "wrap_long_lines.py")]
    checked = subprocess.run([*tool, "--check", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 1
    assert "m.py:3" in checked.stdout
    assert path.read_text() == before
    subprocess.run([*tool, str(path)], capture_output=True, check=True)
    assert subprocess.run([*tool, "--check", str(path)], check=False).returncode == 0


def test_a_statement_ruff_leaves_alone_is_left_alone():
    call = '    "a", "a string too long for sixty characters, in a skipped statement",'
    source = f"X = f(\n{call}\n)  # fmt: skip\n"
    assert _wrap(source) == source
    (item,) = leftovers("m.py", source, WIDTH)
    assert "fmt: skip" in item.why
