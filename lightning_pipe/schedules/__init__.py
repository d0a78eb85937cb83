"""Schedules: the registry of specs and plans (``plan``), replay as data (``simulate``), action lists (``custom``).

A new schedule is one file here plus a Hydra config: a :class:`ScheduleSpec` registered below.
"""

from lightning_pipe.schedules.chimera import CHIMERA
from lightning_pipe.schedules.custom import CUSTOM
from lightning_pipe.schedules.pipedream import PIPEDREAM, PIPEDREAM_2BW
from lightning_pipe.schedules.plan import (
    SchedulePlan,
    ScheduleSpec,
    available_schedules,
    build_torch_schedule,
    check_schedule_settings,
    check_split_backward,
    check_torch_runs,
    compute_order,
    get_schedule_spec,
    plan_schedule,
    register_schedule,
)
from lightning_pipe.schedules.simulate import ScheduleDeadlock, SimulatedStep, simulate

register_schedule(CUSTOM)
register_schedule(PIPEDREAM_2BW)
register_schedule(PIPEDREAM)
register_schedule(CHIMERA)

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
]
