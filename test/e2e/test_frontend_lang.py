"""An SGLang frontend-language program run against the real server through RuntimeEndpoint.

The program uses ``gen`` (with ``max_tokens`` and a stop string), ``select`` among choices and a
two-way ``fork`` joined back into the main state; the model has random weights, so the test
checks the structure of the results.
"""

from __future__ import annotations

import sglang as sgl

CHOICES = ["good", "bad", "neutral"]


@sgl.function
def plan(s, topic):
    s += "Topic: " + topic + "\n"
    s += "Mood: " + sgl.select("mood", choices=CHOICES) + "\n"
    branches = s.fork(2)
    for i, b in enumerate(branches):
        b += f"Idea {i + 1}: " + sgl.gen("idea", max_tokens=6, temperature=0)
    metas = [b.get_meta_info("idea") for b in branches]
    branches.join()  # gathers each branch's "idea" into a list in the main state
    s += "Ideas: " + " | ".join(s["idea"]) + "\n"
    s += "Summary: " + sgl.gen("summary", max_tokens=5, stop="\n")
    return metas


def test_program(server):
    backend = sgl.RuntimeEndpoint(server.url)
    state = plan.run(topic="cats", backend=backend)
    assert state.error() is None, state.error()
    text = state.text()

    assert state["mood"] in CHOICES
    assert text.startswith(f"Topic: cats\nMood: {state['mood']}\n")

    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 2
    assert all(isinstance(i, str) for i in ideas)
    assert f"Ideas: {ideas[0]} | {ideas[1]}\n" in text
    for meta in state.ret_value:
        assert 0 < meta["completion_tokens"] <= 6
        assert meta["prompt_tokens"] > 0

    summary = state["summary"]
    assert isinstance(summary, str) and "\n" not in summary
    assert text.endswith("Summary: " + summary)
    meta = state.get_meta_info("summary")
    assert 0 < meta["completion_tokens"] <= 5
    assert meta["finish_reason"]["type"] in ("length", "stop")
