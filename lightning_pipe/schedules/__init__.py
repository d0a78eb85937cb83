"""Schedules: the registry of specs and plans (``plan``), replay as data (``simulate``), action lists (``custom``).

A new schedule is one file here plus a Hydra config: a :class:`ScheduleSpec` registered below.
"""

from lightning_pipe.schedules.chimera.spec import CHIMERA
from lightning_pipe.schedules.custom import CUSTOM
from lightning_pipe.schedules.pipedream.spec import PIPEDREAM, PIPEDREAM_2BW
from lightning_pipe.schedules.registry import (
    SchedulePlan,
    ScheduleSpec,
    available_schedules,
    build_torch_schedule,
    check_schedule_settings,
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
    "compute_order",
    "get_schedule_spec",
    "plan_schedule",
    "register_schedule",
    "simulate",
]
