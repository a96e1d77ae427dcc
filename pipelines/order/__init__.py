"""Rows grouped by prompt prefix: a job whose rows share long prompt heads runs them head by
head, so the engine's prefix cache computes each head once, and writes its output back in
input order.

- ``heads.py``: each row's head hashes (its rendered prompt's token ids), and the share of
  prompt tokens in shared heads;
- ``grouped.py``: the decision, the copy of the input in head order that the job reads, and the
  output put back in input order before the commit.
"""
