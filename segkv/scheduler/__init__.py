"""Continuous-batching decisions (CPU only)."""

from segkv.scheduler.scheduler import Schedulable, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Schedulable", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
