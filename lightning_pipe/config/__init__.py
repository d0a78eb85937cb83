"""Settings: what a user chooses (:class:`PipelineConfig`, checked on plain data before any rank waits on another),
where each one is changed (:data:`SETTINGS`) and the one error format (:func:`config_error`)."""

from lightning_pipe.config.markdown import settings_markdown
from lightning_pipe.config.pipeline import (
    COMPILE_KEYS,
    MEASURED_PARTITIONS,
    PARTITION_METHODS,
    LayerChoice,
    PartitionSpec,
    PipelineConfig,
    check_partition,
)
from lightning_pipe.config.settings import SETTINGS, PipelineConfigError, Setting, config_error, describe_setting

__all__ = ["COMPILE_KEYS", "MEASURED_PARTITIONS", "PARTITION_METHODS", "SETTINGS", "LayerChoice", "PartitionSpec",
           "PipelineConfig", "PipelineConfigError", "Setting", "check_partition", "config_error", "describe_setting",
           "settings_markdown"]
