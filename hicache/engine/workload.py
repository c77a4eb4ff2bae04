"""The demo's workload: multi-turn conversations that share a few system prompts.

Each conversation starts from one of ``num_system_prompts`` system prompts; turn ``k``'s
prompt is the previous prompt, the tokens generated for it and ``k``'s new user tokens::

    turn 1   [system][user 1]
    turn 2   [system][user 1][gen 1][user 2]
    turn 3   [system][user 1][gen 1][user 2][gen 2][user 3]

The generated tokens are the model's, so prompts are assembled while the engine runs; the
workload fixes everything else, deterministically from its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of the workload; ``(low, high)`` ranges are inclusive, pages of the config's
    page size.

    Each conversation has ``num_turns - 1`` or ``num_turns`` turns (at least one).
    """

    num_conversations: int = 12
    num_turns: int = 4
    num_system_prompts: int = 3
    system_pages: tuple[int, int] = (2, 4)
    user_pages: tuple[int, int] = (1, 3)
    new_tokens: tuple[int, int] = (8, 16)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "num_system_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_pages", "user_pages", "new_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"workload: {name} must be 1 <= low <= high, got {(low, high)}")


@dataclass(frozen=True)
class Turn:
    """One request: its conversation, its turn number (0-based) and its new user tokens."""

    conversation: int
    index: int
    user_tokens: tuple[int, ...]
    max_new_tokens: int

    @property
    def name(self) -> str:
        return f"conversation {self.conversation} turn {self.index + 1}"


@dataclass(frozen=True)
class Conversation:
    """A system prompt and the turns that follow it."""

    conversation: int
    system_prompt: int
    system_tokens: tuple[int, ...]
    turns: tuple[Turn, ...]

    def max_tokens(self) -> int:
        """Upper bound of the conversation's length in tokens (its last turn complete)."""
        return len(self.system_tokens) + sum(
            len(t.user_tokens) + t.max_new_tokens for t in self.turns)


@dataclass(frozen=True)
class Workload:
    """Conversations, in their order of arrival."""

    conversations: tuple[Conversation, ...]

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def max_tokens(self) -> int:
        return max(c.max_tokens() for c in self.conversations)


def make_workload(spec: WorkloadSpec, page_size: int, vocab_size: int) -> Workload:
    """Draw the workload of ``spec`` (same seed, same workload)."""
    rng = random.Random(spec.seed)

    def tokens(pages: tuple[int, int]) -> tuple[int, ...]:
        count = rng.randint(*pages) * page_size
        return tuple(rng.randrange(vocab_size) for _ in range(count))

    systems = [tokens(spec.system_pages) for _ in range(spec.num_system_prompts)]
    conversations = []
    for c in range(spec.num_conversations):
        system = c % spec.num_system_prompts
        num_turns = max(1, rng.randint(spec.num_turns - 1, spec.num_turns))
        turns = tuple(
            Turn(c, k, tokens(spec.user_pages), rng.randint(*spec.new_tokens))
            for k in range(num_turns)
        )
        conversations.append(Conversation(c, system, systems[system], turns))
    return Workload(tuple(conversations))
