"""The weight-sync registry (strategy.py), the rank-0 path (weight_sync.py) and what every engine's stage-wise sync
shares: the whole-sync plan checked before anything moves (planned.py), small JSON messages between trainer ranks
(messages.py), the address and port of a weight-update group (rendezvous.py)."""
