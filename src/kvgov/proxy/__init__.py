"""The sidecar: the data plane (kvgov wire + ``lm://``), the control plane and the app factory
that composes policy, ledger, keys and tiers (``kvgov.proxy.app.build_sidecar``)."""
