"""The verifier on synthetic logits: greedy acceptance rules, ragged batches, the output distribution of chain
rejection sampling at temperature 0.8 / top-p 0.9 against the target's own distribution, and, for one-hot
drafts, the position-coupled form: the tokens plain sampling draws, whatever the drafts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.layers.sampler import TokenUniforms, draw_tokens, sample, target_probs
from specserve.sampling import SamplingParams
from specserve.spec.verify import verify

GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=0.8, top_p=0.9)


def logits_with_argmax(argmaxes: list[int], vocab: int = 11) -> torch.Tensor:
    """[len(argmaxes), vocab] rows whose argmax is the given token."""
    rows = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return rows


def run_greedy(rows: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
    logits = logits_with_argmax([t for r in rows for t in r])
    starts = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
    return verify(logits, starts, drafts, [None] * len(rows), [GREEDY] * len(rows), [None] * len(rows),
                  TokenUniforms(0))


def test_greedy_perfect_match_emits_all_drafts_and_the_bonus_token() -> None:
    assert run_greedy([[4, 5, 6, 7]], [[4, 5, 6]]) == [[4, 5, 6, 7]]


def test_greedy_early_mismatch_emits_the_recovered_token_and_stops() -> None:
    assert run_greedy([[4, 9, 6, 7]], [[4, 5, 6]]) == [[4, 9]]
    assert run_greedy([[3, 5, 6, 7]], [[4, 5, 6]]) == [[3]]


def test_empty_draft_is_plain_decoding() -> None:
    assert run_greedy([[8]], [[]]) == [[8]]


def test_ragged_batch_keeps_requests_apart() -> None:
    rows = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [2, 2]]
    drafts = [[1, 2], [], [5, 6, 0, 8, 9], [3]]
    assert run_greedy(rows, drafts) == [[1, 2, 3], [4], [5, 6, 7], [2]]


def test_random_row_with_one_hot_draft_never_emits_a_token_outside_top_p() -> None:
    vocab = 6
    logits = torch.tensor([[4.0, 3.9, -5.0, -5.0, -5.0, -5.0]] * 3)  # top-p keeps tokens 0 and 1 only
    stream = TokenUniforms(0)
    seen = set()
    for _ in range(200):
        out = verify(logits, [0], [[5, 0]], [None], [HOT], [None], stream)[0]
        assert out[0] in (0, 1), "a draft outside the nucleus has target probability 0 and must be rejected"
        seen.update(out)
    assert seen <= {0, 1} and len(seen) == 2 and vocab == logits.shape[1]


def test_seeded_requests_are_reproducible() -> None:
    logits = torch.randn(4, 13, generator=torch.Generator().manual_seed(3))
    outs = []
    for _ in range(2):
        stream = TokenUniforms(42)
        outs.append([verify(logits, [0], [[1, 2, 3]], [None], [HOT], [stream], TokenUniforms())[0]
                     for _ in range(20)])
    assert outs[0] == outs[1]


# ---- distribution: chain rejection sampling is lossless -----------------------------------------------------
VOCAB = 8


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def tv_bound(num_samples: int) -> float:
    """About 2.5x the expected TV distance of an empirical distribution of ``num_samples`` draws over VOCAB
    categories from the truth; it shrinks as 1 / sqrt(num_samples)."""
    return (VOCAB / num_samples) ** 0.5


def sample_verified(target_logits: torch.Tensor, draft_probs: torch.Tensor, num_samples: int, seed: int):
    """Run the verifier ``num_samples`` times with drafts drawn from ``draft_probs``; returns the counts of the
    first emitted token, and of the second one among samples that emitted at least two."""
    gen = torch.Generator().manual_seed(seed)  # the drafts
    stream = TokenUniforms(seed)  # the verifier's draws
    num_draft = draft_probs.shape[0]
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    batch = 500
    for _ in range(num_samples // batch):
        drafts = torch.multinomial(draft_probs, batch, replacement=True, generator=gen).T.tolist()  # [batch, k]
        logits = target_logits.repeat(batch, 1)  # [batch * (k + 1), vocab]
        starts = [i * (num_draft + 1) for i in range(batch)]
        outs = verify(logits, starts, drafts, [draft_probs] * batch, [HOT] * batch, [None] * batch, stream)
        for out in outs:
            first[out[0]] += 1
            if len(out) > 1:
                second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_verified_tokens_follow_the_target_distribution(draft_kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(3, VOCAB, generator=gen) * 2.0  # rows for positions 1, 2 and the bonus
    target = target_probs(target_logits, [HOT] * 3)
    if draft_kind == "close":
        draft_logits = target_logits[:2] / HOT.temperature + 0.3 * torch.randn(2, VOCAB, generator=gen)
    else:
        draft_logits = -target_logits[:2]  # most mass where the target has least
    draft = draft_logits.softmax(dim=-1)
    num_samples = 20_000
    first, second = sample_verified(target_logits, draft, num_samples, seed=1)
    bound = tv_bound(num_samples)
    assert total_variation(first, target[0]) < bound
    assert total_variation(second, target[1]) < tv_bound(int(second.sum()))
    # The test has power: passing the drafts through unverified would fail it.
    assert 0.5 * float((draft[0] - target[0]).abs().sum()) > 3 * bound
    # Top-p removed some tokens from the target; the verifier must never emit them.
    assert all(first[target[0] == 0] == 0)


def test_tv_bound_shrinks_with_samples() -> None:
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(3, VOCAB, generator=gen)
    draft = torch.full((2, VOCAB), 1.0 / VOCAB)
    target = target_probs(target_logits, [HOT] * 3)
    small, _ = sample_verified(target_logits, draft, 1_000, seed=2)
    large, _ = sample_verified(target_logits, draft, 40_000, seed=3)
    assert total_variation(small, target[0]) < tv_bound(1_000)
    assert total_variation(large, target[0]) < tv_bound(40_000) < tv_bound(1_000) / 5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kinds=st.lists(st.sampled_from(["none", "one_hot", "probs", "greedy"]),
                                                      min_size=1, max_size=6),
       lengths=st.lists(st.integers(1, 4), min_size=6, max_size=6))
def test_a_batch_verifies_each_request_as_if_it_were_alone(seed, kinds, lengths) -> None:
    """Requests verified together (sampled with and without drafts, one-hot and sampled drafts, greedy) emit
    what each emits alone with the same stream: a request's draws depend on its own stream only."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 13
    drafts, draft_probs, params = [], [], []
    for kind, n in zip(kinds, lengths):
        n = 0 if kind == "none" else n
        dp = torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1) if kind == "probs" else None
        ids = (torch.multinomial(dp, 1, generator=gen).squeeze(1).tolist() if dp is not None
               else torch.randint(0, vocab, (n,), generator=gen).tolist())
        drafts.append(ids)
        draft_probs.append(dp)
        params.append(GREEDY if kind == "greedy" else HOT)
    sizes = [len(d) + 1 for d in drafts]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    # target logits close to the drafts' so that some drafts are accepted and some rejected
    logits = torch.randn(sum(sizes), vocab, generator=gen)
    for i, d in enumerate(drafts):
        for j, t in enumerate(d):
            logits[starts[i] + j, t] += float(torch.rand((), generator=gen)) * 4
    streams = [TokenUniforms(seed + i) for i in range(len(drafts))]
    together = verify(logits, starts, drafts, draft_probs, params, streams, TokenUniforms(0))
    alone = [verify(logits[starts[i]:starts[i] + sizes[i]], [0], [drafts[i]], [draft_probs[i]], [params[i]],
                    [TokenUniforms(seed + i)], TokenUniforms(0))[0] for i in range(len(drafts))]
    assert together == alone
    for d, out in zip(drafts, together):
        assert 1 <= len(out) <= len(d) + 1 and out[:-1] == d[:len(out) - 1]


def chain_oracle(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                 params: SamplingParams, stream: TokenUniforms) -> list[int]:
    """One request's verification written out step by step on the host (the rules of the module docstring):
    ``logits`` [len(drafts) + 1, vocab], ``draft_probs`` [len(drafts), vocab] (the chain) or None (one-hot
    drafts, or none: the position-coupled form, one row drawn at a time)."""
    probs = target_probs(logits, [params] * logits.shape[0])
    if draft_probs is None or not drafts:
        out = []
        for j in range(len(drafts) + 1):
            y = int(draw_tokens(probs[j:j + 1], [stream.random()])[0])
            out.append(y)
            if j == len(drafts) or y != drafts[j]:
                return out
    us = [stream.random() for _ in range(len(drafts) + 1)]
    n = 0
    while n < len(drafts):
        p = float(probs[n, drafts[n]])
        q = 1.0 if draft_probs is None else float(draft_probs[n, drafts[n]].to(probs.dtype))
        if not us[n] * q < p:
            break
        n += 1
    final = probs[n].clone()
    if n < len(drafts):
        if draft_probs is None:
            final[drafts[n]] = 0.0
        else:
            final = (final - draft_probs[n].to(final.dtype)).clamp_min(0.0)
    if float(final.sum()) <= 0:
        final = probs[n]
    return drafts[:n] + [int(draw_tokens(final[None], [us[len(drafts)]])[0])]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kinds=st.lists(st.sampled_from(["none", "one_hot", "probs"]),
                                                      min_size=1, max_size=7),
       lengths=st.lists(st.integers(1, 5), min_size=7, max_size=7), near=st.floats(0.0, 6.0))
def test_the_batched_device_test_draws_what_the_step_by_step_chain_draws(seed, kinds, lengths, near) -> None:
    """verify (batched: p and q of every draft come back in one read, every final row is drawn in one call)
    emits exactly the tokens of the rule applied request by request with the same streams: the same accepted
    prefix, the same residual, the same draw, for one-hot and sampled drafters, ragged lengths and requests
    without drafts (``near``: how strongly the target favours the drafts, from all-rejected to mostly
    accepted)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 17
    drafts, draft_probs = [], []
    for kind, n in zip(kinds, lengths):
        n = 0 if kind == "none" else n
        dp = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1) if kind == "probs" else None
        drafts.append(torch.multinomial(dp, 1, generator=gen).squeeze(1).tolist() if dp is not None
                      else torch.randint(0, vocab, (n,), generator=gen).tolist())
        draft_probs.append(dp)
    sizes = [len(d) + 1 for d in drafts]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    logits = torch.randn(sum(sizes), vocab, generator=gen)
    for i, d in enumerate(drafts):
        for j, t in enumerate(d):
            logits[starts[i] + j, t] += near * float(torch.rand((), generator=gen))
    params = [HOT if i % 2 else SamplingParams(temperature=1.3) for i in range(len(drafts))]
    got = verify(logits, starts, drafts, draft_probs, params, [TokenUniforms(seed + i) for i in range(len(drafts))],
                 TokenUniforms(0))
    want = [chain_oracle(logits[starts[i]:starts[i] + sizes[i]], drafts[i], draft_probs[i], params[i],
                         TokenUniforms(seed + i)) for i in range(len(drafts))]
    assert got == want


def plain_then_speculative(seed: int, vocab: int, length: int, plan: list[tuple[int, float]]):
    """A toy target whose logits are a fixed function of the last two tokens; sampled output of ``length``
    tokens from one stream plainly (one draw a step), then speculatively from a fresh stream of the same seed,
    each step proposing ``k`` one-hot drafts that copy the plain output with probability ``right`` per draft
    (else a random token): ``plan`` gives (k, right) per step, cycled."""
    table = torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2.5

    def logits_after(prefix: list[int]) -> torch.Tensor:  # [vocab]
        return table[prefix[-2], prefix[-1]]

    params = SamplingParams(temperature=0.9, top_k=[0, 6][seed % 2], top_p=[1.0, 0.85][seed % 3 == 0])
    stream, plain = TokenUniforms(seed), [1, 2]
    while len(plain) < length + 2:
        plain += sample(logits_after(plain)[None], [params], [stream], TokenUniforms(0))
    gen = torch.Generator().manual_seed(seed + 1)
    stream, spec, step = TokenUniforms(seed), [1, 2], 0
    while len(spec) < length + 2:
        k, right = plan[step % len(plan)]
        step += 1
        drafts = []
        for j in range(k):
            at = len(spec) + j
            good = at < len(plain) and float(torch.rand((), generator=gen)) < right
            drafts.append(plain[at] if good else int(torch.randint(0, vocab, (), generator=gen)))
        rows = torch.stack([logits_after(spec + drafts[:j]) for j in range(k + 1)])  # [k + 1, vocab]
        spec += verify(rows, [0], [drafts], [None], [params], [stream], TokenUniforms(0))[0]
    return plain[2:length + 2], spec[2:length + 2]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), plan=st.lists(st.tuples(st.integers(0, 6), st.floats(0.0, 1.0)),
                                                     min_size=1, max_size=5))
def test_one_hot_drafts_emit_the_tokens_plain_sampling_draws(seed, plan) -> None:
    """Seeded sampled output is the same token for token with or without speculation, whatever the drafts
    (right, wrong, outside top-k / top-p) and however many a step (0 to 6, changing from step to step, as an
    adaptive cap does)."""
    plain, spec = plain_then_speculative(seed, vocab=12, length=40, plan=plan)
    assert spec == plain


def test_one_hot_drafts_are_accepted_with_the_target_probability() -> None:
    """The coupled form accepts a one-hot draft with probability p(x), as the chain's ``u < p(x)`` does, and a
    rejected position emits p with x removed."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0] * 5])  # row 0 for the draft, row 1 the bonus
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits[:1], [params])[0]
    stream, n, accepted, after_reject = TokenUniforms(5), 20_000, 0, torch.zeros(5)
    for _ in range(n):
        out = verify(logits, [0], [[1]], [None], [params], [stream], TokenUniforms(0))[0]
        if out[0] == 1:
            accepted += 1
            assert len(out) == 2
        else:
            after_reject[out[0]] += 1
    assert abs(accepted / n - float(p[1])) < 4 * (float(p[1] * (1 - p[1])) / n) ** 0.5
    residual = p.clone()
    residual[1] = 0
    assert total_variation(after_reject, residual / residual.sum()) < 0.02
    assert after_reject[1] == 0


def test_requests_sharing_the_default_stream_still_draw_from_the_target() -> None:
    """Requests without a stream of their own share the default one, which cannot be peeked per request: each
    then takes a fresh uniform for every row. The first draft is accepted with p_1(x_1), a rejection draws p_1
    without x_1, and the token after an accepted draft follows p_2 (whatever the first draw was)."""
    rows = torch.tensor([[2.0, 0.5, 0.0, -0.5], [-1.0, 0.0, 1.0, 0.3], [0.0] * 4])  # positions 1, 2, bonus
    logits = rows.repeat(3, 1)  # three requests, drafts [0, 3] each
    params = SamplingParams(temperature=1.0)
    p = target_probs(rows, [params] * 3)
    shared, n = TokenUniforms(9), 5_000
    accepted, after_reject, second = 0, torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        for out in verify(logits, [0, 3, 6], [[0, 3]] * 3, [None] * 3, [params] * 3, [None] * 3, shared):
            if out[0] == 0:
                accepted += 1
                second[out[1]] += 1
            else:
                after_reject[out[0]] += 1
    trials = 3 * n
    assert abs(accepted / trials - float(p[0, 0])) < 4 * (float(p[0, 0] * (1 - p[0, 0])) / trials) ** 0.5
    residual = p[0].clone()
    residual[0] = 0
    assert total_variation(after_reject, residual / residual.sum()) < 0.03
    assert total_variation(second, p[1]) < 0.03
