"""Several ``map_batches`` callables run as one, in one actor: each one's output is the next
one's input.

The job runs its engine stage and its writer this way (pipelines/job/pipeline.py): a block's rows
are written as parts where they were generated, and only a small record per part leaves the
engine's actor, instead of every output row travelling through the object store to a writer
actor of its own (one more process on the machine, whose wake-ups and copies a saturated
engine pays for). Each stage is built in the actor from ``(class, keyword arguments)``, as Ray
Data builds a callable class from ``fn_constructor_kwargs``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from udfs import columns


class Chain:
    """``map_batches`` callable class: ``stages`` is a list of ``(class, kwargs)``; a call runs
    a batch through each in turn. Thread-safe when every stage is (several blocks in flight
    call it from several threads).

    With ``cut`` (the plan's block starts, and its rows per block), a batch is first cut into
    the plan's blocks: Ray Data moves several of them in one of its blocks (pipelines/read/sizes.py:
    ``ray_block_rows``), and its blocks need not start where the plan's do, while the engine
    takes one block at a time and the writer commits each as a part. The pieces run at once,
    up to ``at_once`` of them in the actor over all its calls (the blocks in flight it was
    given): one run after another, a batch's later pieces reached the engine only as the
    earlier ones finished, and a small job's engine ran half empty at times. Their outputs are
    yielded in order."""

    def __init__(self, stages: list[tuple[type, dict]],
                 cut: tuple[tuple[int, ...], int] | None = None, at_once: int = 1):
        self.stages = [cls(**kwargs) for cls, kwargs in stages]
        self.starts, self.most = (None, None) if cut is None else \
            (np.asarray(cut[0], dtype=np.int64), cut[1])
        self.pool = ThreadPoolExecutor(max(at_once, 1), thread_name_prefix="piece") \
            if cut is not None and at_once > 1 else None

    def __call__(self, batch):
        pieces = list(self.pieces(batch))
        if self.pool is None or len(pieces) == 1:
            for piece in pieces:
                yield self.run(piece)
            return
        for done in [self.pool.submit(self.run, piece) for piece in pieces]:
            yield done.result()

    def run(self, piece):
        """A piece through every stage."""
        for stage in self.stages:
            piece = stage(piece)
        return piece

    def pieces(self, batch):
        """The batch's runs of rows of one plan block, each of at most ``most`` rows."""
        if self.starts is None or batch.num_rows == 0:
            yield batch
            return
        places = batch.column(columns.place_column(batch)).to_numpy()
        block = np.searchsorted(self.starts, places, side="right")
        bounds = [0, *(np.flatnonzero(np.diff(block)) + 1).tolist(), batch.num_rows]
        for start, end in zip(bounds, bounds[1:]):
            for first in range(start, end, self.most):
                yield batch.slice(first, min(self.most, end - first))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
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
