"""``overnight serve``: the OpenAI Batch API (``/v1/files``, ``/v1/batches``) and Anthropic's
Message Batches API (``/v1/messages/batches``) on your own machine.

The server owns HTTP, state, access and the engine; every batch runs as ``overnight batch`` does:

- ``store``: files and batches in SQLite, file contents on disk, one owner (a key's hash) each;
- ``validate``: an input file checked the way the hosted API checks it before a batch runs;
- ``engine``: the resident engine, ``vllm serve`` on loopback, loaded once and shared;
- ``runner``: the queue, several batches at once on that engine, each in a batch worker
  (``worker``), or one at a time as an ``overnight batch`` child process with its own engine
  (``child``); ``results``: a batch's results counted, delivered and registered;
- ``processes``: those children's process groups and sessions, found and killed whole;
- ``app``: the FastAPI app assembled: ``keys`` (the key check), ``routes_files``,
  ``routes_batches``, ``routes_view`` (the pages), ``answers`` (OpenAI's error objects),
  ``body_limit``; ``anthropic``: the Message Batches routes, ``x-api-key`` and Anthropic's
  objects.
"""
