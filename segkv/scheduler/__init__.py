"""Continuous-batching decisions (CPU only)."""

from segkv.scheduler.scheduler import Scheduler, SchedulerConfig, StepDecision

__all__ = ["Scheduler", "SchedulerConfig", "StepDecision"]
