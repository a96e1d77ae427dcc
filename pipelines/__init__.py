"""overnight's pipeline: config, reading and writing, the job's assembly, the CLI.

    from pipelines import run_dataframe, load_config, run_job
"""

from pipelines.api import run_dataframe
from pipelines.batchfile.batch import run_batch_file
from pipelines.config import JobConfig, load_config
from pipelines.errors import JobError
from pipelines.job.pipeline import run_job
from pipelines.job.summary import RunSummary
from pipelines.report.run_report import report_lines

__all__ = ["JobConfig", "JobError", "RunSummary", "load_config", "report_lines",
           "run_batch_file", "run_dataframe", "run_job"]
