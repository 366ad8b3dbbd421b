"""Adaptive speculation: how many drafts the next step verifies, chosen from the goodput the engine measures.

Speculation pays when the drafts a verify step accepts save more target steps than the wider verify step and
the draft steps cost. That balance moves with the batch size (a large batch's verify step is compute-bound:
every draft slot costs nearly a full token), the live acceptance rate (traffic changes), and the drafter's cost
next to the target's (on CPU, or for a tiny target, a draft step costs nearly a target step). A fixed
``num_spec_tokens`` is right for one point of that space only; vLLM's ``disable_by_batch_size`` switches
speculation off above one fixed batch size.

``SpecPolicy`` learns instead: for each batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps the goodput, committed
tokens per second of step time, of a few caps on the draft length ("arms": no cap, and the engine's 0 = no drafts, 1,
and half the server's ``num_spec_tokens``), measured on the engine's pure decode steps: what an arm's last ``window``
measured steps were worth in tokens over their time, leaving out steps that took more than ``OUTLIER`` times the
median step (a one-off cost, below). A step's worth is not the tokens it happened to commit: a speculating request
commits 1 to k + 1 tokens a step, so a few steps' tokens are noise. Its requests' draft lengths are priced by an
``AcceptanceModel`` that learns the per-position acceptance rates from the verify outcomes of every drafting step
(whichever its arm and bucket). Times are steady from step to step, so a short window measures an arm's cost well, and
its worth follows the live acceptance. It picks the best arm of the bucket and probes each other arm now and then, so
that a change in traffic or load is seen: ``probe_every`` decisions after its last probe, an interval that doubles
with each probe that does not find it better than the best arm, unless it found it more than ``RISING`` better than
the arm's previous probe did (so a losing arm costs ever less, a tied one too, but one that is catching up is not
left behind: acceptance can climb for hundreds of steps as answers settle, and doubling after every losing probe
held cap 0 long after no cap had overtaken it, 0.932x of the best fixed arm in ``benchmarks/policy_replay.py``'s
replay of MT-Bench at batch 8, 0.979x with the rule; every
switch to or from cap 0 costs a catch-up step that no arm is credited with; on the H200 with SmolLM2 and the trained
head at batch 8 on MT-Bench, "no cap" and cap 0 within 1% of each other, a switch every ~18 steps, probes and
catch-ups, held the policy to 0.82x of plain decoding, stop 28) and resets when one finds it better; that verdict
comes from the probe's own steps, so a probe that finds a losing arm improved has it probed again soon, and those
probes replace its stale steps. A new bucket tries every arm at once: the first bucket of all the largest first (a
cold engine speculates as configured), a later one from the best arm of the nearest measured bucket (``_try_order``: a
batch draining as requests finish lives in a small bucket for a few dozen steps, too briefly to wait for probes, and
its best arm often differs from its neighbour's).

A try or probe keeps its arm for ``probe_steps`` decisions in a row, and an arm's goodput leaves out one-off step
times, because what the engine measures right after a switch is not what the arm yields: the step after drafting
resumes pays for the drafters' catch-up (the engine credits it to no arm), and the first step at a new draft
length or batch bucket may capture a CUDA graph (the engine credits no step that did) or compile a kernel (tens of
milliseconds, once). With one-decision probes and a moving average, a probe of "no cap" after a run of cap-0 steps
was never credited at all, and one capture fixed an arm's goodput far below its worth: on the H200 a policy held
SmolLM2 with the trained EAGLE-3 head at cap 0 while k = 3 decoded 1.4x faster
(``benchmarks/results/train_heads_speed_gpu_run1.json``, stop 26). The median of per-step rates held the same
policy at cap 0 too (``train_heads_speed_gpu_run3.json``): a speculating step's token count is skewed, its median
below its mean. Summing the tokens of the last eight steps (stop 26) was unbiased but noisy, and a losing arm
is probed ever less, so an arm that lost on unlucky steps kept its low figure: the H200 run of stop 27 held the
trained head at cap 0 or 1 while a fixed k = 3 decoded 1.3-1.6x faster than plain (hence the acceptance
model). The engine also credits no step whose drafts were made while a prompt chunk was taken in (an EAGLE
head's prefill over new prompts). ``probe_steps`` 2 (one
credited step after a switch from cap 0) explored cheapest on CPU, where plain decoding is the best arm at batch
8: 0.89x of plain against 0.87x at 3 and 0.85x at 4, a fixed k = 3 0.65x (``benchmarks/policy_cpu.py``,
``benchmarks/results/policy_cpu.json``).
The idea of choosing the draft length from estimated goodput per batch is SmartSpec's (Liu et al., 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput"), as is pricing a draft
length with an acceptance rate learned from recent verify outcomes; here a step's cost is measured per arm and
batch bucket, not modelled.

Speculation stays lossless whatever the arm (verification is exact): greedy outputs do not change. Seeded
sampled outputs stay correct in distribution but, because the cap follows timings, are reproducible run to
run only with the policy off.

    policy = SpecPolicy()
    cap = policy.choose(batch_size=48)        # None: every request drafts its own num_spec_tokens; 0: none
    ... run the step ...
    policy.record(batch_size=48, cap=cap, seconds=0.012, tokens=131, outcomes=[(3, 2), (3, 0), ...])
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.config import MAX_NUM_SPEC_TOKENS

NO_CAP = -1  # the arm "each request drafts its own num_spec_tokens"
OUTLIER = 3.0  # a step this many times slower than the arm's median step paid a one-off cost: not counted
RISING = 0.05  # a probe this much above the arm's previous one: it is catching up, the interval does not double
PRIOR_WEIGHT = 4.0  # outcomes' worth of the long-run acceptance in the recent estimate (AcceptanceModel)


class AcceptanceModel:
    """How many tokens a request verifying L drafts commits on average, from the verify outcomes of recent
    drafting steps, shrunk toward the acceptance of many more.

    Per draft position i it estimates alpha_i, the share of drafts that reached position i (drafts 1..i-1
    accepted) and were accepted; a request verifying L drafts then commits ``expected(L)`` = 1 + alpha_1 +
    alpha_1 alpha_2 + ... + alpha_1...alpha_L tokens (the accepted prefix plus the bonus or recovered token).
    Two tallies of (reached, accepted) per position are kept (at batches of 16 and more the "long" one holds fewer
    outcomes than the recent one, whose weight then dwarfs the prior's anyway):

    - the long one, over the last ``long_horizon`` or so outcomes (each outcome's weight decays by
      1 - 1/long_horizon per later outcome), gives p_i = (accepted + 1) / (reached + 2): a weak prior (one
      accepted, one rejected) where outcomes are few;
    - the recent one, over the last ``horizon`` or so policy decisions (``age``: each outcome's weight decays by
      1 - 1/horizon per decision, whether outcomes arrive or not), gives alpha_i = (accepted + W p_i) /
      (reached + W) with W = ``PRIOR_WEIGHT`` outcomes.

    Worked example, no aging yet: outcomes (3 drafts, 1 accepted) and (3, 3) -> position 1 reached twice, accepted
    twice; 2: reached twice, accepted once; 3: reached once, accepted once. p = (3/4, 2/4, 2/3), and alpha =
    ((2 + 3) / 6, (1 + 2) / 6, (1 + 8/3) / 5) = (5/6, 1/2, 11/15), expected(3) = 1 + .833 + .417 + .306 = 2.556.

    The policy prices an arm's steps with it instead of the tokens they happened to commit: a speculating step
    commits 1 to k + 1 tokens per request, so a handful of steps' tokens is noise (on the H200, the trained
    SmolLM2 head at k = 3 commits 1 to 4 per step, 2.43 on average; eight steps of it ranged from 1.6 to 3.1),
    while the outcomes of every drafting step, whichever its arm and batch, tell the same acceptance rates.

    Why two: while the policy holds cap 0 no outcome arrives, and acceptance drifts meanwhile (answers are drafted
    worse at their start: on the H200, MT-Bench at batch 8, k = 3 committed 12-17 tokens a step over the first 40
    steps and 24-27 after 200, stop 28), so the next probe's outcomes must count for more than those of long ago.
    With one tally aged by outcomes (a horizon of 512), a probe of "no cap" was judged by its first steps'
    acceptance and held cap 0 while no cap was 1.3-1.6x better; in simulations of such a rise
    (``tests/unit/test_spec_policy.py``) a run fell to 0.85x of the best arm. Aging by decisions alone forgets
    toward the 1-in-2 prior instead, and a batch-1 probe brings one or two outcomes: on the H200 (MT-Bench at
    concurrency 1, stop 29) that policy spent 2,213 of 2,454 decisions at cap 0 and priced "no cap" at 979 tok/s
    while a fixed k = 3 ran 1,107 (0.96x of plain against 1.06x), as a prior of expected(3) = 1.875 against a
    measured 2.43 would. Shrunk toward the long tally, a stale recent tally falls back to the acceptance seen
    over the long run, and a probe's outcomes move it as far as their number warrants."""

    def __init__(self, horizon: int = 128, long_horizon: int = 2048, max_drafts: int = MAX_NUM_SPEC_TOKENS) -> None:
        self.decay, self.long_decay = 1.0 - 1.0 / horizon, 1.0 - 1.0 / long_horizon
        self.reached = [0.0] * (max_drafts + 1)  # [i]: recent weight of outcomes whose drafts reached position i
        self.accepted = [0.0] * (max_drafts + 1)  # [i]: ... whose draft i was accepted
        self.long_reached = [0.0] * (max_drafts + 1)  # the same, aged by outcomes over long_horizon
        self.long_accepted = [0.0] * (max_drafts + 1)
        self.top = 0  # the farthest position any outcome reached: every tally above it is zero (loops stop there)
        self._expected: list[float] | None = None  # expected(L) for L <= top, rebuilt after new outcomes or aging
        self._chain = 1.0  # alpha_1 ... alpha_top, the table's last term
        self.version = 0  # bumped by every change (arms' cached goodputs compare it)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """``outcomes``: (drafts verified, drafts accepted) of each request that verified drafts in one step."""
        size = len(self.reached)
        last = size - 1
        ends, hits = [0] * (size + 1), [0] * (size + 1)  # histograms of the last reached / accepted position
        count = longest = 0
        for n, a in outcomes:  # one pass (it runs every step, over every drafting request)
            if n > 0:
                ends[min(a + 1, n, last)] += 1
                hits[min(a, last)] += 1
                count += 1
                longest = max(longest, n)
        if not count:
            return
        self.top = max(self.top, min(longest, last))
        keep = self.long_decay ** count
        reached = accepted = 0
        for i in range(self.top, 0, -1):  # suffix sums: position i is reached by every outcome ending at >= i
            reached, accepted = reached + ends[i], accepted + hits[i]
            self.reached[i] += reached
            self.accepted[i] += accepted
            self.long_reached[i] = self.long_reached[i] * keep + reached
            self.long_accepted[i] = self.long_accepted[i] * keep + accepted
        self._expected = None
        self.version += 1

    def age(self) -> None:
        """One policy decision has passed: every outcome's recent weight decays by 1 - 1/horizon (skipped once
        the weights are negligible, so a policy that never drafts does no work)."""
        if self.reached[1] > 1e-3:
            end, d = self.top + 1, self.decay
            self.reached[:end] = [w * d for w in self.reached[:end]]
            self.accepted[:end] = [w * d for w in self.accepted[:end]]
            self._expected = None
            self.version += 1

    def alpha(self, position: int) -> float:
        """The estimated acceptance rate of draft ``position`` (1-based) once the drafts before it were accepted."""
        prior = (self.long_accepted[position] + 1.0) / (self.long_reached[position] + 2.0)
        return (self.accepted[position] + PRIOR_WEIGHT * prior) / (self.reached[position] + PRIOR_WEIGHT)

    def expected(self, num_drafts: int) -> float:
        """Tokens a request verifying ``num_drafts`` drafts commits on average."""
        if self._expected is None:
            table, chain = [1.0], 1.0
            for i in range(1, self.top + 1):
                chain *= self.alpha(i)
                table.append(table[-1] + chain)
            self._expected, self._chain = table, chain
        table = self._expected
        if num_drafts < len(table):
            return table[num_drafts]
        # positions past ``top`` hold no outcome: their rate is the prior's (1 + 0) / (0 + 2) = 1/2
        total, chain = table[-1], self._chain
        for _ in range(min(num_drafts, len(self.reached) - 1) - self.top):
            chain *= 0.5
            total += chain
        return total


@dataclass(frozen=True)
class Step:
    """One measured decode step of an arm: its time; the tokens committed by requests that verified no drafts
    (exact); and how many requests verified 1, 2, ... drafts (``drafted[L]``, L >= 1), whose tokens the
    acceptance model prices (their own count is noise). Without outcomes (``drafted`` empty) ``tokens`` is
    every token the step committed."""

    seconds: float
    tokens: int
    drafted: tuple[int, ...] = ()


def kept_totals(steps: list[Step]) -> tuple[int, float, list[int]]:
    """What ``rate`` sums over ``steps`` once the slow ones are left out: (exact tokens, seconds, drafted[L]
    summed). It does not depend on the acceptance model, so an arm caches it until its next step."""
    times = sorted(s.seconds for s in steps)
    mid = len(times) // 2
    typical = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2  # the median
    tokens, seconds, drafted = 0, 0.0, [0] * max(len(s.drafted) for s in steps)
    for s in steps:
        if s.seconds <= OUTLIER * typical:
            tokens += s.tokens
            seconds += s.seconds
            for length, n in enumerate(s.drafted):
                drafted[length] += n
    return tokens, seconds, drafted


def priced(totals: tuple[int, float, list[int]], model: AcceptanceModel) -> float:
    """Tokens per second of ``kept_totals``, the drafting requests' tokens priced by ``model``."""
    tokens, seconds, drafted = totals
    return (tokens + sum(n * model.expected(length) for length, n in enumerate(drafted) if n)) / seconds


def rate(steps: list[Step], model: AcceptanceModel) -> float | None:
    """Tokens per second over ``steps``, those over OUTLIER x the median step time left out (None: no steps).
    Example (no outcomes, so exact tokens): steps (1.0 s, 1 token), (1.0, 4), (1.1, 4), (9.0, 4) -> median 1.05
    s, the 9 s step left out, 9 tokens / 3.1 s."""
    return priced(kept_totals(steps), model) if steps else None


@dataclass
class ArmStats:
    model: AcceptanceModel  # the policy's, shared by all arms
    samples: deque = field(default_factory=deque)  # Steps: the last ``window`` measured steps
    interval: int = 0  # decisions between probes of this arm while it is not the best
    due: int = 0  # the decision at which it is probed next
    recorded: int = 0  # steps measured so far
    probe_from: int = 0  # ``recorded`` when its latest probe began
    probe_began: int = 0  # the decision its latest probe began at
    last_probe: float | None = None  # what its latest judged probe measured
    _cache: tuple[int, int, float | None] = (-1, -1, None)  # (recorded, model version, goodput)
    _totals: tuple[int, float, list[int]] | None = None  # kept_totals of the window at _cache's ``recorded``

    def add(self, step: Step) -> None:
        self.samples.append(step)
        self.recorded += 1

    @property
    def goodput(self) -> float | None:
        """``rate`` over its window (None: never measured), read on every decision: the window's totals are
        summed again only after a new step, and priced again (a few multiplications) after new outcomes or the
        acceptance model's aging, that is on most decisions."""
        if not self.samples:
            return None
        recorded, version, value = self._cache
        if recorded != self.recorded:
            self._totals = kept_totals(list(self.samples))
        if recorded != self.recorded or version != self.model.version:
            value = priced(self._totals, self.model)
            self._cache = (self.recorded, self.model.version, value)
        return value

    def probe_goodput(self) -> float | None:
        """``rate`` over the steps its latest probe measured (None: none)."""
        n = min(self.recorded - self.probe_from, len(self.samples))
        return rate(list(self.samples)[-n:], self.model) if n > 0 else None


def _best(values: dict[int, float | None]) -> int:
    """The arm of the highest measured goodput (the first in order on a tie)."""
    return max((a for a, v in values.items() if v is not None), key=values.__getitem__)


class SpecPolicy:
    def __init__(self, caps: tuple[int, ...] = (0, 1, 2), probe_every: int = 32, max_probe_every: int = 1024,
                 window: int = 8, probe_steps: int = 2, rising: float = RISING) -> None:
        """``caps``: the draft-length caps tried besides "no cap" (0: no drafts). An arm that is not the best is
        probed ``probe_every`` decisions after its last probe began, for ``probe_steps`` decisions in a row;
        each probe that finds it below the best arm doubles that interval (up to ``max_probe_every``: a worse or
        tied arm costs ever less), and one that finds it better resets it. ``window``: the measured steps per arm
        its goodput is taken over. ``rising``: a losing arm's probe that measures more than 1 + ``rising`` times its
        previous probe keeps the interval instead of doubling it (``RISING``)."""
        if any(c < 0 for c in caps) or not 2 <= probe_every <= max_probe_every or window < 1 \
                or not 1 <= probe_steps < probe_every:
            raise ValueError("spec policy: caps must be >= 0, 2 <= probe_every <= max_probe_every, window >= 1 "
                             "and 1 <= probe_steps < probe_every")
        self.arms = (NO_CAP, *sorted(set(caps), reverse=True))  # the first bucket tries them in this order
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.window, self.probe_steps, self.rising = window, probe_steps, rising
        self.decisions = 0
        self.stats: dict[int, dict[int, ArmStats]] = {}  # bucket -> arm -> stats
        self._probes: dict[int, tuple[int, int]] = {}  # bucket -> (arm being tried or probed, decisions left)
        self._order: dict[int, tuple[int, ...]] = {}  # bucket -> the order its arms are tried in (_try_order)
        self._verdicts: dict[int, int] = {}  # bucket -> the arm whose probe just ended, judged next decision
        self.acceptance = AcceptanceModel()  # prices every arm's drafting steps (all buckets share it)

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch sizes 1, 2-3, 4-7, 8-15, ... share a bucket (0, 1, 2, 3, ...)."""
        return max(batch_size, 1).bit_length() - 1

    def _arms(self, batch_size: int) -> dict[int, ArmStats]:
        bucket = self.bucket(batch_size)
        if bucket not in self.stats:
            self.stats[bucket] = {a: ArmStats(self.acceptance, deque(maxlen=self.window), interval=self.probe_every)
                                  for a in self.arms}
            self._order[bucket] = self._try_order(bucket)
        return self.stats[bucket]

    def _try_order(self, bucket: int) -> tuple[int, ...]:
        """The order in which a new bucket tries its arms, ``probe_steps`` decisions each, before it settles on
        the best: the first bucket of all the largest first; a later one from the best arm of the nearest
        measured bucket (the smaller on a tie), then the rest. Every arm is tried at once, not one neighbour's
        best held for ``probe_every`` decisions: batch sizes drift through small buckets briefly (a batch drains
        as requests finish), and the neighbour's best often differs there. On the H200 (SmolLM2, trained head,
        GSM8K at concurrency 8, stop 29), buckets 2-3 and 1-1 took cap 0 from bucket 4-7, where the arms were
        within 1%, and kept it through their 28 and 13 decisions, while "no cap" was 1.4x and 1.6x cap 0's
        goodput there. The tries cost a few slow steps once per bucket."""
        known = [b for b, arms in self.stats.items() if b != bucket and any(s.goodput is not None
                                                                          for s in arms.values())]
        if not known:
            return self.arms
        start = self._best(self.stats[min(known, key=lambda b: (abs(b - bucket), b))])
        return (start, *(a for a in self.arms if a != start))

    def choose(self, batch_size: int) -> int | None:
        """The cap on the next step's drafts per request: None (no cap) or an int >= 0."""
        self.decisions += 1
        self.acceptance.age()
        bucket, arms = self.bucket(batch_size), self._arms(batch_size)
        if bucket in self._verdicts:
            self._judge(arms, self._verdicts.pop(bucket))
        arm = self._continue_probe(bucket, arms)
        if arm is None:
            values = {a: s.goodput for a, s in arms.items()}  # each arm priced once a decision
            untried = [a for a in self._order[bucket] if values[a] is None]
            # an unmeasured arm is tried; a try the engine credited nothing is repeated when its interval is up
            trying = [a for a in untried if arms[a].due <= self.decisions]
            if trying:
                arm = best = trying[0]
            elif len(untried) == len(self.arms):  # nothing measured yet, no try due: the first arm, held
                arm = best = self._order[bucket][0]
            else:  # the best arm, or an arm due for a probe
                best = _best(values)
                due = [a for a in self.arms if a != best and arms[a].due <= self.decisions]
                arm = min(due, key=lambda a: arms[a].due) if due else best
            if trying or arm != best:  # a try or a probe: this arm for probe_steps decisions
                self._probes[bucket] = (arm, self.probe_steps - 1)
                arms[arm].due = self.decisions + arms[arm].interval
                arms[arm].probe_from, arms[arm].probe_began = arms[arm].recorded, self.decisions
        return None if arm == NO_CAP else arm

    def _continue_probe(self, bucket: int, arms: dict[int, ArmStats]) -> int | None:
        """The arm of this bucket's probe while it has decisions left; None when no probe runs. A probe that
        ends is judged at the bucket's next decision (``_judge``): the engine records a step's goodput after it
        asks for the next cap (the step verifies the drafts of the decision before), so the probe's last step
        is only measured then."""
        if bucket not in self._probes:
            return None
        arm, left = self._probes[bucket]
        if left > 0:
            self._probes[bucket] = (arm, left - 1)
            return arm
        del self._probes[bucket]
        self._verdicts[bucket] = arm
        return None

    def _judge(self, arms: dict[int, ArmStats], arm: int) -> None:
        """Schedule ``arm``'s next probe from what its last probe measured (not its older steps: a probe that
        finds a losing arm improved has it probed again soon, and those probes replace its stale steps)."""
        stats = arms[arm]
        seen = stats.probe_goodput()
        others = [s.goodput for a, s in arms.items() if a != arm and s.goodput is not None]
        if seen is None and stats.goodput is not None:
            pass  # the engine credited none of its steps (one-off costs): no news, the interval stays
        elif seen is not None and others and seen < max(others):
            rising = stats.last_probe is not None and seen > stats.last_probe * (1.0 + self.rising)
            stats.interval = stats.interval if rising else min(2 * stats.interval, self.max_probe_every)
        else:
            stats.interval = self.probe_every
        if seen is not None:
            stats.last_probe = seen
        stats.due = stats.probe_began + stats.interval

    def _best(self, arms: dict[int, ArmStats]) -> int:
        return _best({a: s.goodput for a, s in arms.items()})

    def record(self, batch_size: int, cap: int | None, seconds: float, tokens: int,
               outcomes: list[tuple[int, int]] | None = None) -> None:
        """One pure decode step of ``batch_size`` requests whose drafts were made under ``cap`` committed
        ``tokens`` tokens in ``seconds`` (target forward and verification, plus the drafting that made them).
        ``outcomes``: (drafts verified, drafts accepted) of each request that verified drafts; with them the
        step's worth is priced by the acceptance model (``Step``), without them (None) it is ``tokens``."""
        if outcomes is not None:
            self.observe(outcomes)
        if seconds <= 0:
            return
        stats = self._arms(batch_size).get(NO_CAP if cap is None else cap)
        if stats is None:  # a cap this policy does not try (set by someone else)
            return
        if outcomes is None:
            stats.add(Step(seconds, tokens))
            return
        # observe (above) raised the model's top to every n here (n <= MAX_NUM_SPEC_TOKENS); zeros past the
        # longest n this step are harmless (kept_totals sums by length, priced skips zero counts)
        drafted, committed = [0] * (self.acceptance.top + 1), 0
        for n, a in outcomes:
            if n > 0:
                drafted[n] += 1
                committed += a + 1  # the drafting requests' own (noisy) tokens
        stats.add(Step(seconds, max(tokens - committed, 0), tuple(drafted)))

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """Verify outcomes of a step the engine does not credit to an arm (a one-off cost in it): they still
        teach the acceptance model."""
        self.acceptance.observe(outcomes)

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Goodput per bucket and arm, for logs and metrics: {"8-15": {"none": 812.0, "0": 903.5, ...}}."""
        return {f"{1 << b}-{(2 << b) - 1}": {("none" if a == NO_CAP else str(a)): s.goodput for a, s in arms.items()}
                for b, arms in sorted(self.stats.items())}
