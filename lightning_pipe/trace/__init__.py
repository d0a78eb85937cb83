"""What really ran in a pipeline step: per-rank records, the measured bubble, Chrome trace / PNG export.

``records`` is the plain data (and [Note: measured bubble]); ``recorder`` wraps this rank's torch stage methods while
a step is recorded ([Note: how the trace is recorded]); ``export`` turns records into files;
``python -m lightning_pipe.trace`` is the command line.
"""

from lightning_pipe.trace.export import (
    COLORS,
    chrome_trace,
    plot_timeline,
    summary,
    write_chrome_trace,
)
from lightning_pipe.trace.recorder import StepRecorder
from lightning_pipe.trace.records import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KIND_NAMES,
    RECORDS_VERSION,
    Slice,
    StepRecord,
    by_step,
    load_records,
    pipeline_bubble,
    save_records,
)

__all__ = [
    "COLORS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KIND_NAMES",
    "RECORDS_VERSION",
    "Slice",
    "StepRecord",
    "StepRecorder",
    "by_step",
    "chrome_trace",
    "load_records",
    "pipeline_bubble",
    "plot_timeline",
    "save_records",
    "summary",
    "write_chrome_trace",
]
