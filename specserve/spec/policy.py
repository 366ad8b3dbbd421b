"""Adaptive speculation: how many drafts the next step verifies, chosen from the goodput the engine measures.

Speculation pays when the drafts a verify step accepts save more target steps than the wider verify step and
the draft steps cost. That balance moves with the batch size (a large batch's verify step is compute-bound:
every draft slot costs nearly a full token), the live acceptance rate (traffic changes), and the drafter's cost
next to the target's (on CPU, or for a tiny target, a draft step costs nearly a target step). A fixed
``num_spec_tokens`` is right for one point of that space only; vLLM's ``disable_by_batch_size`` switches
speculation off above one fixed batch size.

``SpecPolicy`` learns instead: for each batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps an exponentially
weighted moving average of goodput, committed tokens per second of step time, for each of a few caps on the
draft length ("arms": no cap, and the engine's 0 = no drafts, 1, and half the server's ``num_spec_tokens``),
measured on the engine's pure decode steps. It picks the best arm of the bucket, tries every arm once when a bucket is
new (the largest first: a cold engine speculates as configured), and probes each other arm now and then, so
that a change in traffic or load is seen: ``probe_every`` decisions after its last try, an interval that doubles
with each probe that finds it clearly worse (so a losing arm costs ever less) and resets when it comes close.
The idea of choosing the draft length from estimated goodput per batch is SmartSpec's (Liu et al., 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput"); this is a model-free,
measured variant of it.

Speculation stays lossless whatever the arm (verification is exact): greedy outputs do not change. Seeded
sampled outputs stay correct in distribution but, because the cap follows timings, are reproducible run to
run only with the policy off.

    policy = SpecPolicy()
    cap = policy.choose(batch_size=48)        # None: every request drafts its own num_spec_tokens; 0: none
    ... run the step ...
    policy.record(batch_size=48, cap=cap, seconds=0.012, tokens=131)
"""

from __future__ import annotations

from dataclasses import dataclass

NO_CAP = -1  # the arm "each request drafts its own num_spec_tokens"


@dataclass
class ArmStats:
    goodput: float | None = None  # EWMA of committed tokens per second
    last_used: int = -1  # decision count when this arm was last chosen
    interval: int = 0  # decisions between probes of this arm while it is not the best
    due: int = 0  # the decision at which it is probed next


class SpecPolicy:
    def __init__(self, caps: tuple[int, ...] = (0, 1, 2), probe_every: int = 32, max_probe_every: int = 1024,
                 smoothing: float = 0.2, margin: float = 0.1) -> None:
        """``caps``: the draft-length caps tried besides "no cap" (0: no drafts). An arm that is not the best is
        probed ``probe_every`` decisions after it was last tried; each probe that measures it more than
        ``margin`` below the best doubles that interval (up to ``max_probe_every``: a clearly worse arm costs
        ever less), and one that measures it within ``margin`` (or above) resets it. ``smoothing``: the weight
        of a new measurement in the moving average."""
        if any(c < 0 for c in caps) or not 2 <= probe_every <= max_probe_every or not 0 < smoothing <= 1 \
                or not 0 <= margin < 1:
            raise ValueError("spec policy: caps must be >= 0, 2 <= probe_every <= max_probe_every, smoothing in "
                             "(0, 1] and margin in [0, 1)")
        self.arms = (NO_CAP, *sorted(set(caps), reverse=True))  # tried in this order when a bucket is new
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.smoothing, self.margin = smoothing, margin
        self.decisions = 0
        self.stats: dict[int, dict[int, ArmStats]] = {}  # bucket -> arm -> stats

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes 1, 2-3, 4-7, 8-15, ... share a bucket (0, 1, 2, 3, ...)."""
        return max(batch_size, 1).bit_length() - 1

    def _arms(self, batch_size: int) -> dict[int, ArmStats]:
        return self.stats.setdefault(self.bucket(batch_size),
                                     {a: ArmStats(interval=self.probe_every) for a in self.arms})

    def choose(self, batch_size: int) -> int | None:
        """The cap on the next step's drafts per request: None (no cap) or an int >= 0."""
        self.decisions += 1
        arms = self._arms(batch_size)
        untried = [a for a in self.arms if arms[a].goodput is None]
        if untried:
            arm = untried[0]
        else:
            best = max(self.arms, key=lambda a: arms[a].goodput)
            due = [a for a in self.arms if a != best and arms[a].due <= self.decisions]
            arm = min(due, key=lambda a: arms[a].due) if due else best
        arms[arm].last_used = self.decisions
        arms[arm].due = self.decisions + arms[arm].interval
        return None if arm == NO_CAP else arm

    def record(self, batch_size: int, cap: int | None, seconds: float, tokens: int) -> None:
        """One pure decode step of ``batch_size`` requests whose drafts were made under ``cap`` committed
        ``tokens`` tokens in ``seconds`` (target forward and verification, plus the drafting that made them)."""
        if seconds <= 0:
            return
        arms = self._arms(batch_size)
        stats = arms.get(NO_CAP if cap is None else cap)
        if stats is None:
            return  # a cap this policy does not try (set by someone else)
        rate = tokens / seconds
        known = [s.goodput for s in arms.values() if s.goodput is not None and s is not stats]
        if known and rate < (1 - self.margin) * max(known):
            stats.interval = min(2 * stats.interval, self.max_probe_every)
        else:
            stats.interval = self.probe_every
        stats.due = stats.last_used + stats.interval
        stats.goodput = rate if stats.goodput is None else stats.goodput + self.smoothing * (rate - stats.goodput)

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Goodput per bucket and arm, for logs and metrics: {"8-15": {"none": 812.0, "0": 903.5, ...}}."""
        return {f"{1 << b}-{(2 << b) - 1}": {("none" if a == NO_CAP else str(a)): s.goodput for a, s in arms.items()}
                for b, arms in sorted(self.stats.items())}
