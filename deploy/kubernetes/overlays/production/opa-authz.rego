# Who may use OPA's own REST API in the pod (opa run --authentication=token
# --authorization=basic; docs/deploy.md, "OPA as its own sidecar, with bundles"). Every
# container of the pod shares its loopback, vLLM's too: without this, anything there could read
# the policy and its data (GET /v1/data: tenants, engines, labels), ask any decision and write
# policies and data.
#
# Loaded from this file (ConfigMap kvgov-opa), not from the bundle: the kvgov bundle's roots
# (bundle.manifest: ["kvgov"]) leave data.system to it. A bundle built without those roots owns
# every path and deletes this policy when it activates; OPA then refuses every request (fail
# closed: kvgov denies every operation with opa_bad_status:500).
#
# Default deny. Allowed, and nothing else:
#   - GET /health (the probes, on the diagnostic port; newer OPA releases authorize that port
#     too), without a token: it tells only whether OPA and its bundle are ready;
#   - kvgov's decisions, POST /v1/data/kvgov/authz/decision, with the pod's token (Secret
#     kvgov-opa-token: this container's KVGOV_OPA_TOKEN, kvgov's policy.opa_token_file) or,
#     while that token is being rotated, the next one (the Secret's optional key `next`:
#     KVGOV_OPA_TOKEN_NEXT; docs/deploy.md, "Rotating OPA's token").
# Not the data or the policies (read or write), not a query, a compile, the config or status.
package system.authz

import rego.v1

default allow := false

allow if {
	input.method == "GET"
	input.path == ["health"]
}

allow if {
	input.method == "POST"
	input.path == ["v1", "data", "kvgov", "authz", "decision"]
	kvgov_token
}

# The bearer token is kvgov's: the Secret's `token`, or its `next` during a rotation. OPA
# reads its environment once, at start: a rotation first gives every OPA the next token (key
# `next`, a rolling restart), then kvgov (key `token`: its file follows the Secret, no
# restart), then drops the old one (key `next` removed, a rolling restart). Each expected one
# stays a local (no rule holds it, so no path of data.system names it); one shorter than 32
# characters (unset, empty) admits no one. Both are compared as SHA-256 digests in constant
# time: how long the comparison takes tells nothing of the token's characters or its length.
kvgov_token if {
	some name in ["KVGOV_OPA_TOKEN", "KVGOV_OPA_TOKEN_NEXT"]

	# kvgov strips its file's surrounding whitespace; so does this side (a Secret made with
	# --from-file often ends in a newline, which would otherwise refuse kvgov for ever)
	raw := opa.runtime().env[name]
	is_string(raw)
	expected := trim_space(raw)
	count(expected) >= 32
	is_string(input.identity)
	crypto.hmac.equal(crypto.sha256(input.identity), crypto.sha256(expected))
}
