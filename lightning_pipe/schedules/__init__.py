"""Schedules: the registry of specs and plans (``registry``), replay as data (``simulate``), action lists (``custom``),
one folder per seed schedule (``pipedream/``, ``pipemare/``, ``chimera/``) and the memory-capped V schedules
(``controllable``).

A new schedule is one file (or folder) here plus a Hydra config: a :class:`ScheduleSpec` registered below. The
contract it fills, :class:`ScheduleSpec` / :class:`SchedulePlan`, is the runtime's (``lightning_pipe/runtime/spec.py``).
"""

from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec, build_torch_schedule
from lightning_pipe.schedules.chimera.spec import CHIMERA
from lightning_pipe.schedules.controllable import V_HALF, V_MIN
from lightning_pipe.schedules.custom import CUSTOM
from lightning_pipe.schedules.pipedream.spec import PIPEDREAM, PIPEDREAM_2BW
from lightning_pipe.schedules.pipemare.spec import PIPEMARE
from lightning_pipe.schedules.registry import (
    available_schedules,
    check_schedule_settings,
    check_split_backward,
    check_torch_runs,
    compute_order,
    get_schedule_spec,
    plan_schedule,
    register_schedule,
    split_backward_actions,
)
from lightning_pipe.schedules.simulate import ScheduleDeadlock, SimulatedStep, simulate

register_schedule(CUSTOM)
register_schedule(PIPEDREAM_2BW)
register_schedule(PIPEDREAM)
register_schedule(PIPEMARE)
register_schedule(CHIMERA)
register_schedule(V_HALF)
register_schedule(V_MIN)

__all__ = [
    "ScheduleDeadlock",
    "SchedulePlan",
    "ScheduleSpec",
    "SimulatedStep",
    "available_schedules",
    "build_torch_schedule",
    "check_schedule_settings",
    "check_split_backward",
    "check_torch_runs",
    "compute_order",
    "get_schedule_spec",
    "plan_schedule",
    "register_schedule",
    "simulate",
    "split_backward_actions",
]
