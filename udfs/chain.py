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


class Chain:
    """``map_batches`` callable class: ``stages`` is a list of ``(class, kwargs)``; a call runs
    a batch through each in turn. Thread-safe when every stage is (several blocks in flight
    call it from several threads)."""

    def __init__(self, stages: list[tuple[type, dict]]):
        self.stages = [cls(**kwargs) for cls, kwargs in stages]

    def __call__(self, batch):
        for stage in self.stages:
            batch = stage(batch)
        return batch

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
