# Rego unit tests for kvgov.authz: at least one per default rule.
#
# Run with `kvgov policy test` (through the configured engine) and by pytest through every
# engine available. Each test brings its own data document (_cfg), so the tests hold for the
# rules whatever data an operator deploys.
package kvgov.authz_test

import rego.v1

import data.kvgov.authz

_all_tiers := ["memory", "filesystem", "redis"]

_cfg := {
	"default_sensitivity": "internal",
	"tiers": _all_tiers,
	"classes": {
		"public": {"max_ttl_s": 86400, "tiers": _all_tiers, "scope": "tenant"},
		"internal": {"max_ttl_s": 21600, "tiers": _all_tiers, "scope": "tenant"},
		"confidential": {"max_ttl_s": 900, "tiers": ["memory", "filesystem"], "scope": "user"},
		"restricted": {"cacheable": false},
		"phi": {"max_ttl_s": 300, "tiers": ["memory"], "scope": "user", "requires_tenant_allow": true},
		"pci": {"max_ttl_s": 300, "tiers": ["memory"], "scope": "user", "requires_tenant_allow": true},
	},
	"tenants": {
		"acme": {
			"enabled": true,
			"engines": ["e1"],
			"allowed_labels": ["phi"],
			"tiers": ["memory", "filesystem"],
			"max_ttl_s": {"internal": 3600, "public": 999999},
		},
		"globex": {"enabled": true, "engines": ["*"]},
		"initech": {"enabled": false, "engines": ["e1"]},
		"hooli": {"enabled": true, "engines": ["e1"], "tiers": ["redis"]},
		"umbrella": {"engines": ["e1"]},
	},
}

_base := {
	"operation": "put",
	"tenant": "acme",
	"key": {"tenant": "acme", "user": null, "model": "m"},
	"actor": {"user": "u1", "engine": "e1", "listener": "kvgov"},
	"request": {"id": "r1", "sensitivity": "internal"},
	"tier": null,
	"entry": null,
}

_decide(overrides) := d if {
	d := authz.decision with input as object.union(_base, overrides) with data.kvgov.config as _cfg
}

_denied(overrides, reason) if {
	d := _decide(overrides)
	d.allowed == false
	reason in d.reasons
}

# --- the happy path ---------------------------------------------------------------------

test_internal_put_allowed_with_tiers_ttl_scope if {
	d := _decide({})
	d.allowed == true
	d.reasons == []
	d.tiers == ["filesystem", "memory"]
	d.ttl_s == 3600
	d.scope == "tenant"
	d.sensitivity == "internal"
}

# --- tenant and engine ------------------------------------------------------------------

test_missing_tenant_denied if _denied({"tenant": null}, "missing_tenant")

test_empty_tenant_denied if _denied({"tenant": ""}, "missing_tenant")

test_unknown_tenant_denied if _denied({"tenant": "nobody", "key": {"tenant": "nobody"}}, "unknown_tenant")

test_disabled_tenant_denied if _denied({"tenant": "initech", "key": {"tenant": "initech"}}, "tenant_disabled")

test_tenant_without_enabled_flag_denied if {
	_denied({"tenant": "umbrella", "key": {"tenant": "umbrella"}}, "tenant_disabled")
}

test_engine_not_allowed_denied if _denied({"actor": {"engine": "rogue"}}, "engine_not_allowed")

test_missing_engine_denied if _denied({"actor": {"engine": null}}, "engine_not_allowed")

test_wildcard_engine_allowed if {
	d := _decide({"tenant": "globex", "key": {"tenant": "globex"}, "actor": {"engine": "any"}})
	d.allowed == true
}

# the lm:// listener has no handshake: "*" does not admit it, a tenant must name its engine id
test_wildcard_does_not_admit_the_lm_listener if {
	_denied(
		{
			"tenant": "globex", "key": {"tenant": "globex"},
			"actor": {"user": null, "engine": "any", "listener": "lm"},
		},
		"engine_not_allowed",
	)
}

test_named_lm_engine_allowed if {
	d := _decide({"actor": {"user": null, "engine": "e1", "listener": "lm"}})
	d.allowed == true
}

# without an acting user (lm://) a user-tagged key is refused, whatever its class
test_lm_listener_never_touches_user_scoped_keys if {
	_denied(
		{
			"key": {"tenant": "acme", "user": "u1", "model": "m"},
			"actor": {"user": null, "engine": "e1", "listener": "lm"},
		},
		"user_scope_mismatch",
	)
}

test_listener_must_be_a_string if _denied({"actor": {"user": "u1", "engine": "e1", "listener": 7}}, "invalid_input:actor.listener")

# --- key tenant -------------------------------------------------------------------------

test_key_tenant_must_equal_tenant if _denied({"key": {"tenant": "globex"}}, "tenant_mismatch")

test_missing_key_tenant_denied if _denied({"key": {"tenant": null}}, "missing_key_tenant")

test_get_never_crosses_tenants if {
	_denied(
		{
			"operation": "get",
			"key": {"tenant": "globex"},
			"entry": {"owner": "u1", "scope_user": null, "sensitivity": "public"},
		},
		"tenant_mismatch",
	)
}

test_tenant_layer_reported_before_key_layer if {
	d := _decide({"tenant": "nobody", "key": {"tenant": "acme"}})
	d.reasons == ["unknown_tenant"]
}

# --- restricted, phi, pci ---------------------------------------------------------------

test_restricted_put_denied if _denied({"request": {"sensitivity": "restricted"}}, "not_cacheable:restricted")

test_restricted_entry_never_served if {
	_denied(
		{"operation": "get", "entry": {"owner": "u1", "scope_user": null, "sensitivity": "restricted"}},
		"not_cacheable:restricted",
	)
}

test_phi_denied_unless_tenant_allows if {
	_denied(
		{
			"tenant": "globex",
			"key": {"tenant": "globex", "user": "u1"},
			"request": {"sensitivity": "phi"},
		},
		"label_not_allowed:phi",
	)
}

test_pci_denied_unless_tenant_allows if {
	_denied({"key": {"user": "u1"}, "request": {"sensitivity": "pci"}}, "label_not_allowed:pci")
}

test_phi_allowed_user_scoped_when_tenant_allows if {
	d := _decide({"key": {"user": "u1"}, "request": {"sensitivity": "phi"}})
	d.allowed == true
	d.tiers == ["memory"]
	d.ttl_s == 300
	d.scope == "user"
}

# --- time to live -----------------------------------------------------------------------

# a tenant's cap of 0 for a class keeps nothing of it (it lowers the class's TTL to nothing)
test_a_tenant_ttl_cap_of_zero_denies_the_put if {
	cfg := json.patch(_cfg, [{"op": "add", "path": "/tenants/acme/max_ttl_s/internal", "value": 0}])
	d := authz.decision with input as _base with data.kvgov.config as cfg
	d.allowed == false
	"ttl_not_positive" in d.reasons
}

test_a_class_ttl_below_zero_denies_the_put if {
	cfg := json.patch(_cfg, [{"op": "add", "path": "/classes/public/max_ttl_s", "value": -1}])
	inp := object.union(_base, {"tenant": "globex", "key": {"tenant": "globex"}, "request": {"sensitivity": "public"}})
	d := authz.decision with input as inp with data.kvgov.config as cfg
	d.allowed == false
	"ttl_not_positive" in d.reasons
}

# --- confidential -----------------------------------------------------------------------

test_confidential_requires_user_scoped_key if {
	_denied({"request": {"sensitivity": "confidential"}}, "user_scope_required")
}

test_confidential_user_scoped_allowed if {
	d := _decide({"key": {"user": "u1"}, "request": {"sensitivity": "confidential"}})
	d.allowed == true
	d.tiers == ["filesystem", "memory"]
	d.ttl_s == 900
	d.scope == "user"
}

test_confidential_key_of_another_user_denied if {
	_denied({"key": {"user": "u2"}, "request": {"sensitivity": "confidential"}}, "user_scope_mismatch")
}

test_confidential_only_in_allowed_tiers if {
	_denied(
		{"key": {"user": "u1"}, "request": {"sensitivity": "confidential"}, "tier": "redis"},
		"tier_not_allowed",
	)
}

test_confidential_get_by_another_user_denied if {
	_denied(
		{
			"operation": "get",
			"key": {"user": "u1"},
			"actor": {"user": "u2"},
			"entry": {"owner": "u1", "scope_user": "u1", "sensitivity": "confidential"},
		},
		"user_scope_mismatch",
	)
}

test_exists_on_user_entry_by_another_user_denied if {
	_denied(
		{
			"operation": "exists",
			"key": {"user": "u1"},
			"actor": {"user": "u2"},
			"entry": {"owner": "u1", "scope_user": "u1", "sensitivity": "confidential"},
		},
		"user_scope_mismatch",
	)
}

test_get_uses_entry_sensitivity_not_request_label if {
	_denied(
		{
			"operation": "get",
			"actor": {"user": "u2"},
			"request": {"sensitivity": "public"},
			"entry": {"owner": "u1", "scope_user": null, "sensitivity": "confidential"},
		},
		"user_scope_required",
	)
}

# --- public / internal are shared within the tenant -------------------------------------

test_internal_entry_shared_across_users if {
	d := _decide({
		"operation": "get",
		"actor": {"user": "u2"},
		"entry": {"owner": "u1", "scope_user": null, "sensitivity": "internal"},
	})
	d.allowed == true
	d.scope == "tenant"
}

test_public_entry_shared_across_users if {
	d := _decide({
		"operation": "exists",
		"actor": {"user": "u9"},
		"entry": {"owner": "u1", "scope_user": null, "sensitivity": "public"},
	})
	d.allowed == true
	d.scope == "tenant"
}

test_user_tagged_key_is_user_scoped_for_any_class if {
	d := _decide({"key": {"user": "u1"}})
	d.allowed == true
	d.scope == "user"
	_denied({"key": {"user": "u1"}, "actor": {"user": "u2"}}, "user_scope_mismatch")
}

# --- TTL and tiers ----------------------------------------------------------------------

test_class_max_ttl_applies if {
	d := _decide({"tenant": "globex", "key": {"tenant": "globex"}, "request": {"sensitivity": "public"}})
	d.ttl_s == 86400
	d.tiers == ["filesystem", "memory", "redis"]
}

test_tenant_ttl_cap_lowers_never_raises if {
	_decide({}).ttl_s == 3600
	_decide({"request": {"sensitivity": "public"}}).ttl_s == 86400
}

test_tier_outside_tenant_tiers_denied if _denied({"tier": "redis"}, "tier_not_allowed")

test_allowed_tier_passes if _decide({"tier": "memory"}).allowed == true

test_no_allowed_tier_denied if {
	_denied(
		{
			"tenant": "hooli",
			"key": {"tenant": "hooli", "user": "u1"},
			"request": {"sensitivity": "confidential"},
		},
		"no_allowed_tier",
	)
}

# --- sensitivity defaults ---------------------------------------------------------------

test_missing_sensitivity_is_internal if {
	d := _decide({"request": {"sensitivity": null}})
	d.allowed == true
	d.sensitivity == "internal"
	d.ttl_s == 3600
}

test_unknown_sensitivity_denied if _denied({"request": {"sensitivity": "secret"}}, "unknown_sensitivity")

# --- remove -----------------------------------------------------------------------------

test_remove_allowed_whatever_the_sensitivity if {
	d := _decide({"operation": "remove", "request": {"sensitivity": "restricted"}})
	d.allowed == true
	d.ttl_s == null
	d.scope == null
}

test_remove_never_crosses_tenants if {
	_denied({"operation": "remove", "key": {"tenant": "globex"}}, "tenant_mismatch")
}

# --- bad input and defaults -------------------------------------------------------------

test_unknown_operation_denied if _denied({"operation": "drop"}, "invalid_input:operation")

test_wrong_types_denied if {
	d := _decide({"tenant": 5, "actor": {"user": ["u1"]}})
	d.allowed == false
	d.reasons == ["invalid_input:actor.user", "invalid_input:tenant"]
}

test_entry_must_be_object if _denied({"operation": "get", "entry": "x"}, "invalid_input:entry")

test_decision_defined_for_empty_input if {
	d := authz.decision with input as {} with data.kvgov.config as _cfg
	d.allowed == false
	count(d.reasons) > 0
}

test_decision_defined_without_data if {
	d := authz.decision with input as _base with data.kvgov.config as {}
	d.allowed == false
	d.reasons == ["unknown_tenant"]
}
