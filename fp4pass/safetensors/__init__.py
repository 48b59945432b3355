"""The safetensors floor: reading what a stranger hands in as a checkpoint, below every front door.

- ``files``: the safetensors file format, every header checked before a tensor is read, read and written one
  tensor at a time (:class:`~fp4pass.safetensors.files.SafetensorsFile`, ``ShardWriter``, ``CheckpointError``);
- ``catalog``: a checkpoint folder (config.json, the index, its shards) read under the same bounds;
- ``patterns``: the exclusion globs and regexes of a checkpoint's config, matched with bounded methods;
- ``hub``: Hugging Face model IDs resolved to a local snapshot, the cache's files checked before they are read.

``fp4pass.checkpoint`` (conversion, calibration, validation, diff) and ``fp4pass.fx.gpt_oss`` (the torch.fx
door's gpt-oss loader) both read through it, so a header that lies is refused the same way whichever door it
came in by. It imports nothing of the doors (tests/project/test_layering.py).
"""
