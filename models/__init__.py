"""Deterministic builders of the example models: ``python -m models.build OUTDIR`` (see ``models.build``)."""
