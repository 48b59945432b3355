"""A checkpoint's model run by transformers' own modeling code, one decoder layer at a time.

- :mod:`~fp4pass.checkpoint.layerwise.model`: which transformers model (the architecture, or the folder's own
  code under ``trust_remote_code``), its skeleton on the meta device, the checkpoint's names renamed to the
  model's, and the loader that fills a module's tensors from the shards;
- :mod:`~fp4pass.checkpoint.layerwise.decode`: MXFP4 weights decoded into the model's bf16 tensors, exactly;
- :mod:`~fp4pass.checkpoint.layerwise.runner`: the layer runner, its background prefetch, and the one loop over
  layers and batches that calibration (:mod:`fp4pass.checkpoint.calibration`) and the diff
  (:mod:`fp4pass.checkpoint.numerics`) visit, with the routed MoE forward that shows them each expert's rows;
- :mod:`~fp4pass.checkpoint.layerwise.hidden_states`: the hidden states between two layers, in memory or on disk.
"""
