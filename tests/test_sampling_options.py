"""Per-request sampling options against hand-computed logits: TensorRT-LLM 1.2's order and formulas
(runtime/sampling.py cites them), log probs as the engine reports them, the guide hook,
and how the CPU llm reads the tensorrt_llm inputs that carry them."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from qwen3vl_trt.errors import InputError
from qwen3vl_trt.runtime.sampling import FLT_MAX, GuideFailed, SamplingParams, TokenSampler
from qwen3vl_trt.serving import interface, request
from qwen3vl_trt.serving.stages.cpu_llm import InflightLLM

CPU = torch.device("cpu")


def _sampler(prompt=(), vocab_size=None, **kw) -> TokenSampler:
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("top_k", 1)  # greedy unless a test samples
    kw.setdefault("temperature", 1.0)  # what preprocessing sends when greedy: no scaling
    return TokenSampler(SamplingParams(**kw), CPU, prompt_ids=prompt, vocab_size=vocab_size)


def _row(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _log_softmax(values, token: int) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(values[token] - values.max() - np.log(np.exp(values - values.max()).sum()))


# -- each option alone ---------------------------------------------------------------------------


def test_embedding_bias_is_added_to_the_logits():
    sampler = _sampler(embedding_bias=_row(3, 0, 0, 0), vocab_size=4, return_log_probs=True)
    assert sampler.next_token(_row(0, 1, 2, 2.5)) == 0
    assert sampler.log_probs == [pytest.approx(_log_softmax([3, 1, 2, 2.5], 0), abs=1e-6)]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_ids():
    sampler = _sampler(prompt=[2, 1], repetition_penalty=2.0)
    torch.testing.assert_close(sampler.process(_row(1.0, -1.0, 3.0, 2.9)), _row(1.0, -2.0, 1.5, 2.9))
    assert sampler.next_token(_row(1.0, -1.0, 3.0, 2.9)) == 3


def test_presence_penalty_subtracts_once_however_often_an_id_was_seen():
    sampler = _sampler(prompt=[3, 3, 3], presence_penalty=1.0)
    torch.testing.assert_close(sampler.process(_row(0, 0, 1, 1.5)), _row(0, 0, 1, 0.5))


def test_frequency_penalty_counts_every_occurrence_prompt_included():
    assert _sampler(prompt=[3, 3], frequency_penalty=0.4).next_token(_row(0, 0, 1, 1.5)) == 2  # 1.5 - 0.8
    assert _sampler(prompt=[3], frequency_penalty=0.4).next_token(_row(0, 0, 1, 1.5)) == 3  # 1.5 - 0.4


def test_generated_tokens_count_from_the_next_step_on():
    sampler = _sampler(frequency_penalty=1.0)
    row = _row(0, 0.5, 0, 0)
    # 1 (0.5), then 0.5 - 1 < 0: the first 0 wins, then 2 and 3, then 1 again (-0.5 beats the others' -1).
    assert [sampler.next_token(row) for _ in range(5)] == [1, 0, 2, 3, 1]


def test_prompt_ids_beyond_the_vocabulary_do_not_count():
    # Visual fake ids (>= vocab_size) take prompt-table rows; the penalty kernel skips them.
    sampler = _sampler(prompt=[4, 100, 1], presence_penalty=5.0)
    torch.testing.assert_close(sampler.process(_row(1, 2, 0, 0)), _row(1, -3, 0, 0))


def test_penalties_at_their_defaults_change_nothing():
    sampler = _sampler(prompt=[0, 1], return_log_probs=True)
    row = _row(0.3, 2.0, -1.0, 0.5)
    torch.testing.assert_close(sampler.process(row), row)
    assert sampler.next_token(row, argmax=1) == 1


# -- the engine's order --------------------------------------------------------------------------


def test_bias_then_temperature_then_repetition_presence_frequency():
    """penaltyKernels.cu batchApplyPenalty: + bias, * 1/(T + 1e-6), then for seen ids repetition, presence and
    frequency: the additive penalties are not scaled by the temperature."""
    temperature, inv = 2.0, 1.0 / (2.0 + 1e-6)
    sampler = _sampler(
        prompt=[1, 2, 2],
        embedding_bias=_row(0, 0, 0, 1),
        temperature=temperature,
        top_k=0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    logits = [2.0, -4.0, 6.0, 1.0]
    expected = [
        2.0 * inv,  # unseen: bias 0, scaled
        -4.0 * inv * 2.0 - 0.5 - 0.25 * 1,  # seen once, negative: multiplied
        6.0 * inv / 2.0 - 0.5 - 0.25 * 2,  # seen twice, positive: divided
        (1.0 + 1.0) * inv,  # unseen, biased
    ]
    torch.testing.assert_close(sampler.process(_row(*logits)), _row(*expected))


def test_the_temperature_one_is_not_scaled_and_zero_scales_by_a_million():
    assert _sampler(temperature=1.0).inv_temperature is None
    torch.testing.assert_close(_sampler(temperature=0.0).process(_row(1e-6, 0)), _row(1e-6 / 1e-6, 0))


def test_at_temperature_zero_the_scaled_logits_swamp_the_penalties():
    # 1/(0 + 1e-6): a presence penalty of 1 moves a logit gap of 0.1 (1e5 scaled) nowhere.
    assert _sampler(prompt=[1], presence_penalty=1.0, temperature=0.0).next_token(_row(0, 0.1)) == 1
    assert _sampler(prompt=[1], presence_penalty=1.0).next_token(_row(0, 0.1)) == 0


def test_logits_are_clamped_to_the_float32_range():
    sampler = _sampler(embedding_bias=_row(float("inf"), 0), temperature=0.5)
    assert sampler.process(_row(FLT_MAX, float("-inf"))).tolist() == [FLT_MAX, -FLT_MAX]


def test_min_tokens_bans_the_end_id_after_bias_and_penalties():
    sampler = _sampler(end_ids=[0], min_new_tokens=1, embedding_bias=_row(10, 0, 0, 0), return_log_probs=True)
    first = sampler.next_token(_row(0, 0, 0, 0))
    assert first != 0 and sampler.log_probs[0] == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert sampler.next_token(_row(0, 0, 0, 0)) == 0 and sampler.finish_reason == "stop"


# -- log probs ------------------------------------------------------------------------------------


def test_greedy_log_probs_are_of_the_full_softmax_at_the_requests_temperature():
    logits = [1.0, 3.0, 2.0, -1.0]
    plain = _sampler(return_log_probs=True)
    assert plain.next_token(_row(*logits), argmax=1) == 1
    assert plain.log_probs == [pytest.approx(_log_softmax(logits, 1), abs=1e-6)]
    cool = _sampler(temperature=0.5, return_log_probs=True)  # top_k 1 at temperature 0.5: still the argmax
    assert cool.next_token(_row(*logits)) == 1
    scaled = [v / (0.5 + 1e-6) for v in logits]
    assert cool.log_probs == [pytest.approx(_log_softmax(scaled, 1), abs=1e-5)]


def test_sampled_log_probs_are_not_renormalized_over_the_top_k_or_top_p_cut():
    logits = [2.0, 1.9, -3.0, -3.0, -3.0]
    for cut in (dict(top_k=2), dict(top_k=0, top_p=0.6)):
        sampler = _sampler(temperature=1.0, seed=4, return_log_probs=True, **cut)
        tokens = [sampler.next_token(_row(*logits)) for _ in range(12)]
        assert set(tokens) <= {0, 1}
        # log P(token | vocabulary), not log P(token | the cut): the two differ by about 0.011 here.
        assert sampler.log_probs == [pytest.approx(_log_softmax(logits, t), abs=1e-6) for t in tokens]
        assert sampler.log_probs != [pytest.approx(_log_softmax(logits[:2], t), abs=1e-3) for t in tokens]


def test_log_probs_follow_the_bans_and_the_penalties():
    sampler = _sampler(prompt=[1], presence_penalty=1.0, bad_sequences=[[3]], return_log_probs=True)
    assert sampler.next_token(_row(0, 1, 0, 5)) == 0
    assert sampler.log_probs == [pytest.approx(_log_softmax([0, 0, 0, -np.inf], 0), abs=1e-6)]


# -- the guide hook -----------------------------------------------------------------------------------


class _Guide:
    """A grammar that allows the given tokens only and records what it accepts."""

    def __init__(self, allowed):
        self.allowed, self.accepted, self.masked = set(allowed), [], 0

    def mask(self, logits):
        self.masked += 1
        forbidden = [t for t in range(logits.numel()) if t not in self.allowed]
        logits[forbidden] = float("-inf")
        return logits

    def accept(self, token):
        self.accepted.append(token)
        return True


def test_the_guide_masks_every_step_and_accepts_every_token():
    guide = _Guide({2, 3})
    sampler = _sampler(guide=guide, return_log_probs=True)
    row = _row(5, 4, 1, 2)
    assert [sampler.next_token(row, argmax=0) for _ in range(3)] == [3, 3, 3]
    assert guide.masked == 3 and guide.accepted == [3, 3, 3]
    assert sampler.log_probs[0] == pytest.approx(_log_softmax([1, 2], 1), abs=1e-6)


def test_a_failing_guide_raises_a_guide_error():
    class Broken(_Guide):
        def accept(self, token):
            raise ValueError("not in the grammar")

    with pytest.raises(GuideFailed, match="not in the grammar"):
        _sampler(guide=Broken({0})).next_token(_row(1, 0))


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(embedding_bias=torch.zeros(2, 2)), "embedding_bias"),
        (dict(temperature=-0.5), "temperature"),
    ],
)
def test_out_of_range_options_are_refused(options, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**options)


def test_negative_presence_and_frequency_penalties_are_taken():
    sampler = _sampler(prompt=[1], presence_penalty=-1.0, frequency_penalty=-0.5)
    torch.testing.assert_close(sampler.process(_row(0, 0)), _row(0, 1.5))


def test_an_embedding_bias_of_another_vocabulary_is_refused():
    with pytest.raises(InputError, match="embedding_bias holds 3 values"):
        _sampler(embedding_bias=torch.zeros(3), vocab_size=4)


# -- the CPU llm's inputs ------------------------------------------------------------------------------


def _engine(tokenizer_info_path=None) -> InflightLLM:
    """An InflightLLM without a model: what request parsing needs."""
    engine = InflightLLM.__new__(InflightLLM)
    engine.llm = SimpleNamespace(vocab_size=8)
    engine.end_ids = (7,)
    engine.tokenizer_info_path = tokenizer_info_path
    engine._grammars = None
    engine._grammars_lock = threading.Lock()
    return engine


def _inputs(**extra):
    inputs = {
        interface.INPUT_IDS.name: np.arange(1, 5, dtype=np.int32),
        interface.REQUEST_OUTPUT_LEN.name: np.array([4], np.int32),
    }
    inputs.update({(getattr(interface, k, None) or getattr(request, k)).name: v for k, v in extra.items()})
    return inputs


def test_the_llm_reads_the_penalties_bias_and_log_probs():
    sampling = (
        _engine()
        .request(
            _inputs(
                REPETITION_PENALTY=np.array([1.3], np.float32),
                PRESENCE_PENALTY=np.array([0.5], np.float32),
                FREQUENCY_PENALTY=np.array([-0.25], np.float32),
                EMBEDDING_BIAS=np.arange(8, dtype=np.float32),
                RETURN_LOG_PROBS=np.array([True]),
                RUNTIME_TOP_K=np.array([5], np.int32),
                TEMPERATURE=np.array([0.7], np.float32),
            )
        )
        .sampling
    )
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)
    assert sampling.embedding_bias.tolist() == list(range(8)) and sampling.return_log_probs
    assert (sampling.top_k, sampling.top_p, sampling.temperature) == (5, 1.0, pytest.approx(0.7))


def test_no_top_k_and_no_top_p_is_greedy_and_an_empty_bias_is_none():
    sampling = _engine().request(_inputs(EMBEDDING_BIAS=np.zeros(0, np.float32))).sampling
    assert sampling.greedy and sampling.embedding_bias is None
    assert not _engine().request(_inputs(RUNTIME_TOP_P=np.array([0.9], np.float32))).sampling.greedy


def test_guided_requests_need_tokenizer_info_and_other_guide_types_are_ignored():
    guided = dict(GUIDE_TYPE=np.array([b"regex"], object), GUIDE_TEXT=np.array([b"[ab]+"], object))
    with pytest.raises(InputError, match="guided decoding is not enabled"):
        _engine().request(_inputs(**guided))
    with pytest.raises(InputError, match="guided_decoding_guide must be sent"):
        _engine().request(_inputs(GUIDE_TYPE=np.array([b"regex"], object)))
    # utils.cc maps json, json_schema, regex and ebnf_grammar; any other type is no guide.
    assert _engine().request(_inputs(GUIDE_TYPE=np.array([b"structural_tag"], object))).sampling.guide is None


def test_a_guided_request_gets_its_matcher_from_the_grammar_cache():
    made = []

    class Cache:
        def matcher(self, guide_type, guide):
            made.append((guide_type, guide))
            return _Guide({0})

    engine = _engine(tokenizer_info_path="unused")
    engine._grammars = Cache()
    request = engine.request(_inputs(GUIDE_TYPE=np.array([b"json"], object)))
    assert made == [("json", "")] and isinstance(request.sampling.guide, _Guide)
