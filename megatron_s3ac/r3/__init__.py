"""R3: rollout routing replay. The rollout engine's expert choices, replayed in megatron-core's router.

storage  compact dtype, pack/unpack, bytes accounting of per-sample routes   (numpy only)
align    sample routes [T-1, L, K] -> this rank's router rows: padding, packing, SP, PP, dense layers
config   the on/off switch (on by default for MoE models); refusals of settings that skip replay
replay   drive megatron's RouterReplay over forward_backward (REPLAY_FORWARD / REPLAY_BACKWARD)
metrics  native-vs-rollout routing agreement (RECORD) and the train-vs-rollout log-prob gap

Import the submodules directly (this package imports nothing, so a rollout process can use
``storage`` without loading megatron-core). Floor: between rollout and trainer; never imports trainer.
"""
