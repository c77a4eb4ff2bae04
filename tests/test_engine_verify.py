"""The reference engine's token check (hicache.engine.verify.first_token_mismatch): the
first turn, in conversation and turn order, whose tokens differ from the baseline's, named
with the token, or a turn never served, or one of another length."""

from __future__ import annotations

from hicache.engine.verify import first_token_mismatch

BASELINE = {(0, 0): [5, 6, 7], (0, 1): [8, 9], (1, 0): [1, 2, 3]}


def test_matching_turns_report_nothing() -> None:
    assert first_token_mismatch({k: list(v) for k, v in BASELINE.items()}, BASELINE) is None


def test_the_first_differing_token_of_the_first_turn_in_order_is_named() -> None:
    generated = {k: list(v) for k, v in BASELINE.items()}
    generated[(1, 0)][0] = 4  # later conversation
    generated[(0, 1)][1] = 7  # earlier: reported
    assert first_token_mismatch(generated, BASELINE) == \
        "conversation 0 turn 2: token 1 is 7, the baseline generated 9"


def test_a_turn_of_another_length_or_never_served_is_named() -> None:
    shorter = {k: list(v) for k, v in BASELINE.items()}
    shorter[(0, 0)] = [5, 6]
    assert first_token_mismatch(shorter, BASELINE) == \
        "conversation 0 turn 1: 2 tokens generated, the baseline generated 3"
    longer = {k: list(v) for k, v in BASELINE.items()}
    longer[(1, 0)] = [1, 2, 3, 4]
    assert first_token_mismatch(longer, BASELINE) == \
        "conversation 1 turn 1: 4 tokens generated, the baseline generated 3"
    missing = {k: list(v) for k, v in BASELINE.items() if k != (0, 1)}
    assert first_token_mismatch(missing, BASELINE) == "conversation 0 turn 2: never served"
