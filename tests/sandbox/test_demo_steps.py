"""The demos' shared step runner (:mod:`dradriver.sandbox.demos.narrator`): a scenario is a list of named steps that
the runner numbers, narrates and stops at the first failure, after the scenario's cleanup."""

from __future__ import annotations

import asyncio
import io

import pytest

from dradriver.sandbox.demos.narrator import DemoError, Narrator, Step, run_steps, run_steps_async


def _narrator() -> Narrator:
    return Narrator(output="text", stream=io.StringIO())


def test_steps_are_numbered_from_first_announced_and_timed_in_order() -> None:
    narrator, ran = _narrator(), []
    run_steps(narrator, [Step("one", lambda: ran.append("one")),
                         Step("two", lambda: narrator.say("said in two"))], first=3)
    assert ran == ["one"]
    assert [(s["step"], s["title"]) for s in narrator.steps] == [(3, "one"), (4, "two")]
    assert narrator.steps[1]["details"] == [{"text": "said in two"}]
    out = narrator.stream.getvalue()
    assert "== 3. one" in out and "== 4. two" in out and out.count(" ms)") == 2


def test_the_first_failing_step_ends_the_run_after_the_cleanup_and_is_left_last_without_its_time() -> None:
    narrator, ran = _narrator(), []

    def fail() -> None:
        raise DemoError("the driver did not deliver")

    with pytest.raises(DemoError, match="did not deliver"):
        run_steps(narrator, [Step("ok", lambda: ran.append("ok")), Step("broken", fail),
                             Step("never", lambda: ran.append("never"))],
                  cleanup=lambda: ran.append("cleanup"))
    assert ran == ["ok", "cleanup"]
    assert [s["title"] for s in narrator.steps] == ["ok", "broken"]  # what `dradriver demo` names as failed
    assert narrator.steps[-1]["seconds"] == 0.0


def test_async_steps_are_awaited_before_the_next_and_a_title_can_use_what_an_earlier_step_found() -> None:
    narrator, found, cleaned = _narrator(), {}, []

    async def find() -> None:
        await asyncio.sleep(0)
        found["channel"] = 7

    async def cleanup() -> None:
        cleaned.append(True)

    async def fail() -> None:
        raise DemoError("refused")

    async def body() -> None:
        await run_steps_async(narrator, [Step("find", find),
                                         Step(lambda: f"use channel {found['channel']}", lambda: None),
                                         Step("fail", fail)], cleanup=cleanup)

    with pytest.raises(DemoError, match="refused"):
        asyncio.run(body())
    assert [s["title"] for s in narrator.steps] == ["find", "use channel 7", "fail"]
    assert cleaned == [True]
