"""overnight's pipeline: config, reading and writing, the job's assembly, the CLI.

    from pipelines import add_stages, run_dataframe, load_config, run_job
"""

from pipelines.api import add_stages, run_dataframe
from pipelines.batchfile.run import run_batch_file
from pipelines.config import JobConfig, load_config
from pipelines.errors import ConfigError, JobError
from pipelines.job.pipeline import run_job
from pipelines.job.summary import RunSummary
from pipelines.report.report_text import report_lines

__all__ = ["ConfigError", "JobConfig", "JobError", "RunSummary", "add_stages", "load_config",
           "report_lines", "run_batch_file", "run_dataframe", "run_job"]
