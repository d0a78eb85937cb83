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


def test_tracked_outputs_become_detachable_aliases_and_the_rest_stay() -> None:
    """[Note: split backward detaches stage outputs]: the forward hook a stage gets under a split backward."""
    import torch

    from lightning_pipe.runtime.stage import detachable_outputs

    x = torch.randn(4, 3, requires_grad=True)
    tracked, mask, view = x * 2, torch.ones(4, 3), (x * 3)[:, :2]
    assert detachable_outputs(torch.nn.Identity(), (), (mask, view)) is None  # nothing torch detaches wrongly
    out = detachable_outputs(torch.nn.Identity(), (), (tracked, mask, view))
    assert out[1] is mask and out[2] is view
    assert out[0] is not tracked and out[0]._base is None and out[0].data_ptr() == tracked.data_ptr()
    out[0].detach_()
    assert tracked.grad_fn is not None  # the original keeps its history
    single = detachable_outputs(torch.nn.Identity(), (), tracked)
    assert isinstance(single, torch.Tensor) and single is not tracked
