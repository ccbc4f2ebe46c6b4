"""Audits ``s3ac-train rehearse`` runs over the trainer's own code on CPU ranks: each rank's collectives
(``collectives``), a short process-group timeout with a slow rank-0 engine (``pg_timeout``) and the bytes each
model keeps per phase (``residency``)."""
