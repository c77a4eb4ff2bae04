"""The demo's workload (hicache.engine.workload): what a spec draws, and which specs are
refused."""

from __future__ import annotations

import pytest

from hicache.engine.demo import QUICK
from hicache.engine.workload import WorkloadSpec, make_workload

PAGE, VOCAB = 16, 256


@pytest.mark.parametrize("spec", [
    WorkloadSpec(),
    WorkloadSpec(num_conversations=7, num_turns=1, num_system_prompts=2, seed=5),
    WorkloadSpec(num_conversations=9, num_turns=5, system_pages=(3, 3), user_pages=(2, 5),
                 new_tokens=(1, 2), seed=11),
])
def test_a_workload_draws_what_its_spec_says(spec: WorkloadSpec) -> None:
    workload = make_workload(spec, PAGE, VOCAB)
    conversations = workload.conversations
    assert [c.conversation for c in conversations] == list(range(spec.num_conversations))
    systems: dict[int, tuple[int, ...]] = {}
    for c in conversations:
        assert c.system_prompt == c.conversation % spec.num_system_prompts
        assert systems.setdefault(c.system_prompt, c.system_tokens) == c.system_tokens
        assert len(c.system_tokens) % PAGE == 0
        assert spec.system_pages[0] <= len(c.system_tokens) // PAGE <= spec.system_pages[1]
        assert max(1, spec.num_turns - 1) <= len(c.turns) <= spec.num_turns
        assert [(t.conversation, t.index) for t in c.turns] == [
            (c.conversation, k) for k in range(len(c.turns))]
        for turn in c.turns:
            assert len(turn.user_tokens) % PAGE == 0
            assert spec.user_pages[0] <= len(turn.user_tokens) // PAGE <= spec.user_pages[1]
            assert spec.new_tokens[0] <= turn.max_new_tokens <= spec.new_tokens[1]
            assert all(0 <= t < VOCAB for t in turn.user_tokens)
        assert all(0 <= t < VOCAB for t in c.system_tokens)
        assert c.max_tokens() == len(c.system_tokens) + sum(
            len(t.user_tokens) + t.max_new_tokens for t in c.turns)
    assert len(systems) == min(spec.num_system_prompts, spec.num_conversations)
    assert workload.num_turns == sum(len(c.turns) for c in conversations)
    assert workload.max_tokens() == max(c.max_tokens() for c in conversations)


def test_the_seed_fixes_the_workload() -> None:
    spec = WorkloadSpec(seed=3)
    assert make_workload(spec, PAGE, VOCAB) == make_workload(spec, PAGE, VOCAB)
    assert make_workload(spec, PAGE, VOCAB) != make_workload(WorkloadSpec(seed=4), PAGE, VOCAB)


def test_turn_counts_vary_between_the_two_allowed() -> None:
    workload = make_workload(WorkloadSpec(num_conversations=40, num_turns=4), PAGE, VOCAB)
    assert {len(c.turns) for c in workload.conversations} == {3, 4}


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_conversations": 0}, "num_conversations must be >= 1, got 0"),
    ({"num_turns": 0}, "num_turns must be >= 1, got 0"),
    ({"num_system_prompts": -1}, "num_system_prompts must be >= 1, got -1"),
    ({"system_pages": (0, 2)}, r"system_pages must be 1 <= low <= high, got \(0, 2\)"),
    ({"user_pages": (3, 2)}, r"user_pages must be 1 <= low <= high, got \(3, 2\)"),
    ({"new_tokens": (0, 0)}, r"new_tokens must be 1 <= low <= high, got \(0, 0\)"),
])
def test_a_spec_out_of_range_is_refused_naming_the_field(fields: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=rf"workload: {message}"):
        WorkloadSpec(**fields)  # type: ignore[arg-type]


def test_the_smallest_spec_is_allowed() -> None:
    spec = WorkloadSpec(num_conversations=1, num_turns=1, num_system_prompts=1,
                        system_pages=(1, 1), user_pages=(1, 1), new_tokens=(1, 1))
    (conversation,) = make_workload(spec, PAGE, VOCAB).conversations
    assert len(conversation.turns) == 1
    assert conversation.max_tokens() == 2 * PAGE + 1


def test_the_defaults_are_the_ones_the_readme_gives() -> None:
    """``--conversations`` 12 (6 with ``--quick``), ``--turns`` 4 (3 with ``--quick``)."""
    assert (WorkloadSpec().num_conversations, WorkloadSpec().num_turns) == (12, 4)
    assert (QUICK.num_conversations, QUICK.num_turns) == (6, 3)
