"""The request checks the e2e fuzz test called for (patches 0071-0077), without a server:
``managers/prompt_ids.py``, ``sampling/stop_token_ids.py``, ``managers/sampling_params_shape.py``,
``entrypoints/openai/validator_guard.py`` on upstream's request models,
``sampling/penalty_floor.py`` and ``sampling/custom_logit_processor_check.py``."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.prompt_ids import EMPTY_INPUT, check_prompt_ids
from sglang.srt.managers.sampling_params_shape import check_sampling_params_shape
from sglang.srt.sampling.custom_logit_processor import (
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
)
from sglang.srt.sampling.custom_logit_processor_check import (
    abort_requests_of_failed_processors,
    check_custom_logit_processor,
    run_custom_logit_processor,
)
from sglang.srt.sampling.penalty_floor import MIN_REPETITION_PENALTY, check_repetition_penalty
from sglang.srt.sampling.stop_token_ids import check_stop_token_ids

MSG = [{"role": "user", "content": "hi"}]


def test_prompt_ids():
    check_prompt_ids([0, 5, 9], 10)
    check_prompt_ids(None, 10)  # input_embeds
    with pytest.raises(ValueError, match=r"^The input is empty \(0 tokens\)"):
        check_prompt_ids([], 10)
    assert EMPTY_INPUT.startswith("The input is empty")
    with pytest.raises(ValueError, match="token id -1 at position 1; valid range is"):
        check_prompt_ids([3, -1, 4], 10)
    with pytest.raises(ValueError, match=r"token id 10 at position 0; valid range is \[0, 10\)"):
        check_prompt_ids([10], 10)

    class Image:
        image_data = ["img"]

    check_prompt_ids([3, 99999], 10, Image())  # placeholder ids of a processor pass


def test_stop_token_ids():
    check_stop_token_ids(None, 10)
    check_stop_token_ids({0, 9}, 10)
    with pytest.raises(ValueError, match=r"token id -2; valid range is \[0, 10\)"):
        check_stop_token_ids({-2, 3, 12}, 10)


def test_sampling_params_shape():
    check_sampling_params_shape({"max_new_tokens": 1}, True, 1)
    check_sampling_params_shape(None, True, 1)
    check_sampling_params_shape([{}, {}], False, 2)
    check_sampling_params_shape([{}, {}, {}], False, 2)  # upstream uses the first two
    with pytest.raises(ValueError, match="a single prompt takes one object, not a list of 1"):
        check_sampling_params_shape([{}], True, 1)
    with pytest.raises(ValueError, match="a list of 0 for a batch of 1 prompts"):
        check_sampling_params_shape([], False, 1)
    with pytest.raises(ValueError, match="a list of 1 for a batch of 2 prompts"):
        check_sampling_params_shape([{}], False, 2)


@pytest.mark.parametrize("value", [True, [1], 3, "json_object"])
def test_wrong_typed_response_format_is_a_validation_error(value):
    """Without the guard set_json_schema raised AttributeError (a 500 on the route)."""
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": MSG, "response_format": value}
        )
    assert e.value.errors()[0]["loc"][0] == "response_format", e.value.errors()


def test_guard_leaves_good_and_plainly_bad_bodies_alone():
    ok = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSG, "response_format": {"type": "json_object"}}
    )
    assert ok.response_format.type == "json_object"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": "hi"})
    assert e.value.errors()[0]["loc"][0] == "messages"
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "response_format": 1})


def test_repetition_penalty_floor():
    for ok in (MIN_REPETITION_PENALTY, 0.5, 1.0, 2.0):
        check_repetition_penalty(ok)
    for bad in (6.1e-177, 1e-7, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[1e-06, 2\]"):
            check_repetition_penalty(bad)


class NotAProcessor:
    pass


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "abc",
            r"^custom_logit_processor is not a serialized CustomLogitProcessor \(JSONDecodeError",
        ),
        ('{"x": 1}', r"is not a serialized CustomLogitProcessor \(KeyError"),
        ('{"callable": "zz"}', r"is not a serialized CustomLogitProcessor \(ValueError"),
        ('{"callable": "00ff"}', r"is not a serialized CustomLogitProcessor"),
        ("5", r"is not a serialized CustomLogitProcessor \(TypeError"),
        (5, r"^custom_logit_processor must be a string .*, got int"),
        (
            [None, DisallowedTokensLogitsProcessor.to_str(), {"a": 1}],
            r"^custom_logit_processor\[2\] must be a string",
        ),
    ],
)
def test_custom_logit_processor_refused(value, message):
    with pytest.raises(ValueError, match=message) as e:
        check_custom_logit_processor(value)
    assert "CustomLogitProcessor.to_str()" in str(e.value)  # says how to make a valid one


def test_custom_logit_processor_accepted_and_wrong_class():
    check_custom_logit_processor(None)
    check_custom_logit_processor(DisallowedTokensLogitsProcessor.to_str())
    check_custom_logit_processor([None, DisallowedTokensLogitsProcessor.to_str()])
    # a pickled class that is not a processor: deserializes, then refused by type
    bad = CustomLogitProcessor.to_str.__func__(NotAProcessor)
    with pytest.raises(
        ValueError, match="deserializes to NotAProcessor, not a CustomLogitProcessor"
    ):
        check_custom_logit_processor(bad)


class _Req:
    def __init__(self, processor_str):
        self.custom_logit_processor = processor_str
        self.to_finish = None

    def finished(self):
        return False


def _run(processor, params, logits):
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_batch_info import ProcessorEntry

    rows = list(range(logits.shape[0]))
    entry = ProcessorEntry(processor=processor, rows=rows, indices=torch.tensor(rows))
    info = SimpleNamespace(custom_logit_processor={hash("p"): entry})
    return run_custom_logit_processor(info, entry, logits.clone(), params)


def test_processor_failures_abort_their_requests():
    logits = torch.randn(2, 8)
    good = _run(DisallowedTokensLogitsProcessor(), [{"token_ids": [3]}] * 2, logits)
    assert torch.isneginf(good[:, 3]).all() and torch.equal(good[:, :3], logits[:, :3])
    batch = type("Batch", (), {})()
    batch.reqs = [_Req("p"), _Req(None), _Req("other")]
    assert abort_requests_of_failed_processors(batch) == 0  # nothing failed

    assert _run(DisallowedTokensLogitsProcessor(), [None, None], logits) is None  # TypeError
    assert abort_requests_of_failed_processors(batch) == 1
    assert batch.reqs[0].to_finish.message.startswith(
        "custom logit processor DisallowedTokensLogitsProcessor raised TypeError"
    )
    assert batch.reqs[0].to_finish.status_code == 400
    assert batch.reqs[1].to_finish is None and batch.reqs[2].to_finish is None
    assert abort_requests_of_failed_processors(batch) == 0  # consumed once

    class Bad(CustomLogitProcessor):
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, logits, custom_param_list=None):
            return self.fn(logits)

    for fn, fault in [
        (lambda x: x * float("nan"), "returned NaN or +inf logits"),
        (lambda x: x.fill_(float("inf")), "returned NaN or +inf logits"),
        (
            lambda x: x.fill_(float("-inf")),
            "returned a row without any finite logit (every token masked)",
        ),
        (lambda x: x[:, :1], "returned shape (2, 1) for logits of shape (2, 8)"),
        (lambda x: x.tolist(), "returned list, not a tensor"),
    ]:
        assert _run(Bad(fn), [None, None], logits) is None
        batch.reqs[0].to_finish = None
        assert abort_requests_of_failed_processors(batch) == 1
        assert batch.reqs[0].to_finish.message == f"custom logit processor Bad {fault}"
