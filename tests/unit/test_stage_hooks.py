"""runtime.stage.CallHooks: the one owned list of hooks around a stage's methods ([Note: stage call hooks])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_pipe.runtime.stage import CallHooks


class Stage(CallHooks):
    def forward_one_chunk(self, mb: int, args: Any = None) -> str:
        return f"F{mb}"


def _logging(name: str, log: list[str]) -> Callable[..., Any]:
    def hook(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        log.append(f"{name}>{args[0]}")
        result = run()
        log.append(f"<{name}")
        return result
    return hook


def test_the_last_hook_is_outermost_and_removing_one_keeps_the_others() -> None:
    stage, log = Stage(), []
    remove_a = stage.add_call_hook("forward_one_chunk", _logging("a", log))
    remove_b = stage.add_call_hook("forward_one_chunk", _logging("b", log))
    assert stage.forward_one_chunk(3) == "F3"
    assert log == ["b>3", "a>3", "<a", "<b"]
    remove_a()
    log.clear()
    assert stage.forward_one_chunk(4) == "F4" and log == ["b>4", "<b"]
    remove_b()
    assert "forward_one_chunk" not in vars(stage)  # the last removed: the class method again, untouched
    remove_b()  # removing twice is harmless


def test_an_earlier_instance_attribute_is_put_back() -> None:
    stage = Stage()
    stage.forward_one_chunk = lambda mb, args=None: "earlier"  # type: ignore[method-assign]
    remove = stage.add_call_hook("forward_one_chunk", lambda run, args, kwargs: run() + "!")
    assert stage.forward_one_chunk(0) == "earlier!"
    remove()
    assert stage.forward_one_chunk(0) == "earlier"
