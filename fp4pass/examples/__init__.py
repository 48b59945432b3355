"""Builders of example models that ship with fp4pass (``python -m fp4pass.examples.gpt_oss_tiny OUTDIR``)."""
