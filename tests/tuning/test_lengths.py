"""The length scan (``tuning/lengths.py``): what ``length_fn`` may give, and how a bad result is named.

Issue 41: a key a sample lacks raised a raw ``KeyError``, a numpy or tensor NaN or infinity raw errors, and
``np.float64(3.7)`` was taken as 3 while ``3.7`` was refused. Every bad result now names ``length_fn``, the sample's
index and the value; a whole number of any numeric type is taken, anything else refused, as ``TokenBudgetSampler``
does with its ``lengths``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gpumem import TokenBudgetSampler
from lightning_gpumem.tuning.lengths.scan import sample_length, scan_lengths

BAD_INDEX = 5


class Opaque:
    """Neither a number nor a sequence."""

    def __repr__(self) -> str:
        return "Opaque()"


def dataset_with(value: object, size: int = 12) -> list[dict[str, object]]:
    """Samples whose ``"n"`` is their index, but for sample ``BAD_INDEX``, whose ``"n"`` is ``value``."""
    return [{"n": value if i == BAD_INDEX else i} for i in range(size)]


# (what length_fn gives, the error); NaN, infinities and fractions are not whole numbers (TypeError, as a fraction was
# before); negative and too long lengths are whole numbers out of range (ValueError)
BAD = [
    (float("nan"), TypeError),
    (np.float64("nan"), TypeError),
    (torch.tensor(float("nan")), TypeError),
    (float("inf"), TypeError),
    (np.float64("-inf"), TypeError),
    (torch.tensor(float("inf")), TypeError),
    (3.7, TypeError),
    (np.float64(3.7), TypeError),  # was taken as 3
    (np.float32(2.5), TypeError),
    (torch.tensor(3.7), TypeError),  # was taken as 3
    (-1, ValueError),
    (np.int64(-1), ValueError),
    (np.float64(-2.0), ValueError),
    (torch.tensor(-2), ValueError),
    (2**64, ValueError),
    (10**400, ValueError),
    (1e300, ValueError),
    (True, TypeError),
    (np.bool_(True), TypeError),  # was taken as 1
    (torch.tensor(True), TypeError),  # was taken as 1
    ("abc", TypeError),  # was taken as 3, its characters
    (b"abc", TypeError),
    (None, TypeError),
    ({"a": 1}, TypeError),  # was taken as 1, its keys
    (Opaque(), TypeError),
    (1 + 2j, TypeError),
    (np.array("3"), TypeError),
]


def _id(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


@pytest.mark.parametrize(("value", "error"), BAD, ids=[_id(value) for value, _ in BAD])
def test_a_bad_length_is_refused_naming_length_fn_the_sample_and_the_value(value, error):
    with pytest.raises(error) as info:
        scan_lengths(dataset_with(value), "n")
    message = str(info.value)
    assert message.startswith(f"`length_fn='n'` gave {_id(value)[:20]}"), message
    assert f"for sample {BAD_INDEX}" in message, message
    assert "Expected a whole number from 0 to 2**53 (the sample's length), or a sequence" in message, message


def test_every_whole_number_of_any_numeric_type_and_every_sequence_is_taken():
    taken = [
        (3, 3),
        (np.int64(3), 3),
        (np.uint8(3), 3),
        (3.0, 3),  # was refused, while np.float64(3.0) was taken
        (np.float64(3.0), 3),
        (np.float32(3.0), 3),
        (torch.tensor(3), 3),
        (torch.tensor(3.0), 3),
        (np.array(3), 3),
        (0, 0),  # an empty sample
        (2**53, 2**53),  # the longest length a float holds exactly
        ([5, 6, 7], 3),
        ((), 0),
        (torch.ones(4, 2), 4),
        (np.ones(6), 6),
        (torch.tensor([9]), 1),  # a sequence of one token, not the number 9
    ]
    for value, length in taken:
        found = sample_length({"n": value}, "n", index=0)
        assert (found, type(found)) == (length, int), value


def test_the_scan_and_the_token_budget_sampler_agree_on_what_a_length_is():
    for value in (
        3.0,
        np.float64(3.0),
        np.float32(5.0),
        torch.tensor(4.0),
        3.5,
        np.float64(3.7),
        float("nan"),
        -1,
        2**64,
    ):
        try:
            scanned = scan_lengths([{"n": value}], "n").measured[0]
        except (TypeError, ValueError) as error:
            with pytest.raises(type(error)):
                TokenBudgetSampler([value], max_tokens=10**20)
        else:
            assert TokenBudgetSampler([value], max_tokens=10**20).lengths == [scanned], value


def test_a_key_a_sample_lacks_is_named_with_the_sample_and_the_keys_it_has():
    dataset = [{"n": 1}, {"n": 2}, {"input_ids": [1, 2]}]
    expected = r"^`length_fn='n'` found no key 'n' in sample 2 \(type dict, keys 'input_ids'\)"
    with pytest.raises(ValueError, match=expected) as info:
        scan_lengths(dataset, "n")
    assert isinstance(info.value.__cause__, KeyError)


def test_an_attribute_a_sample_lacks_is_named_with_the_sample():
    class Sample:
        def __init__(self, n: int) -> None:
            self.n = n

    dataset = [Sample(1), Sample(2), object()]
    with pytest.raises(
        ValueError, match=r"^`length_fn='n'` found no attribute 'n' on sample 2 \(type object"
    ) as info:
        scan_lengths(dataset, "n")
    assert isinstance(info.value.__cause__, AttributeError)


class Unmeasurable(Exception):
    """The user's own error."""


def test_a_function_that_raises_gives_the_users_own_error_with_a_note_naming_the_sample():
    def count_tokens(sample):
        if sample["n"] == BAD_INDEX:
            raise Unmeasurable("the tokenizer gave up")
        return sample["n"]

    with pytest.raises(Unmeasurable, match="the tokenizer gave up") as info:  # never replaced by one of ours
        scan_lengths(dataset_with(BAD_INDEX), count_tokens)
    assert info.value.__notes__ == [f"(raised by `length_fn=count_tokens` for sample {BAD_INDEX})"]

    def interrupted(sample):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is not a length_fn error: not wrapped
        scan_lengths(dataset_with(0), interrupted)


def test_a_sample_of_unknown_index_is_called_a_sample():
    with pytest.raises(
        TypeError, match=r"^`length_fn=<lambda>` gave nan \(type float\) for a sample: not a whole"
    ):
        sample_length({}, lambda s: float("nan"))


@pytest.mark.parametrize(
    ("value", "error"),
    [(np.timedelta64(5), TypeError), (np.datetime64(5, "D"), TypeError), (range(10**20), ValueError)],
    ids=["timedelta64", "datetime64", "range-past-any-index"],
)
def test_a_time_or_a_sequence_too_long_to_count_is_not_a_length(value, error):
    with pytest.raises(error, match=r"`length_fn='n'` gave .* for sample 7"):
        sample_length({"n": value}, "n", 7)


def test_a_set_of_lengths_has_no_order_and_is_refused():
    from lightning_gpumem import TokenBudgetSampler

    with pytest.raises(TypeError, match=r"TokenBudgetSampler\(lengths=\{3, 5\}\)"):
        TokenBudgetSampler({3, 5}, max_tokens=10)
