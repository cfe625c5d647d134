"""Policy: every KV operation is decided by Rego policy, and the answer fails closed.

``interfaces`` is the contract the data plane builds against (:class:`PolicyInput`,
:class:`Decision`, :class:`PolicyEngine`, :class:`DecisionRecorder`); ``factory`` builds the
configured engine from :class:`kvgov.config.Settings`. Importing this package does nothing else.
"""
