"""The tuning worker: claims jobs for this GPU environment, autotunes, verifies, signs and publishes plans.

Importing this package needs neither torch nor cudnn; :class:`GpuTuner` imports them on first use.
"""

from .jobs_api import JobsApi
from .loop import Worker, WorkerStats, check_worker_id, default_worker_id, stop_on_signals
from .spool import Spool, SpoolEntry
from .tuner import GpuTuner, TunedResult, Tuner
from .upload import upload_tuned

__all__ = [
    "GpuTuner", "JobsApi", "Spool", "SpoolEntry", "TunedResult", "Tuner", "Worker", "WorkerStats", "check_worker_id",
    "default_worker_id", "stop_on_signals", "upload_tuned",
]
