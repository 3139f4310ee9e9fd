"""A memory gate: ``gpumem check LOGDIR --max-peak 20GiB ...`` holds each run to limits and to a baseline.

The figures are the report's (:func:`~lightning_gpumem.report.summary.summarize`): the *peak* is the highest
peak allocated over the stages (``gpumem/<stage>_peak_allocated_gib``, or its ``_max`` over ranks), the *peak
reserved* the same of ``gpumem/<stage>_peak_reserved_gib``; the JSON report's ``peak_allocated_gib`` and
``peak_reserved_gib``. Each check is an :class:`Outcome`: passed, broken, or not checked (a figure not
logged, no baseline run to compare with).

Example:
    >>> parse_size("512MiB"), parse_fraction("5%"), parse_fraction("0.05")
    (0.5, 0.05, 0.05)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpumem._core.units import GIB, parse_budget
from lightning_gpumem.report._text import printable
from lightning_gpumem.report.summary import RunSummary

PASSED, BROKEN, UNCHECKED = "ok", "broken", "unchecked"
EXIT_OK, EXIT_BROKEN, EXIT_UNCHECKED = 0, 1, 2
MAX_DIGITS = 6  # decimals a figure and its limit are shown with, at most, to tell them apart
_FRACTION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*$")


@dataclass(frozen=True)
class Limits:
    """What each run is held to; ``None`` (or ``False``) leaves a check out.

    Attributes:
        max_peak_gib: the highest the peak (allocated) may be.
        max_reserved_gib: the highest the peak reserved may be.
        no_leak: no leak may have been flagged (``gpumem/leak_warnings``).
        max_increase: how much the peak and the peak reserved may exceed the baseline run's, as a fraction
            (``0.05``: 5%).
    """

    max_peak_gib: float | None = None
    max_reserved_gib: float | None = None
    no_leak: bool = False
    max_increase: float | None = None


@dataclass(frozen=True)
class Outcome:
    """One check of one run.

    Attributes:
        run: the run's name.
        verdict: :data:`PASSED`, :data:`BROKEN` or :data:`UNCHECKED`.
        text: what was compared, as ``peak 21.3 GiB > 20.0 GiB``.
        option: the option that set the limit (shown when the check does not pass).
    """

    run: str
    verdict: str
    text: str
    option: str

    def line(self) -> str:
        """``ok   run NAME: TEXT``, or ``FAIL run NAME: TEXT (OPTION)``; control characters escaped."""
        if self.verdict == PASSED:
            return f"ok   run {printable(self.run)}: {printable(self.text)}"
        return f"FAIL run {printable(self.run)}: {printable(self.text)} ({self.option})"


def parse_size(text: str) -> float:
    """A size such as ``"20GiB"``, ``"512MiB"`` or ``"20GB"``, in GiB (1 MiB to 16 EiB).

    Raises:
        ValueError: not a size with a unit, or out of that range; the message names ``text``.
    """
    try:
        size = parse_budget(str(text), None, "check")
    except ValueError as error:
        reason = str(error).split("is not valid. ", 1)[-1]
        reason = reason[:1].lower() + reason[1:]
        raise ValueError(f"{text!r} is not a size: {reason}") from None
    return size / GIB


def parse_fraction(text: str) -> float:
    """A share such as ``"5%"`` or ``"0.05"`` (a bare number is a fraction, at most 1) as a fraction.

    Raises:
        ValueError: not a percentage or a fraction in [0, 1]; the message names ``text``.
    """
    match = _FRACTION.match(str(text))
    if match is None or not math.isfinite(float(match.group(1))):
        raise ValueError(
            f"{text!r} is not a share: expected a percentage such as '5%' or a fraction such as 0.05."
        )
    number, percent = float(match.group(1)), bool(match.group(2))
    if not percent and number > 1:
        raise ValueError(
            f"{text!r} is read as a fraction and is over 1: for {number:g} percent write '{number:g}%'."
        )
    return number / 100 if percent else number


def peak(summary: RunSummary) -> float | None:
    """The run's peak: the highest peak allocated over its stages (GiB), ``None`` where none was logged."""
    values = [allocated for allocated, _ in summary.stage_peaks.values() if allocated is not None]
    return max(values) if values else None


FIGURES = {"peak": peak, "peak reserved": lambda summary: summary.peak_reserved}


def check_runs(
    runs: Sequence[RunSummary], limits: Limits, baseline: Sequence[RunSummary] = ()
) -> list[Outcome]:
    """Hold each run to ``limits``; ``baseline``: the runs ``limits.max_increase`` compares with.

    A run is compared with the baseline run of its name, or, where each side has one run, with that run.

    Returns:
        The outcomes, run by run, in the order of the limits' attributes.
    """
    outcomes: list[Outcome] = []
    for summary in runs:
        name = summary.name
        for option, figure, limit in (
            ("--max-peak", "peak", limits.max_peak_gib),
            ("--max-reserved", "peak reserved", limits.max_reserved_gib),
        ):
            if limit is not None:
                outcomes.append(_against(name, figure, FIGURES[figure](summary), limit, option))
        if limits.no_leak:
            outcomes.append(_leak(summary))
        if limits.max_increase is not None:
            outcomes += _against_baseline(summary, limits.max_increase, runs, baseline)
    return outcomes


def exit_status(outcomes: Sequence[Outcome]) -> int:
    """1 where a limit is broken, else 2 where a check could not be made, else 0."""
    verdicts = {outcome.verdict for outcome in outcomes}
    if BROKEN in verdicts:
        return EXIT_BROKEN
    return EXIT_UNCHECKED if UNCHECKED in verdicts else EXIT_OK


def _against(
    run: str, figure: str, value: float | None, limit: float, option: str, why: str = ""
) -> Outcome:
    if value is None:
        return Outcome(run, UNCHECKED, f"{figure} not logged, so not held to {_size(limit)}{why}", option)
    shown, limit_shown = _pair(value, limit)
    if value <= limit:
        return Outcome(run, PASSED, f"{figure} {shown} <= {limit_shown}{why}", option)
    return Outcome(run, BROKEN, f"{figure} {shown} > {limit_shown}{why}", option)


def _leak(summary: RunSummary) -> Outcome:
    if summary.leak_warnings:
        rate = (
            f", growth {summary.leak_rate:.2f} MiB/step when flagged"
            if summary.leak_rate is not None
            else ""
        )
        return Outcome(summary.name, BROKEN, f"leak warnings {summary.leak_warnings} > 0{rate}", "--no-leak")
    quiet = "" if summary.leaks_watched else " (leak detection logged nothing: off, or under 32 samples)"
    return Outcome(summary.name, PASSED, f"leak warnings 0{quiet}", "--no-leak")


def _against_baseline(
    summary: RunSummary, increase: float, runs: Sequence[RunSummary], baseline: Sequence[RunSummary]
) -> list[Outcome]:
    """The run's peak and peak reserved against its baseline run's, each that the baseline logged."""
    option = f"--max-increase {_percent(increase)}"
    if len(runs) == 1 and len(baseline) == 1:
        base: RunSummary | None = baseline[0]
    else:
        base = next((other for other in baseline if other.name == summary.name), None)
    if base is None:
        names = ", ".join(repr(other.name) for other in baseline)
        return [
            Outcome(
                summary.name, UNCHECKED, f"no baseline run of this name (the baseline's: {names})", option
            )
        ]
    who = "baseline" if base.name == summary.name else f"baseline run {base.name!r}"
    outcomes = []
    for figure, read in FIGURES.items():
        before = read(base)
        if before is not None:
            why = f", {who} {_size(before, 2)} + {_percent(increase)}"
            outcomes.append(
                _against(summary.name, figure, read(summary), before * (1 + increase), option, why)
            )
    if not outcomes:
        return [Outcome(summary.name, UNCHECKED, f"{who} logged no peak to compare with", option)]
    return outcomes


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.6g}%"


def _size(gib: float, digits: int = 1) -> str:
    """GiB from 1 GiB up, MiB below: ``18.2 GiB``, ``512.0 MiB``."""
    return f"{gib:.{digits}f} GiB" if abs(gib) >= 1 else f"{gib * 1024:.{digits}f} MiB"


def _pair(value: float, limit: float) -> tuple[str, str]:
    """``value`` and ``limit`` shown with the fewest decimals (one at least) that tell them apart."""
    for digits in range(1, MAX_DIGITS + 1):
        shown = _size(value, digits), _size(limit, digits)
        if shown[0] != shown[1] or value == limit:
            return shown
    return shown
