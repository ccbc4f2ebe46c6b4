"""One RL step: the Trainer, its rollout sources and phases, the models' placement and the weight path."""
