"""The request checks the e2e fuzz test called for (patches 0071-0074), without a server:
``managers/prompt_ids.py``, ``sampling/stop_token_ids.py``, ``managers/sampling_params_shape.py``
and ``entrypoints/openai/validator_guard.py`` on upstream's request models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.managers.prompt_ids import EMPTY_INPUT, check_prompt_ids
from sglang.srt.managers.sampling_params_shape import check_sampling_params_shape
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
