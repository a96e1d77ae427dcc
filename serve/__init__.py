"""``overnight serve``: the OpenAI Batch API (``/v1/files``, ``/v1/batches``) on your own machine.

The server owns HTTP, state and access only; every batch runs as ``overnight batch`` does:

- ``store``: files and batches in SQLite, file contents on disk, one owner (a key's hash) each;
- ``validate``: an input file checked the way the hosted API checks it before a batch runs;
- ``runner``: batches FIFO, one at a time, each an ``overnight batch`` child process;
- ``app``: the FastAPI routes, bearer keys and OpenAI's error objects.
"""
