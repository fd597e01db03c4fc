"""Cost-aware draft lengths: a draft token is worth its verification row only where its
chance of being accepted pays for the row.

A request's draft of L tokens yields 1 + P_1 + ... + P_L tokens on average, where P_j is
the chance that its first j tokens are all accepted; the next step costs what a step of
its token count costs. `choose_lengths` keeps, over every request of the step, the draft
tokens that maximise expected tokens per second: it adds them most likely first and
keeps the best prefix of that order.

- StepCosts learns the seconds a decode step takes by its token count, as the runner
  measures them. Where extra rows are nearly free (a GPU, or a CPU step bound by reading
  the weights) drafts stay whole; where they cost (a CPU at a few rows is bound by its
  arithmetic: Zen 4, Q4_1, 7 rows cost 1.5-1.9x one; or many requests at once, where a
  draft row costs about what a request's own token does) only likely tokens are drafted.
  With 16 requests on Zen 4, n-gram speculation drafting by a rule of its tokens alone
  was 5-9% slower than none, on chat and on copying alike (0.96-1.0x with this).
- AcceptanceStats learns the P_j per match length (prompt lookup's longest matching
  suffix: a 2-token match is a weaker cue than a 5-token one) from every verified draft,
  from a prior and with a slow decay, so that it follows the workload.
"""
from __future__ import annotations

import bisect
import heapq

# Prior chances (as pseudo-counts) that the first draft token is accepted and that each
# later one is, given the ones before it were: later tokens continue a match that held.
PRIOR_FIRST, PRIOR_NEXT, PRIOR_WEIGHT = 0.6, 0.8, 4.0
DECAY = 0.995  # per verified draft of the bucket: a half-life of about 140 drafts
MATCH_BUCKETS = 3  # match lengths 1, 2, 3+


class StepCosts:
    """Seconds per decode step by its token count: an exponential average per count,
    interpolated between counts and extended past the largest (never falling)."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._seconds: dict[int, float] = {}
        self._counts: list[int] = []  # sorted keys of _seconds

    def observe(self, tokens: int, seconds: float) -> None:
        old = self._seconds.get(tokens)
        if old is None:
            bisect.insort(self._counts, tokens)
            self._seconds[tokens] = seconds
        else:
            self._seconds[tokens] = old + self.alpha * (seconds - old)

    def cost(self, tokens: int) -> float | None:
        """None before any step was measured."""
        counts, sec = self._counts, self._seconds
        if not counts:
            return None
        if tokens in sec:
            return sec[tokens]
        i = bisect.bisect_left(counts, tokens)
        if i == 0:
            return sec[counts[0]]
        if i == len(counts):  # beyond what was measured: the last slope, or flat
            if len(counts) == 1:
                return sec[counts[-1]]
            a, b = counts[-2], counts[-1]
            slope = max(0.0, (sec[b] - sec[a]) / (b - a))
            return sec[b] + slope * (tokens - b)
        a, b = counts[i - 1], counts[i]
        return sec[a] + (sec[b] - sec[a]) * (tokens - a) / (b - a)


class AcceptanceStats:
    """Per match-length bucket and draft position j: how often position j was reached
    (every earlier draft token accepted) and accepted, decayed."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._reached = [[0.0] * k for _ in range(MATCH_BUCKETS)]
        self._accepted = [[0.0] * k for _ in range(MATCH_BUCKETS)]

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(max(match_len, 1), MATCH_BUCKETS) - 1

    def record(self, bucket: int, drafted: int, accepted: int) -> None:
        reached, acc = self._reached[bucket], self._accepted[bucket]
        for j in range(self.k):
            reached[j] *= DECAY
            acc[j] *= DECAY
        for j in range(min(drafted, accepted + 1, self.k)):
            reached[j] += 1.0
            acc[j] += j < accepted

    def cumulative(self, bucket: int, n: int) -> list[float]:
        """P_1 .. P_n: the chance that the first j draft tokens are all accepted."""
        reached, acc = self._reached[bucket], self._accepted[bucket]
        out, p = [], 1.0
        for j in range(min(n, self.k)):
            prior = PRIOR_FIRST if j == 0 else PRIOR_NEXT
            p *= (acc[j] + PRIOR_WEIGHT * prior) / (reached[j] + PRIOR_WEIGHT)
            out.append(p)
        return out


def choose_lengths(chances: dict[str, list[float]], fixed_tokens: int,
                   costs: StepCosts) -> dict[str, int]:
    """Draft lengths for the requests in `chances` (req_id -> P_1..P_n of its full draft;
    decreasing), next to `fixed_tokens` tokens the step runs anyway (a token per
    request, and drafts not chosen here). Whole drafts while no cost is known yet."""
    base = costs.cost(fixed_tokens)
    if base is None:
        return {rid: len(p) for rid, p in chances.items()}
    expected, tokens = float(fixed_tokens), fixed_tokens
    best = expected / max(base, 1e-9)
    heap = [(-p[0], rid, 0) for rid, p in chances.items() if p]
    heapq.heapify(heap)
    taken: list[str] = []  # the order draft tokens were added in
    keep = 0  # how many of them the best step keeps
    while heap:
        neg_p, rid, j = heapq.heappop(heap)
        expected -= neg_p
        tokens += 1
        taken.append(rid)
        if j + 1 < len(chances[rid]):
            heapq.heappush(heap, (-chances[rid][j + 1], rid, j + 1))
        rate = expected / max(costs.cost(tokens), 1e-9)
        if rate > best:
            best, keep = rate, len(taken)
    lengths = dict.fromkeys(chances, 0)
    for rid in taken[:keep]:
        lengths[rid] += 1
    return lengths
