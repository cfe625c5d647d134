# kvgov default KV cache policy.
#
# One decision per KV operation: data.kvgov.authz.decision =
#   {allowed, reasons, tiers, ttl_s, scope, sensitivity}
# The input document is described in docs/policy.md; the data document lives at
# data.kvgov.config (tenants, engines, sensitivity classes and their limits).
#
# Every rule the decision reads has a default, so the decision is never undefined; if it
# were, the engines deny with "opa_undefined" / "policy_undefined".
#
# Reasons come from the first layer that fails, in this order: input shape, tenant and
# engine, key tenant, then the data rules (sensitivity class, user scope, tiers).
package kvgov.authz

import rego.v1

cfg := data.kvgov.config

default decision := {
	"allowed": false,
	"reasons": ["policy_undefined"],
	"tiers": [],
	"ttl_s": null,
	"scope": null,
	"sensitivity": null,
}

decision := {
	"allowed": allowed,
	"reasons": reasons,
	"tiers": _tiers_out,
	"ttl_s": _ttl_out,
	"scope": _scope_out,
	"sensitivity": _sensitivity_out,
}

# ---------------------------------------------------------------------------------------
# layer 1: input shape. _shape_ok is the fast check (builtins only); the detailed reasons
# in _invalid are computed only when it fails, and name every bad field.

_operations := {"put", "get", "exists", "remove"}

_str_or_null := {"string", "null"}

_shape_ok if {
	input.operation in _operations
	type_name(input.tenant) in _str_or_null
	type_name(input.tier) in _str_or_null
	type_name(input.key.tenant) in _str_or_null
	type_name(input.key.user) in _str_or_null
	type_name(input.key.model) in _str_or_null
	type_name(input.actor.user) in _str_or_null
	type_name(input.actor.engine) in _str_or_null
	type_name(object.get(_actor, "listener", null)) in _str_or_null
	type_name(input.request.id) in _str_or_null
	type_name(input.request.sensitivity) in _str_or_null
	_entry_shape_ok
}

_entry_shape_ok if input.entry == null

_entry_shape_ok if {
	type_name(input.entry.owner) in _str_or_null
	type_name(input.entry.scope_user) in _str_or_null
	type_name(input.entry.sensitivity) in _str_or_null
}

# (every `not` below tests a value that is always defined: object.get with a default, or a
# rule; OPA and regorus disagree on `not f(undefined)`, and the differential test caught it)
_invalid contains "invalid_input:operation" if {
	not object.get(input, "operation", null) in _operations
}

_invalid contains sprintf("invalid_input:%s", [name]) if {
	some name in ["tenant", "tier", "key", "actor", "request", "entry"]
	not name in object.keys(input)
}

_invalid contains sprintf("invalid_input:%s", [name]) if {
	some name in ["tenant", "tier"]
	not type_name(object.get(input, name, null)) in _str_or_null
}

_invalid contains sprintf("invalid_input:%s", [name]) if {
	some name in ["key", "actor", "request"]
	not is_object(object.get(input, name, null))
}

_invalid contains "invalid_input:entry" if {
	not type_name(object.get(input, "entry", null)) in {"object", "null"}
}

_invalid contains sprintf("invalid_input:%s.%s", [doc, name]) if {
	some doc, names in {
		"key": ["tenant", "user", "model"],
		"actor": ["user", "engine", "listener"],
		"request": ["id", "sensitivity"],
		"entry": ["owner", "scope_user", "sensitivity"],
	}
	is_object(input[doc])
	some name in names
	not type_name(object.get(input[doc], name, null)) in _str_or_null
}

# sub-documents, {} when absent or malformed (layer 1 has denied those already)
_key := input.key if is_object(input.key) else := {}

_actor := input.actor if is_object(input.actor) else := {}

_request := input.request if is_object(input.request) else := {}

# ---------------------------------------------------------------------------------------
# layer 2: tenant and engine

_has_tenant if {
	is_string(input.tenant)
	input.tenant != ""
}

tenant := cfg.tenants[input.tenant]

_tenant_denials contains "missing_tenant" if not _has_tenant

_tenant_denials contains "unknown_tenant" if {
	_has_tenant
	not tenant
}

_tenant_denials contains "tenant_disabled" if {
	tenant
	not object.get(tenant, "enabled", false) == true
}

_engine_named if {
	is_string(_actor.engine)
	_actor.engine != ""
	some allowed_engine in object.get(tenant, "engines", [])
	allowed_engine == _actor.engine
}

# the lm:// listener has no handshake: it is admitted only where a tenant names its engine id
_handshake_less if object.get(_actor, "listener", null) == "lm"

_engine_allowed if _engine_named

_engine_allowed if {
	is_string(_actor.engine)
	_actor.engine != ""
	not _handshake_less
	"*" in object.get(tenant, "engines", [])
}

_tenant_denials contains "engine_not_allowed" if {
	tenant
	not _engine_allowed
}

# ---------------------------------------------------------------------------------------
# layer 3: the key's tenant tag must be the operation's tenant (a get never crosses tenants)

_key_tenant := object.get(_key, "tenant", null)

_key_denials contains "missing_key_tenant" if not is_string(_key_tenant)

_key_denials contains "missing_key_tenant" if _key_tenant == ""

_key_denials contains "tenant_mismatch" if {
	is_string(_key_tenant)
	_key_tenant != ""
	_key_tenant != input.tenant
}

# ---------------------------------------------------------------------------------------
# layer 4: sensitivity class, user scope, tiers, TTL

# put/get/exists store or reveal data: the sensitivity rules apply; remove only deletes
_governs_data if input.operation in {"put", "get", "exists"}

# a get/exists of an existing entry is judged by what was recorded at put
_read_of_entry if {
	input.operation in {"get", "exists"}
	is_object(input.entry)
}

_label := object.get(input.entry, "sensitivity", null) if {
	_read_of_entry
} else := object.get(_request, "sensitivity", null)

# the entry's recorded sensitivity for reads of an entry, else the request's label; a missing
# label is cfg.default_sensitivity ("internal" unless the data says otherwise)
sensitivity := _label if {
	is_string(_label)
	_label != ""
} else := object.get(cfg, "default_sensitivity", "internal")

class := cfg.classes[sensitivity]

_cacheable if {
	class
	not object.get(class, "cacheable", true) == false
}

_data_denials contains "unknown_sensitivity" if not class

# restricted (cacheable: false) is never cached and never served: the engine recomputes
_data_denials contains sprintf("not_cacheable:%s", [sensitivity]) if class.cacheable == false

# labels such as phi/pci are cacheable only for tenants that allow them
_data_denials contains sprintf("label_not_allowed:%s", [sensitivity]) if {
	class.requires_tenant_allow == true
	not sensitivity in object.get(tenant, "allowed_labels", [])
}

# users an operation is scoped to: the key's user tag, and for reads the entry's scope user
_scope_users contains _key.user if {
	is_string(_key.user)
	_key.user != ""
}

_scope_users contains input.entry.scope_user if {
	_read_of_entry
	is_string(input.entry.scope_user)
	input.entry.scope_user != ""
}

_class_scope := object.get(class, "scope", "tenant")

# classes with scope "user" (confidential, phi, pci) are cached only in user-scoped keys
_data_denials contains "user_scope_required" if {
	_class_scope == "user"
	count(_scope_users) == 0
}

# a user-scoped key or entry belongs to its user alone
_data_denials contains "user_scope_mismatch" if {
	some user in _scope_users
	not object.get(_actor, "user", null) == user
}

_all_tiers := {t | some t in cfg.tiers}

_tenant_tiers := {t | some t in tenant.tiers} if is_array(tenant.tiers) else := _all_tiers

_class_tiers := {t | some t in class.tiers} if is_array(class.tiers) else := _all_tiers

tiers := sort((_tenant_tiers & _class_tiers) & _all_tiers) if {
	_governs_data
} else := sort(_tenant_tiers & _all_tiers)

_data_denials contains "no_allowed_tier" if {
	_cacheable
	count(tiers) == 0
}

_data_denials contains "class_without_ttl" if {
	_cacheable
	not is_number(object.get(class, "max_ttl_s", null))
}

# a time to live of zero (or less) keeps nothing: a class, or a tenant's cap, of 0 means "do
# not cache", never "keep for ever"
_data_denials contains "ttl_not_positive" if {
	_cacheable
	is_number(ttl_s)
	ttl_s <= 0
}

_tier_denials contains "tier_not_allowed" if {
	is_string(input.tier)
	input.tier != ""
	not input.tier in tiers
}

# the class maximum, lowered (never raised) by the tenant's own cap for that class
ttl_s := min({class.max_ttl_s, tenant.max_ttl_s[sensitivity]}) if {
	is_number(tenant.max_ttl_s[sensitivity])
} else := class.max_ttl_s

# ---------------------------------------------------------------------------------------
# the answer

_data_or_tier_denials := _data_denials | _tier_denials if _governs_data else := _tier_denials

reasons := sort(_invalid) if not _shape_ok
else := sort(_tenant_denials) if count(_tenant_denials) > 0
else := sort(_key_denials) if count(_key_denials) > 0
else := sort(_data_or_tier_denials)

default allowed := false

allowed if count(reasons) == 0

default _tiers_out := []

_tiers_out := tiers if allowed

default _ttl_out := null

_ttl_out := ttl_s if {
	allowed
	_governs_data
}

default _scope_out := null

_scope_out := "user" if {
	allowed
	_governs_data
	count(_scope_users) > 0
}

_scope_out := "tenant" if {
	allowed
	_governs_data
	count(_scope_users) == 0
}

default _sensitivity_out := null

_sensitivity_out := sensitivity if {
	allowed
	_governs_data
}
