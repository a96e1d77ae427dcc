"""A large table's reuse: found and staged in one Ray task on the driver's node, its memory
apart from the driver's (pipelines/reuse/carry.py: LARGE_ROWS)."""

from __future__ import annotations

from pipelines.errors import JobError
from pipelines.reuse.find import plan_reuse
from pipelines.reuse.staging import stage_reused
from pipelines.storage import Location


def carry_over(plan, source: Location, layout, done: set[int]) -> tuple[dict, dict, str]:
    """``plan_reuse`` then ``stage_reused``: what was found (its record, and its line), and
    what was staged."""
    found = plan_reuse(plan, source)
    return found.record(), stage_reused(plan, found, layout, done), found.line()


def carry_over_on_ray(plan, source: Location, layout, done: set[int]) -> tuple[dict, dict, str]:
    """``carry_over`` in a Ray task on this node (where the staging folder and the local spill
    are), its memory apart from the driver's. A JobError in it is raised here as it was."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(carry_over).options(num_cpus=1, max_retries=0, scheduling_strategy=here)
    try:
        return ray.get(task.remote(plan, source, layout, done))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, JobError):
            raise cause from None
        raise
