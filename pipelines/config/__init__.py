"""The job config: one validated pydantic model, loaded from YAML in one place.

Unknown keys are errors that name the key; every error is reported as one line.

- ``sections.py``: ``input``, ``model``, ``prompt``, ``sampling``, ``structured``, ``output``,
  ``resources``, ``report``;
- ``engine.py``: the ``engine`` section (vLLM in the job's actors, or an HTTP server);
- ``steps.py``: a job of steps;
- ``job.py``: ``JobConfig``, the whole job and the checks across its sections;
- ``load.py``: ``load_config``, YAML and ``--set`` overrides to a ``JobConfig``, errors in one line.
"""

from pipelines.config.engine import EngineConfig, HTTPEngineConfig, VLLMEngineConfig
from pipelines.config.job import DEFAULT_COLUMN, POOLING_TASKS, JobConfig
from pipelines.config.load import (apply_overrides, load_config, load_yaml, parse_override,
                                   read_yaml)
from pipelines.config.sections import (InputConfig, ModelConfig, OutputConfig, PricePerMTok,
                                       PromptConfig, ReportConfig, ResourcesConfig,
                                       SamplingConfig, StructuredConfig)
from pipelines.config.steps import STEP_NAME, StepConfig

__all__ = ["DEFAULT_COLUMN", "POOLING_TASKS", "STEP_NAME", "EngineConfig", "HTTPEngineConfig",
           "InputConfig", "JobConfig", "ModelConfig", "OutputConfig", "PricePerMTok",
           "PromptConfig", "ReportConfig", "ResourcesConfig", "SamplingConfig", "StepConfig",
           "StructuredConfig", "VLLMEngineConfig", "apply_overrides", "load_config",
           "load_yaml", "parse_override", "read_yaml"]
