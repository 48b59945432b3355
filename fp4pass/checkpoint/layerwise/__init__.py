"""A checkpoint's model run by transformers' own modeling code, one decoder layer at a time (:mod:`.model`)."""
