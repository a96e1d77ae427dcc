"""Where an engine's replica runs, as the run report names it: its node, its Ray actor and
its accelerators (a tensor-parallel replica's found through its placement group)."""

from __future__ import annotations


def replica_label() -> dict:
    """This replica as the run report names it: node address, actor, accelerators."""
    import ray

    if not ray.is_initialized():
        return {"node": "local", "actor": None, "gpus": []}
    ctx = ray.get_runtime_context()
    actor = ctx.get_actor_id()
    gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])] or _group_gpus()
    return {"node": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id()[:12],
            "actor": actor[:12] if actor else None, "gpus": sorted(gpus)}


def _group_gpus() -> list[str]:
    """The GPU ids of this actor's placement group (tensor parallel), found by a short task
    on each of its GPU bundles: the actor itself holds none of them."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    if group is None:
        return []

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_ids() -> list:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    probes = [gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote()
        for i, bundle in enumerate(group.bundle_specs) if bundle.get("GPU")]
    return [str(g) for ids in ray.get(probes) for g in ids]
