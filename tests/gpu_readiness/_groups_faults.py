"""Faults injected into the rehearsal's groups phase (tests/gpu_readiness/test_rehearse.py): rank bodies the ranks
import by name, so this module imports nothing heavy."""


def rank_3_holds_another_expert_count(spec):
    """The groups phase's rank body with rank 3's model config off by one expert per rank (8 more experts: 17 per EP 8
    rank for the 30B's 128), as a rank started from another config.json would be."""
    import copy

    import torch.distributed as dist

    import megatron_s3ac.trainer.rehearse_groups as rg

    if dist.get_rank() == 3:
        spec = copy.deepcopy(spec)
        spec["hf"]["num_experts"] += 8
    return rg._rank(spec)


def rank_5_without_the_recompute(spec):
    """Rank 5 built without ``train.recompute: full`` (another config on one rank): the others re-run the MoE layer's
    forward in their backward (its all-to-alls again), rank 5 goes on to the gradient reduce."""
    import copy

    import torch.distributed as dist

    import megatron_s3ac.trainer.rehearse_groups as rg

    if dist.get_rank() == 5:
        spec = copy.deepcopy(spec)
        spec["recompute"]["recompute"] = "none"
    return rg._rank(spec)
