"""Acceptance statistics of speculative decoding, counted by the scheduler (vLLM's
definitions): a draft is one request-step that verified at least one draft token;
mean accepted length counts the bonus token, so it is 1 + accepted / drafts."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts whose token i (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0
                for a in self.accepted_per_pos]

    def since(self, before: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted after the snapshot `before` (one workload of a benchmark)."""
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts - before.num_drafts,
                                 self.num_draft_tokens - before.num_draft_tokens,
                                 self.num_accepted_tokens - before.num_accepted_tokens,
                                 [a - b for a, b in zip(self.accepted_per_pos,
                                                        before.accepted_per_pos)])

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts,
                                 self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos))

    def as_dict(self) -> dict[str, object]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 3),
                "per_position_acceptance": [round(x, 4)
                                            for x in self.per_position_acceptance]}
