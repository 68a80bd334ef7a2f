"""Layer 3: the scheduler, the one owner of request status, queues and progress."""

from tiered_kv.sched.config import SchedulerConfig
from tiered_kv.sched.output import SchedulerOutput
from tiered_kv.sched.scheduler import Scheduler
from tiered_kv.sched.status import RequestStatus

__all__ = ["RequestStatus", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
