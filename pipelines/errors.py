"""Job errors: a user's mistake or an environment problem that stops the job before GPU time.

Row errors are not exceptions: they are values in a row's ``error`` column (see udfs.columns).
"""


class JobError(Exception):
    """A problem that stops the whole job. Its message is one line that names the culprit."""


class ConfigError(JobError):
    """The config file or an override is invalid."""


class InputError(JobError):
    """The input table cannot be read or does not fit the job."""


class OutputError(JobError):
    """The output path cannot be written as asked (exists, belongs to another job...)."""
