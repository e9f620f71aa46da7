import math

import pytest
import torch

from pdserve.engine.sampler import (
    Sampler,
    SamplingRequest,
    apply_penalties,
    make_generator,
)
from pdserve.types.sampling_params import SamplingParams

VOCAB = 64


def request(prompt=(), output=(), **params) -> SamplingRequest:
    sampling_params = SamplingParams(**params)
    return SamplingRequest(
        params=sampling_params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=make_generator(sampling_params.seed),
    )


def logits_from_probs(probs: list[float], positions: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """One row of logits giving probability probs[i] to token positions[i] and 0 elsewhere."""
    row = torch.full((vocab,), float("-inf"))
    row[positions] = torch.tensor(probs).log()
    return row


def draw_many(row: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    """Sample `num_draws` times from one row of logits, as one batch of identical rows."""
    torch.manual_seed(0)
    requests = [request(**params) for _ in range(num_draws)]
    return torch.tensor(Sampler()(row.expand(num_draws, -1), requests).token_ids)


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_seeded_request_without_generator_is_rejected():
    with pytest.raises(ValueError, match="generator"):
        SamplingRequest(params=SamplingParams(seed=1), prompt_token_ids=[], output_token_ids=[], generator=None)


def test_rejects_logits_of_the_wrong_shape():
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(3, VOCAB), [request()])


def test_greedy_is_argmax_for_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    requests = [request(temperature=0.0) for _ in range(4)] + [request(top_k=1, temperature=3.0)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler()(logits.to(dtype), requests)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 5


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    requests = [request(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    for _ in range(20):
        token_ids = Sampler()(logits, requests).token_ids
        assert token_ids[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_samples_follow_the_tempered_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    row = logits_from_probs(probs, [3, 10, 20, 40])
    draws = draw_many(row, 8000, temperature=0.5)
    expected = torch.softmax(row / 0.5, dim=-1)
    observed = torch.bincount(draws, minlength=VOCAB).float() / len(draws)
    # The standard deviation of each frequency is below 0.006.
    assert torch.allclose(observed, expected, atol=0.03)


def test_never_samples_a_masked_token():
    row = torch.full((VOCAB,), float("-inf"))
    row[[7, 9]] = 0.0
    assert set(draw_many(row, 500).tolist()) == {7, 9}


def test_top_k_keeps_exactly_the_k_best():
    torch.manual_seed(1)
    row = torch.randn(VOCAB) * 0.1  # nearly flat, so without top-k every token would show up
    draws = draw_many(row, 3000, top_k=3)
    assert set(draws.tolist()) == set(row.topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05], [30, 2, 50, 11])
    assert set(draw_many(row, 3000, top_p=0.75).tolist()) == {30, 2}
    assert set(draw_many(row, 3000, top_p=0.85).tolist()) == {30, 2, 50}
    assert set(draw_many(row, 300, top_p=0.01).tolist()) == {30}
    assert set(draw_many(row, 3000, top_p=1.0).tolist()) == {30, 2, 50, 11}


def test_top_p_applies_to_what_top_k_kept():
    # Top-2 renormalises to (0.57, 0.43): top_p 0.5 then keeps only the first; on the
    # original distribution it would have kept two tokens.
    row = logits_from_probs([0.4, 0.3, 0.2, 0.1], [5, 6, 7, 8])
    assert set(draw_many(row, 500, top_k=2, top_p=0.5).tolist()) == {5}


def test_min_p_drops_tokens_below_the_scaled_max():
    row = logits_from_probs([0.4, 0.3, 0.2, 0.1], [1, 4, 9, 16])
    # Threshold 0.6 * 0.4 = 0.24.
    assert set(draw_many(row, 3000, min_p=0.6).tolist()) == {1, 4}
    assert set(draw_many(row, 300, min_p=1.0).tolist()) == {1}


def run_steps(logits_steps: list[torch.Tensor], row: int, requests: list[SamplingRequest]) -> list[int]:
    sampler = Sampler()
    return [sampler(logits, requests).token_ids[row] for logits in logits_steps]


def test_seeded_request_ignores_batch_composition_and_position():
    torch.manual_seed(0)
    steps = [torch.randn(4, VOCAB) for _ in range(8)]
    seeded = dict(seed=1234, temperature=0.9, top_p=0.95)

    alone = run_steps([s[2:3] for s in steps], 0, [request(**seeded)])
    # Same logits row, now third in a batch with greedy, penalised and filtered neighbours.
    crowded = run_steps(
        steps,
        2,
        [
            request(temperature=0.0),
            request(output=[1, 2], presence_penalty=1.0, top_k=5),
            request(**seeded),
            request(min_p=0.2, seed=7),
        ],
    )
    torch.manual_seed(99)  # the global generator must not matter
    moved = [s[[2, 0, 1]] for s in steps]
    first = run_steps(moved, 0, [request(**seeded), request(), request(top_p=0.5)])
    assert alone == crowded == first


def test_different_seeds_give_different_tokens():
    torch.manual_seed(0)
    steps = [torch.zeros(1, VOCAB) for _ in range(10)]  # uniform: 64**-10 chance of a match
    a = run_steps(steps, 0, [request(seed=1)])
    b = run_steps(steps, 0, [request(seed=2)])
    assert a == run_steps(steps, 0, [request(seed=1)])
    assert a != b


def test_repetition_penalty_hf_style():
    logits = torch.tensor([[2.0, 1.9, -1.0, -0.9, 0.5]])
    out = apply_penalties(logits, [request(prompt=[0], output=[3], repetition_penalty=1.5)])
    # Positive seen logits are divided, negative ones multiplied, unseen ones untouched.
    assert torch.allclose(out, torch.tensor([[2.0 / 1.5, 1.9, -1.0, -0.9 * 1.5, 0.5]]))
    greedy = request(prompt=[0], output=[3], repetition_penalty=1.5, temperature=0.0)
    assert Sampler()(logits, [greedy]).token_ids == [1]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    req = request(prompt=[0, 0, 4], output=[1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [req])
    assert torch.allclose(out, torch.tensor([[1.0, 1.0 - 0.5 - 0.5, 1.0, 1.0 - 0.5 - 0.25, 1.0]]))


def test_negative_presence_penalty_flips_argmax_to_a_seen_token():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    req = request(output=[1], presence_penalty=-1.0, temperature=0.0)
    assert Sampler()(logits, [req]).token_ids == [1]
    assert Sampler()(logits, [request(output=[1], temperature=0.0)]).token_ids == [0]


def test_penalties_leave_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    requests = [
        request(prompt=[1], output=[2, 3]),
        request(prompt=[1], output=[2, 3], repetition_penalty=2.0, frequency_penalty=1.0),
        request(prompt=[1], output=[2, 3], presence_penalty=0.3),
    ]
    out = apply_penalties(logits, requests)
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out[1], logits[1])
    expected = logits[2].clone()
    expected[[2, 3]] -= 0.3
    assert torch.allclose(out[2], expected)


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    requests = [
        request(logprobs=5, temperature=0.7, output=[0], repetition_penalty=1.3),
        request(),
        request(logprobs=0, temperature=0.0),
        request(logprobs=20, temperature=0.0, presence_penalty=2.0, output=[9]),
    ]
    out = Sampler()(logits, requests)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == []
    for row, n in [(0, 5), (2, 0), (3, 20)]:
        lp = out.logprobs[row]
        assert math.isclose(lp.token_logprob, expected[row, out.token_ids[row]].item(), rel_tol=1e-6)
        values, ids = expected[row].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), values)
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in lp.top)


def test_banned_tokens_are_never_picked_and_other_rows_and_logprobs_keep_them():
    logits = torch.randn(3, VOCAB)
    best = logits.argmax(dim=-1)
    rows = [request(temperature=0, logprobs=1), request(temperature=0), request(temperature=1.0, seed=3)]
    rows[0].banned_token_ids = [int(best[0])]
    rows[2].banned_token_ids = list(range(VOCAB - 1))  # one token left to draw
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1]) and out.token_ids[1] == int(best[1])
    assert out.token_ids[2] == VOCAB - 1
    assert out.logprobs[0].top[0][0] == int(best[0])  # logprobs are the raw model's
