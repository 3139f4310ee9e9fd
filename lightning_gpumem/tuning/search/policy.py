"""The batch-size search as a pure function of ``run_trial(batch_size) -> Trial``: no Trainer, no CUDA.

Why it is guided by memory and not only by pass/fail: peak memory is close to affine in the batch size, so a
few measured peaks give a line, and the line gives the largest size under the limit. Bisection (what
Lightning's ``BatchSizeFinder`` does) needs about ``2 * log2(B)`` trials, several of them out-of-memory
errors.

The policy, one move per trial (:mod:`~lightning_gpumem.tuning.search.moves` names each, with its reason):

1. **Probe**: ``init_val`` (or, where it does not fit, the largest size below it that the line through the
   origin allows), then the largest size whose memory the probe's own peak allows if all of it grew with the
   size: the smaller the first probe's memory against the budget, the larger this second size (``safe``).
2. **Predict**: from two points, the model's largest size under the limit (``safe``: reserved grown from the
   largest accepted size by the need times the measured growth); where peaks did not move, at least double.
3. **Validate**: each prediction runs in a trial; an accepted size becomes ``lo``, a rejected one ``hi``.
4. **Close** (one rule): until ``hi - lo - 1 <= tolerance * lo``, or one more sample than ``lo`` cannot fit
   even with no waste: near the cap, from live tensors (``near_cap``, ``squeezed``, ``edge``,
   ``optimistic``); just past the boundary, a step back by the tolerance (``step_back``); without a model,
   ``double`` and ``bisect``.

A size is *accepted* when its trial ran that many samples without OOM and, if a limit is given, its measured
peak is at most the limit. The result is always a size that was actually run and accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from lightning_gpumem.tuning.search.model import Trial, TrialSource, accepted
from lightning_gpumem.tuning.search.moves import Bracket, Evidence, Move, Proposal, next_move

StopReason = Literal["bracketed", "predicted", "upper_bound", "max_trials", "nothing_fits", "traced"]
TOLERANCE = 0.01  # the bracket closes once the sizes left open are at most this fraction of the size kept


@dataclass(frozen=True)
class SearchResult:
    """The chosen size (``None`` if even 1 does not fit), every trial in order, and why the search stopped.

    ``note`` says what bounded the search where the data did (see :func:`until_data_ends`).
    """

    batch_size: int | None
    trials: tuple[Trial, ...]
    reason: StopReason
    note: str = ""

    @property
    def num_ooms(self) -> int:
        """Trials that ended in an out-of-memory error."""
        return sum(not t.fits for t in self.trials)


@dataclass(frozen=True)
class Guess:
    """A size to try second, from outside the trials (the traced step's), and whether it is the size kept.

    Attributes:
        size: the size to try.
        kept: ``size`` is the size to keep (a headroom already given up below the traced largest size):
            accepted, it ends the search (``"traced"``); else the moves go on from it (the edge above it).
        settle: where a check of the guess was still running when it was given (the trace's replays below
            it, beside its trial): asked after the guess's trial, the guess the check leaves. A smaller
            one (or ``None``) takes this one back: its size counts as rejected, the smaller one tried next.
    """

    size: int
    kept: bool = False
    settle: Callable[[], Guess | None] | None = field(default=None, compare=False, repr=False)


def search_batch_size(
    run_trial: TrialSource,
    *,
    init_val: int = 2,
    upper: int,
    lower: int = 1,
    limit_bytes: int | None = None,
    max_trials: int = 25,
    tolerance: float = TOLERANCE,
    on_move: Callable[[Proposal], None] | None = None,
    guess: Callable[[Trial], Guess | None] | None = None,
) -> SearchResult:
    """Find the largest accepted batch size in ``[lower, upper]``: probe, predict, validate, close.

    See the module docstring.

    Args:
        run_trial: runs a trial at a batch size and reports it; called at most once per size.
        init_val: first size tried (clamped to ``upper``).
        upper: largest size that may be tried (``max_val``, or the samples an epoch draws).
        lower: smallest size that may be tried (a token budget's: the longest sample's cost); where it is
            rejected, nothing fits (``"nothing_fits"``).
        limit_bytes: peaks above this are rejected like OOMs; ``None`` accepts any size that runs.
        max_trials: stop after this many trials with the best size found.
        tolerance: stop once the sizes between the largest accepted and the smallest rejected one are at most
            this fraction of the accepted one (0: always to the exact boundary). Below 100 the boundary is
            always exact. A step back steps this fraction of the size that was just too large (at least 1).
        on_move: called with each move's :class:`Proposal` (its size clamped to the open sizes) before its
            trial runs; not called for the sizes tried on the way down to the first accepted one.
        guess: given the first accepted trial, a :class:`Guess` (the traced step's, calibrated by that
            trial: ``traced_guess`` in ``tuning/sources/traced.py``); where its size is above that trial's,
            it is the second size tried (the move ``traced``), and the moves go on from what it measured,
            unless it is the size to keep and runs: then the search ends there (``"traced"``). ``None``: no
            guess.

    Returns:
        The largest accepted size and the trials.

    Example:
        >>> def run(bs):  # 1 GiB fixed + 0.5 GiB per sample, 24 GiB card
        ...     peak = 2**30 + bs * 2**29
        ...     return Trial(bs, fits=peak <= 24 * 2**30, peak_bytes=peak)
        >>> result = search_batch_size(run, upper=4096, limit_bytes=int(0.95 * 24 * 2**30))
        >>> result.batch_size, len(result.trials), result.num_ooms
        (43, 3, 0)
    """
    if upper < 1:
        raise ValueError(f"`upper={upper}` must be at least 1.")
    if not 1 <= lower <= upper:
        raise ValueError(f"`lower={lower}` must be at least 1 and at most `upper={upper}`.")
    trials: dict[int, Trial] = {}

    def run(batch_size: int) -> Trial:
        if batch_size not in trials:
            trials[batch_size] = run_trial(batch_size)
        return trials[batch_size]

    # 1. One accepted size, going down from init_val, never below `lower`.
    size = max(lower, min(init_val, upper))
    hi: int | None = None
    while not accepted(run(size), limit_bytes):
        hi = size
        if size == lower:
            return SearchResult(None, tuple(trials.values()), "nothing_fits")
        if len(trials) >= max_trials:
            return SearchResult(None, tuple(trials.values()), "max_trials")
        ev = Evidence(list(trials.values()), limit_bytes)
        below = ev.safe_size(trials[size])  # the line through the origin
        size = below if below is not None and lower <= below < size else max(lower, size // 2)

    # 2. Up the bracket, one move per trial.
    bracket = Bracket(lo=size, hi=hi, upper=upper, tolerance=tolerance)
    guessed = guess(trials[size]) if guess is not None else None
    while True:
        lo = bracket.lo
        ev = Evidence(list(trials.values()), limit_bytes)
        stop = _stop(bracket, ev, len(trials), max_trials, tolerance)
        if stop is not None:
            return SearchResult(lo, tuple(trials.values()), stop)
        if guessed is not None and lo < guessed.size < (bracket.hi or guessed.size + 1):
            why = "the traced largest size, calibrated" + (", less the headroom" if guessed.kept else "")
            proposal = Proposal(Move.TRACED, guessed.size, why)
        else:
            proposal, guessed = next_move(bracket, ev, tolerance), None
        move, size = proposal.move, min(max(proposal.size, lo + 1), bracket.top)
        if on_move is not None:
            on_move(Proposal(move, size, proposal.reason))
        if move is Move.EDGE:
            bracket.edge_at = lo
        ok = accepted(run(size), limit_bytes)
        settled = guessed.settle() if move is Move.TRACED and guessed and guessed.settle else guessed
        if settled is not guessed and (settled is None or settled.size < size):
            ok, guessed = False, settled  # the trace's own check took its guess back: the smaller one next
        elif move is Move.TRACED and ok and guessed is not None and guessed.kept:
            return SearchResult(size, tuple(trials.values()), "traced")
        else:
            guessed = None
        if move is Move.EDGE and ok and ev.has_model:
            bracket.refuted = True
        if ok:
            bracket.lo, bracket.lo_move = size, move
        else:
            bracket.hi = size
        bracket.back = bracket.last_size - size if move is Move.STEP_BACK else 0
        bracket.last_move, bracket.last_accepted, bracket.last_size = move, ok, size


def _stop(b: Bracket, ev: Evidence, ran: int, max_trials: int, tolerance: float) -> StopReason | None:
    """Why the search ends now (``None``: it goes on); the one closing rule."""
    if b.lo >= b.top:
        return "bracketed" if b.hi is not None else "upper_bound"
    if b.hi is not None and b.hi - b.lo - 1 <= tolerance * b.lo:
        return "bracketed"
    if ran >= max_trials:
        return "max_trials"
    if b.hi is None and ev.next_one_crosses(ev.trial(b.lo)):
        return "predicted"
    return None


def search_by_plan(run_trial: TrialSource, *, tolerance: float = 0.02, **kwargs: Any) -> SearchResult:
    """:func:`search_batch_size` under the name of the former default (``method="predict"``).

    It closes to 2%.
    """
    return search_batch_size(run_trial, tolerance=tolerance, **kwargs)


class DataEnds(Exception):
    """A trial's batches held fewer samples than its size.

    The data holds no larger batch than ``samples``.
    """

    def __init__(self, samples: int) -> None:
        super().__init__(samples)
        self.samples = samples


def until_data_ends(
    search: Callable[[TrialSource, int], SearchResult], run_trial: TrialSource, upper: int
) -> SearchResult:
    """``search(run, upper)``.

    Where a trial finds the data ending short of its size, search again up to there. Where the loader's
    samples per epoch are not known beforehand (an iterable dataset, a sampler without a length), a size past
    them runs the batch the data can make, not the size: no search may take it for that size. Each size runs
    once across the searches; the result holds every trial in the order they ran.

    >>> def run(bs):  # the data holds 100 samples; 1 GiB + 0.1 GiB a sample
    ...     return Trial(bs, fits=True, peak_bytes=2**30 + min(bs, 100) * 2**30 // 10, samples=min(bs, 100))
    >>> def search(r, u):
    ...     return search_batch_size(r, upper=u, limit_bytes=24 * 2**30)
    >>> until_data_ends(search, run, 4096).batch_size
    100
    """
    ran: dict[int, Trial] = {}

    def run(size: int) -> Trial:
        if size not in ran:
            ran[size] = run_trial(size)
        trial = ran[size]
        if trial.short and trial.samples:  # 0: no batch at all (drop_last), a rejection like any other
            raise DataEnds(trial.samples)
        return trial

    note = ""
    while True:
        try:
            result = search(run, upper)
            break
        except DataEnds as ended:
            upper = min(upper - 1, ended.samples)  # every pass lowers it: the loop ends
            note = f"the data makes batches of {ended.samples} samples at most: searched up to that"
    return replace(result, trials=tuple(ran.values()), note=note or result.note)
