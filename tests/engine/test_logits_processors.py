"""Logits processors on hand-made logits: each definition (logit bias, the
min_tokens mask, CTRL's repetition penalty, OpenAI's frequency and presence
penalties), their order, greedy and sampled rows, speculative target rows and
batch invariance, through the step sampler the engine calls."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingOptions
from services.engine.torch_backend.logits_processors import (
    LogitsProcessorParams,
    LogitsProcessorState,
    apply_logits_processors,
)
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.step_sampler import StepRow, sample_step

NEG_INF = float("-inf")
EOS = 7
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 4.0, -3.0, 1.0, 0.0, 3.5]])  # vocab 8, EOS = 7


def state(prompt=(), output=(), eos=(EOS,), **options) -> LogitsProcessorState:
    built = LogitsProcessorState.for_request(SamplingOptions(max_tokens=64, **options),
                                             prompt, eos)
    assert built is not None
    for token in output:
        built.append(token)
    return built


def processed(st: LogitsProcessorState, logits=LOGITS, spec=()) -> torch.Tensor:
    return apply_logits_processors(logits, [StepRow(SamplingRow(), tuple(spec), st)])


def test_a_request_without_processors_has_no_state_and_the_logits_are_untouched() -> None:
    assert LogitsProcessorState.for_request(SamplingOptions(), (1, 2), (EOS,)) is None
    assert LogitsProcessorParams.from_options(
        SamplingOptions(repetition_penalty=1.0, stop_token_ids=(3,)), (EOS,)) is None
    rows = [StepRow(SamplingRow()), StepRow(SamplingRow(), (3,))]
    logits = torch.randn(3, 8)
    assert apply_logits_processors(logits, rows) is logits  # fast path: no copy


def test_logit_bias_adds_to_the_listed_tokens_only() -> None:
    out = processed(state(logit_bias=((3, -100.0), (4, 5.5))))
    expected = LOGITS.clone()
    expected[0, 3] -= 100.0
    expected[0, 4] += 5.5
    assert torch.equal(out, expected)


def test_logit_bias_minus_100_removes_the_greedy_token() -> None:
    st = state(logit_bias=((3, -100.0),))
    assert sample_step(LOGITS, [StepRow(SamplingRow())]) == [[3]]
    assert sample_step(LOGITS, [StepRow(SamplingRow(), (), st)]) == [[7]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    st = state(min_tokens=2, stop_token_ids=(0,), logit_bias=((EOS, 10.0),))
    out = processed(st)
    assert out[0, EOS] == NEG_INF and out[0, 0] == NEG_INF
    assert torch.equal(out[0, 1:EOS], LOGITS[0, 1:EOS])
    st.append(3)
    assert processed(st)[0, EOS] == NEG_INF  # 1 generated < 2
    st.append(5)
    out = processed(st)  # 2 generated: EOS is back (with its bias)
    assert out[0, EOS] == LOGITS[0, EOS] + 10.0 and out[0, 0] == LOGITS[0, 0]


def test_min_tokens_leaves_eos_alone_when_the_request_ignores_eos() -> None:
    out = processed(state(min_tokens=3, ignore_eos=True, stop_token_ids=(0,)))
    assert out[0, EOS] == LOGITS[0, EOS] and out[0, 0] == NEG_INF


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # token 0 (2.0) and 4 (-3.0) in the prompt, 1 (-1.0) and 3 (4.0) in the output
    out = processed(state(prompt=(0, 4), output=(1, 3, 3), repetition_penalty=2.0))
    expected = LOGITS.clone()
    expected[0, [0, 3]] /= 2.0
    expected[0, [1, 4]] *= 2.0
    assert torch.equal(out, expected)


def test_frequency_and_presence_count_output_tokens_only() -> None:
    st = state(prompt=(5, 5, 5), output=(3, 3, 3, 2), frequency_penalty=0.5,
               presence_penalty=0.25)
    out = processed(st)
    expected = LOGITS.clone()
    expected[0, 3] -= 3 * 0.5 + 0.25
    expected[0, 2] -= 1 * 0.5 + 0.25
    assert torch.equal(out, expected)  # prompt token 5 untouched
    st.append(2)  # counted incrementally at the next step
    expected[0, 2] -= 0.5
    assert torch.equal(processed(st), expected)


def test_negative_frequency_penalty_favours_repeats() -> None:
    out = processed(state(output=(6, 6), frequency_penalty=-2.0))
    assert out[0, 6] == LOGITS[0, 6] + 4.0


def test_order_is_bias_then_min_tokens_then_repetition_then_frequency_presence() -> None:
    # token 4: -3 + bias 5 = 2 > 0, so repetition divides (bias first): 2 / 2 = 1,
    # then frequency 1 * 0.5 and presence 0.25: 0.25.
    st = state(output=(4,), logit_bias=((4, 5.0),), repetition_penalty=2.0,
               frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    out = processed(st)
    assert out[0, 4].item() == pytest.approx(0.25)
    assert out[0, EOS] == NEG_INF  # the mask survives the penalties


def test_greedy_row_takes_the_argmax_of_the_processed_logits() -> None:
    st = state(output=(3,), frequency_penalty=1.0)  # 4.0 - 1 = 3.0 < 3.5 (EOS)
    assert sample_step(LOGITS, [StepRow(SamplingRow(), (), st)]) == [[EOS]]


def test_sampled_row_draws_from_the_processed_distribution() -> None:
    options = SamplingOptions(temperature=1.0, seed=3, max_tokens=64,
                              logit_bias=((0, -100.0), (3, -100.0), (EOS, -100.0)))
    st = LogitsProcessorState.for_request(options, (), (EOS,))
    row = StepRow(SamplingRow.from_options(options), (), st)
    drawn = {sample_step(LOGITS, [row])[0][0] for _ in range(200)}
    assert drawn.isdisjoint({0, 3, EOS}) and 5 in drawn


def test_speculative_row_j_counts_proposals_before_it() -> None:
    # proposals (3, 3): row 0 sees no 3, row 1 one, row 2 two; min_tokens=2 masks
    # EOS on rows 0 and 1 only (0 and 1 generated before them).
    st = state(frequency_penalty=1.0, min_tokens=2)
    logits = LOGITS.repeat(3, 1)
    out = processed(st, logits, spec=(3, 3))
    assert out[:, 3].tolist() == [4.0, 3.0, 2.0]
    assert out[:, EOS].tolist() == [NEG_INF, NEG_INF, 3.5]


def test_speculative_rows_match_the_same_steps_taken_one_at_a_time() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    proposals = (7, 9, 7)
    options = dict(prompt=(1, 2), output=(9,), repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.3, min_tokens=3, logit_bias=((7, 0.5),))
    spec = processed(state(**options), logits, proposals)
    one = state(**options)
    for j in range(4):
        assert torch.equal(spec[j], processed(one, logits[j:j + 1])[0]), j
        if j < 3:
            one.append(proposals[j])


def test_greedy_verification_uses_processed_target_rows() -> None:
    # Raw argmax is 3 everywhere; with frequency 1.0 row 1 (after proposal 3) prefers EOS.
    st = state(frequency_penalty=1.0)
    logits = LOGITS.repeat(3, 1)
    assert sample_step(logits, [StepRow(SamplingRow(), (3, 3), st)]) == [[3, EOS]]


def test_a_rows_processed_logits_do_not_depend_on_its_batch_mates() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    mine = state(output=(5, 5, 9), frequency_penalty=0.7, repetition_penalty=1.2)
    alone = processed(mine, logits[2:3])
    other = state(output=(1,), presence_penalty=2.0)
    rows = [StepRow(SamplingRow(), (4,), other), StepRow(SamplingRow(), (), mine),
            StepRow(SamplingRow(), (3,))]
    raw = logits.clone()
    batched = apply_logits_processors(logits, rows)
    assert torch.equal(logits, raw)  # the raw logits (logprobs are taken from them) stay
    assert torch.equal(batched[2:3], alone)
    assert torch.equal(batched[3:], logits[3:])  # a row without processors is a copy
    assert batched.data_ptr() != logits.data_ptr()


def test_only_the_penalties_asked_for_keep_history() -> None:
    st = state(prompt=(1,), repetition_penalty=1.5)
    for token in (2, 2, 3):
        st.append(token)
    out = processed(st)
    expected = LOGITS.clone()
    expected[0, [2, 3]] /= 1.5
    expected[0, 1] *= 1.5
    assert torch.equal(out, expected)
    assert st.num_output_tokens == 3 and not st._pending  # no counts kept that nothing reads
