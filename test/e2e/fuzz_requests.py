"""Hypothesis strategies for request bodies of the four generation routes.

Each route's strategy follows its request model field by field (``ChatCompletionRequest`` and
``CompletionRequest`` in ``sglang.srt.entrypoints.openai.protocol``, ``AnthropicMessagesRequest``
in ``sglang.srt.entrypoints.anthropic.protocol``, ``GenerateReqInput`` in
``sglang.srt.managers.io_struct``): a body is a random subset of the model's fields, each holding
either a value of the field's own type (a small one: generation stays at a few tokens) or
:data:`junk` (a value of another type, a huge or negative number, NaN, odd unicode, a lone
surrogate), and a required field is sometimes left out. Tools come with good and bad JSON
schemas and tool choices that name tools the request does not have.

The fields of features the test server does not serve are sent too: ``custom_logit_processor``
strings that are not a serialized processor and upstream's ``DisallowedTokensLogitsProcessor``
with good or bad ``custom_params`` (the server runs with ``--enable-custom-logit-processor``;
patches 0077 and 0079), LoRA adapters it does not have, and image / audio / video data for a
text-only model. Left out: disaggregation fields (bootstrap host and room: a request would wait
for a prefill server that does not exist).

Numbers that would make a valid request long (``max_tokens``, ``n``, ``best_of``) are small in
their valid form; their huge forms are in :data:`junk`, where the server must refuse them or
clip them to the context.
"""

from __future__ import annotations

from hypothesis import strategies as st

from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/generate")

# Text with characters from every plane, control characters, and a lone surrogate now and then
# (json.dumps escapes it as \ud800, which the server's JSON parser accepts).
odd_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8", exclude_categories=()), max_size=12),
    st.sampled_from(["", " ", "\x00", "\ud800", "\udfff x", "<|im_end|>", "</think>", "\u202e"]),
)
huge = st.sampled_from([-1, 0, -(2**31), 2**31, 2**53 + 1, 2**63, 10**30, -(10**30)])
numbers = st.one_of(
    huge,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)
junk_value = st.one_of(
    st.booleans(),
    st.booleans(),
    numbers,
    odd_text,
    st.lists(st.one_of(st.integers(), odd_text, st.none()), max_size=3),
    st.dictionaries(odd_text, st.one_of(st.integers(), odd_text, st.none()), max_size=3),
)
junk = st.one_of(st.none(), junk_value)


# One draw per example: a clean body has no junk anywhere (a request with junk in one of its
# thirty fields is nearly always refused, so clean bodies are what reach generation).
clean_body = st.shared(st.booleans(), key="clean_body")


def maybe_junk(valid: st.SearchStrategy, p_junk: int = 4) -> st.SearchStrategy:
    """``valid`` in a clean body; else ``valid`` most of the time and :data:`junk` about one
    time in ``p_junk``."""
    mixed = st.one_of(*([valid] * (p_junk - 1)), junk)
    return clean_body.flatmap(lambda clean: valid if clean else mixed)


def body(
    required: dict[str, st.SearchStrategy],
    optional: dict[str, st.SearchStrategy],
    bound: dict[str, st.SearchStrategy],
) -> st.SearchStrategy:
    """A JSON object with the ``required`` fields (one of them left out about one time in four,
    so the model's "field required" path is hit), the ``bound`` ones (the output length: never
    left out, since without it a request may generate up to the context) and a subset of the
    ``optional`` ones."""
    keep_all = st.just(None)
    dropped = st.one_of(keep_all, keep_all, keep_all, st.sampled_from(sorted(required)))
    required = {**required, **bound}
    return st.tuples(st.fixed_dictionaries(required, optional=optional), dropped).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]}
    )


# --- shared pieces ------------------------------------------------------------------------

# An output length: null is left out (the server's default may be the whole context).
small_tokens = clean_body.flatmap(
    lambda clean: st.integers(1, 6) if clean else st.one_of(st.integers(1, 6), junk_value)
)
unit = maybe_junk(st.floats(min_value=0, max_value=1))
temperature = maybe_junk(st.floats(min_value=0, max_value=2))
penalty = maybe_junk(st.floats(min_value=-2, max_value=2))
small_n = maybe_junk(st.integers(min_value=1, max_value=3))
stop = maybe_junk(st.one_of(odd_text, st.lists(odd_text, max_size=5)))
seed = maybe_junk(st.integers(min_value=0, max_value=2**32))
token_ids = st.lists(
    st.one_of(st.integers(min_value=0, max_value=1000), huge), min_size=0, max_size=8
)
regex = st.sampled_from(["[a-z]+", "(a|b)*c", "[", "(?<=x)y", "\\", ".*", "a{1000000}"])
names = st.sampled_from(["f", "get_weather", "", "bad name!", "x" * 200])

good_schemas = st.sampled_from(
    [
        {"type": "object"},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    ]
)
json_schemas = st.one_of(
    st.just({"type": "object"}),
    st.just({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}),
    st.just(
        {
            "type": "object",
            "properties": {"mode": {"enum": ["x", "y"]}, "n": {"type": "integer"}},
            "required": ["mode"],
            "additionalProperties": False,
        }
    ),
    st.just({"type": "nope"}),
    st.just({"properties": 5}),
    st.just({"$ref": "#/$defs/missing"}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#"}}}),
    st.just({"type": "string", "pattern": "["}),
    st.just({"type": "integer", "minimum": 5, "maximum": 1}),
    st.just({"enum": []}),
    junk,
)
openai_tool = st.fixed_dictionaries(
    {"type": maybe_junk(st.just("function"))},
    optional={
        "function": maybe_junk(
            st.fixed_dictionaries(
                {"name": maybe_junk(names)},
                optional={
                    "description": odd_text,
                    "parameters": clean_body.flatmap(lambda c: good_schemas if c else json_schemas),
                    "strict": maybe_junk(st.booleans()),
                },
            )
        )
    },
)
openai_tool_choice = maybe_junk(
    st.one_of(
        st.sampled_from(["auto", "none", "required", "any", ""]),
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})}
        ),
    )
)
response_format = maybe_junk(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "nope"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {"name": maybe_junk(names)}, optional={"schema": json_schemas}
                ),
            }
        ),
    )
)

# Features the test server does not serve (a text-only model without LoRA), and custom logit
# processors: strings that are not a serialized processor, and upstream's own processor whose
# custom_params ({"token_ids": [...]}) may be missing or junk, which makes it fail at run time.
DISALLOWED_TOKENS = DisallowedTokensLogitsProcessor.to_str()
custom_logit_processor = maybe_junk(
    st.sampled_from(
        ["", "abc", "{}", "[1]", '{"callable": 5}', '{"callable": "zz"}', DISALLOWED_TOKENS]
    )
)
custom_params = maybe_junk(
    st.one_of(
        st.fixed_dictionaries({"token_ids": maybe_junk(token_ids)}),
        st.dictionaries(odd_text, junk_value, max_size=2),
    )
)
lora_path = maybe_junk(st.sampled_from(["nope", "", "../adapter"]))
media = maybe_junk(
    st.sampled_from(["http://127.0.0.1:9/x.png", "data:image/png;base64,AAAA", "AAAA", ""])
)

# --- /v1/chat/completions -----------------------------------------------------------------

# A clean body's messages: user turns of odd text (the shape both chat routes accept, so clean
# bodies reach generation; the junk bodies cover the other roles and block types).
user_turn = st.fixed_dictionaries({"role": st.just("user"), "content": odd_text.filter(str.strip)})

chat_content = maybe_junk(
    st.one_of(
        odd_text,
        st.lists(
            st.one_of(
                st.fixed_dictionaries({"type": st.just("text"), "text": maybe_junk(odd_text)}),
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["image_url", "input_audio", "nope"])}
                ),
            ),
            max_size=3,
        ),
    )
)
tool_call = st.fixed_dictionaries(
    {
        "id": maybe_junk(odd_text),
        "type": maybe_junk(st.just("function")),
        "function": maybe_junk(
            st.fixed_dictionaries(
                {
                    "name": maybe_junk(names),
                    "arguments": maybe_junk(st.sampled_from(['{"a": "b"}', "{", "", "[]"])),
                }
            )
        ),
    }
)
chat_message = st.fixed_dictionaries(
    {"role": maybe_junk(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={
        "content": chat_content,
        "tool_calls": maybe_junk(st.lists(tool_call, max_size=2)),
        "tool_call_id": maybe_junk(odd_text),
        "reasoning_content": maybe_junk(odd_text),
        "name": maybe_junk(names),
    },
)
chat = body(
    {
        "model": maybe_junk(st.sampled_from(["default", "default", "default:nope"]), 8),
        "messages": clean_body.flatmap(
            lambda c: (
                st.lists(user_turn, min_size=1, max_size=2)
                if c
                else maybe_junk(st.lists(chat_message, min_size=0, max_size=4), 8)
            )
        ),
    },
    {
        "max_completion_tokens": small_tokens,
        "temperature": temperature,
        "top_p": unit,
        "top_k": maybe_junk(st.integers(min_value=-1, max_value=50)),
        "min_p": unit,
        "frequency_penalty": penalty,
        "presence_penalty": penalty,
        "repetition_penalty": maybe_junk(st.floats(min_value=0, max_value=2)),
        "n": small_n,
        "stop": stop,
        "stop_token_ids": maybe_junk(token_ids),
        "seed": seed,
        "logprobs": maybe_junk(st.booleans()),
        "top_logprobs": maybe_junk(st.integers(min_value=0, max_value=20)),
        "logit_bias": maybe_junk(
            st.dictionaries(
                st.one_of(st.integers(0, 1000).map(str), odd_text),
                st.floats(-100, 100),
                max_size=3,
            )
        ),
        "stream": maybe_junk(st.booleans()),
        "stream_options": maybe_junk(
            st.fixed_dictionaries({"include_usage": maybe_junk(st.booleans())})
        ),
        "tools": maybe_junk(st.lists(openai_tool, max_size=3)),
        "tool_choice": openai_tool_choice,
        "parallel_tool_calls": maybe_junk(st.booleans()),
        "response_format": response_format,
        "regex": maybe_junk(regex),
        "ebnf": maybe_junk(st.sampled_from(['root ::= "a"', "root ::= ", "nope"])),
        "min_tokens": maybe_junk(st.integers(min_value=0, max_value=4)),
        "ignore_eos": maybe_junk(st.booleans()),
        "skip_special_tokens": maybe_junk(st.booleans()),
        "continue_final_message": maybe_junk(st.booleans()),
        "separate_reasoning": maybe_junk(st.booleans()),
        "chat_template_kwargs": maybe_junk(
            st.fixed_dictionaries({}, optional={"enable_thinking": maybe_junk(st.booleans())})
        ),
        "reasoning_effort": maybe_junk(st.sampled_from(["low", "medium", "high", "nope"])),
        "user": maybe_junk(odd_text),
        "custom_logit_processor": custom_logit_processor,
        "custom_params": custom_params,
        "lora_path": lora_path,
    },
    {"max_tokens": small_tokens},
)

# --- /v1/completions ----------------------------------------------------------------------

completions = body(
    {
        "model": maybe_junk(st.just("default"), 8),
        "prompt": maybe_junk(
            st.one_of(
                odd_text,
                st.lists(odd_text, min_size=0, max_size=3),
                token_ids,
                st.lists(token_ids, min_size=0, max_size=3),
            ),
            8,
        ),
    },
    {
        "temperature": temperature,
        "top_p": unit,
        "top_k": maybe_junk(st.integers(min_value=-1, max_value=50)),
        "n": small_n,
        "best_of": small_n,
        "echo": maybe_junk(st.booleans()),
        "logprobs": maybe_junk(st.integers(min_value=0, max_value=5)),
        "suffix": maybe_junk(odd_text),
        "stop": stop,
        "seed": seed,
        "stream": maybe_junk(st.booleans()),
        "stream_options": maybe_junk(
            st.fixed_dictionaries({"include_usage": maybe_junk(st.booleans())})
        ),
        "frequency_penalty": penalty,
        "presence_penalty": penalty,
        "logit_bias": maybe_junk(
            st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3)
        ),
        "json_schema": maybe_junk(st.sampled_from(['{"type": "object"}', "{", '{"type": 1}'])),
        "regex": maybe_junk(regex),
        "response_format": response_format,
        "min_tokens": maybe_junk(st.integers(min_value=0, max_value=4)),
        "stop_token_ids": maybe_junk(token_ids),
        "ignore_eos": maybe_junk(st.booleans()),
    },
    {"max_tokens": small_tokens},
)

# --- /v1/messages -------------------------------------------------------------------------

anth_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe_junk(odd_text)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": maybe_junk(odd_text),
            "name": maybe_junk(names),
            "input": maybe_junk(st.dictionaries(odd_text, odd_text, max_size=2)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": maybe_junk(odd_text),
            "content": maybe_junk(odd_text),
        },
        optional={"is_error": maybe_junk(st.booleans())},
    ),
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": maybe_junk(odd_text)},
        optional={"signature": maybe_junk(odd_text)},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "redacted_thinking", "nope"])},
        optional={"source": junk, "data": junk},
    ),
)
anth_message = st.fixed_dictionaries(
    {
        "role": maybe_junk(st.sampled_from(["user", "assistant"])),
        "content": maybe_junk(st.one_of(odd_text, st.lists(anth_block, max_size=3))),
    }
)
anth_tool = st.one_of(
    st.fixed_dictionaries(
        {
            "name": maybe_junk(names),
            "input_schema": clean_body.flatmap(lambda c: good_schemas if c else json_schemas),
        },
        optional={
            "description": odd_text,
            "type": st.sampled_from(["custom", "nope"]),
            "strict": maybe_junk(st.booleans()),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["web_search_20250305", "bash_20250124", "computer_1", "x"])},
        optional={"name": maybe_junk(names)},
    ),
)
messages = body(
    {
        "model": maybe_junk(st.just("default"), 8),
        "messages": clean_body.flatmap(
            lambda c: (
                st.lists(user_turn, min_size=1, max_size=2)
                if c
                else maybe_junk(st.lists(anth_message, min_size=0, max_size=4), 8)
            )
        ),
    },
    {
        "system": maybe_junk(
            st.one_of(
                odd_text,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text})),
            )
        ),
        "temperature": maybe_junk(st.floats(min_value=0, max_value=1)),
        "top_p": unit,
        "top_k": maybe_junk(st.integers(min_value=0, max_value=50)),
        "stop_sequences": maybe_junk(st.lists(odd_text, max_size=5)),
        "stream": maybe_junk(st.booleans()),
        "metadata": maybe_junk(st.fixed_dictionaries({"user_id": maybe_junk(odd_text)})),
        "tools": maybe_junk(st.lists(anth_tool, max_size=3)),
        "tool_choice": maybe_junk(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "nope"])},
                optional={
                    "name": maybe_junk(names),
                    "disable_parallel_tool_use": maybe_junk(st.booleans()),
                },
            )
        ),
        "thinking": maybe_junk(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "adaptive", "nope"])},
                optional={
                    "budget_tokens": maybe_junk(st.integers(min_value=0, max_value=8)),
                    "display": maybe_junk(st.sampled_from(["summarized", "omitted", "x"])),
                },
            )
        ),
    },
    {"max_tokens": small_tokens},
)

# --- /generate ----------------------------------------------------------------------------

sampling_params = st.fixed_dictionaries(
    {"max_new_tokens": small_tokens},
    optional={
        "min_new_tokens": maybe_junk(st.integers(min_value=0, max_value=4)),
        "temperature": temperature,
        "top_p": unit,
        "top_k": maybe_junk(st.integers(min_value=-1, max_value=50)),
        "min_p": unit,
        "frequency_penalty": penalty,
        "presence_penalty": penalty,
        "repetition_penalty": maybe_junk(st.floats(min_value=0, max_value=2)),
        "stop": stop,
        "stop_token_ids": maybe_junk(token_ids),
        "ignore_eos": maybe_junk(st.booleans()),
        "n": small_n,
        "regex": maybe_junk(regex),
        "json_schema": maybe_junk(st.sampled_from(['{"type": "object"}', "{", '{"type": 1}'])),
        "ebnf": maybe_junk(st.sampled_from(['root ::= "a"', "root ::= ", "nope"])),
        "skip_special_tokens": maybe_junk(st.booleans()),
        "custom_params": custom_params,
        "nope": junk,
    },
)
generate = st.one_of(
    body(
        {"text": maybe_junk(st.one_of(odd_text, st.lists(odd_text, max_size=3)), 8)},
        {
            "stream": maybe_junk(st.booleans()),
            "return_logprob": maybe_junk(st.booleans()),
            "top_logprobs_num": maybe_junk(st.integers(min_value=0, max_value=5)),
            "logprob_start_len": maybe_junk(st.integers(min_value=-1, max_value=4)),
            "return_text_in_logprobs": maybe_junk(st.booleans()),
            "rid": maybe_junk(odd_text),
            "custom_logit_processor": custom_logit_processor,
            "lora_path": lora_path,
            "image_data": media,
            "audio_data": media,
            "video_data": media,
        },
        {"sampling_params": st.one_of(sampling_params, st.lists(sampling_params, max_size=3))},
    ),
    body(
        {"input_ids": maybe_junk(st.one_of(token_ids, st.lists(token_ids, max_size=3)), 8)},
        {
            "stream": maybe_junk(st.booleans()),
            "return_logprob": maybe_junk(st.booleans()),
            "top_logprobs_num": maybe_junk(st.integers(min_value=0, max_value=5)),
            "token_ids_logprob": maybe_junk(token_ids),
        },
        {"sampling_params": sampling_params},
    ),
)

BODIES = {
    "/v1/chat/completions": chat,
    "/v1/completions": completions,
    "/v1/messages": messages,
    "/generate": generate,
}
requests_ = st.sampled_from(ROUTES).flatmap(lambda r: BODIES[r].map(lambda b: (r, b)))
