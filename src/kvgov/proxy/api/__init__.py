"""The control plane: a FastAPI app on its own port (health, readiness, metrics, and the
compliance API routers other modules add)."""
