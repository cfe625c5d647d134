"""Per-tenant envelope encryption: data keys, the KEK provider, the sealed chunk format."""
