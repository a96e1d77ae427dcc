"""Several ``map_batches`` callables run as one, in one actor: each one's output is the next
one's input.

The job runs its engine stage and its writer this way (pipelines/pipeline.py): a block's rows
are written as parts where they were generated, and only a small record per part leaves the
engine's actor, instead of every output row travelling through the object store to a writer
actor of its own (one more process on the machine, whose wake-ups and copies a saturated
engine pays for). Each stage is built in the actor from ``(class, keyword arguments)``, as Ray
Data builds a callable class from ``fn_constructor_kwargs``.
"""

from __future__ import annotations

import numpy as np

from udfs import columns


class Chain:
    """``map_batches`` callable class: ``stages`` is a list of ``(class, kwargs)``; a call runs
    a batch through each in turn. Thread-safe when every stage is (several blocks in flight
    call it from several threads).

    With ``cut`` (the plan's block starts, and its rows per block), a batch is first cut into
    the plan's blocks: Ray Data moves several of them in one of its blocks (pipelines/read.py:
    ``ray_block_rows``), while the engine takes one block at a time and the writer commits
    each as a part. The pieces' outputs are yielded one by one."""

    def __init__(self, stages: list[tuple[type, dict]],
                 cut: tuple[tuple[int, ...], int] | None = None):
        self.stages = [cls(**kwargs) for cls, kwargs in stages]
        self.starts, self.most = (None, None) if cut is None else \
            (np.asarray(cut[0], dtype=np.int64), cut[1])

    def __call__(self, batch):
        for piece in self.pieces(batch):
            for stage in self.stages:
                piece = stage(piece)
            yield piece

    def pieces(self, batch):
        """The batch's runs of rows of one plan block, each of at most ``most`` rows."""
        if self.starts is None or batch.num_rows == 0:
            yield batch
            return
        ordinals = batch.column(columns.ORDINAL).to_numpy()
        block = np.searchsorted(self.starts, ordinals, side="right")
        bounds = [0, *(np.flatnonzero(np.diff(block)) + 1).tolist(), batch.num_rows]
        for start, end in zip(bounds, bounds[1:]):
            for first in range(start, end, self.most):
                yield batch.slice(first, min(self.most, end - first))

    def close(self) -> None:
        for stage in self.stages:
            close = getattr(stage, "close", None)
            if close is not None:
                close()


def chain_named_for(stages: list[tuple[type, dict]]) -> type[Chain]:
    """``Chain``, under the name of its first stage's class: Ray Data names the stage and its
    actors' processes after the callable (``ray::MapWorker(MapBatches(Predictor))`` in ``ps``),
    and a user looking for the engine's process finds it as before."""
    first = stages[0][0].__name__
    return type(first, (Chain,), {"__doc__": Chain.__doc__, "__module__": __name__})
