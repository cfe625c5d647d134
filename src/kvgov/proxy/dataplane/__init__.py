"""The data plane: the kvgov wire server, the ``lm://`` listener, the governed pipeline, the
buffer pool and metrics. KV bytes never pass through HTTP."""
