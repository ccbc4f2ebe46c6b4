"""s3ac-plan: will an RL job (actor + critic + rollout engine) fit, per GPU and per phase, and on which layout?

Modules: ``params`` (exact parameters per rank from the converter's plan), ``memory`` (the memory model,
every constant in ``constants``), ``search`` (layout enumeration and ranking), ``preflight`` (the
trainer's check), ``cli`` (the ``s3ac-plan`` command). Formulas: docs/planner.md.
"""
