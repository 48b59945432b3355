"""The names fp4pass gives its temporaries (shared by :mod:`fp4pass.io.stale` and :mod:`fp4pass.io.swap`)."""

#: every temporary folder fp4pass makes starts so; no output may be named so
TMP_PREFIX = ".fp4pass-tmp-"
