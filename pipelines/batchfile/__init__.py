"""Batch files (OpenAI's and Anthropic's formats) in and out, run as jobs.

``overnight batch requests.jsonl -o results.jsonl`` runs a file written for the hosted Batch API
on the same pipeline as every other job (``run.py``):

1. ``prepare`` (``prepare.py``): the file is read one line at a time; each line is checked
   (``lines.py``: JSON, ``custom_id``, ``method``, ``url``, ``body``) and a runnable request
   becomes one row of a Parquet table of requests (messages or prompt, its own max_tokens and
   sampling as JSON). A line that cannot run goes to the error file instead, with its line
   number, ``custom_id`` when one could be read, a ``code`` and a ``message``. A repeated
   ``custom_id`` runs once; the repeat is an error.
2. the job: that table through Ray Data and the engine, like any table (resumable: the table and
   the job's parts live in a work directory beside the result file, ``RESULTS.overnight/``).
3. ``write_results`` (``results.py``): the job's Parquet parts, in input order, become result
   lines in the Batch output format (``envelopes.py``); rows that failed (a prompt too long, an
   engine error) join the error file.

Every input line with a readable ``custom_id`` ends in exactly one of the two files. The two
are one commit (``WRITTEN``): a kill leaves both or neither; a re-run completes a cut write.
Anthropic's Message Batches files (``anthropic.py``) have one result file that holds both.
"""
