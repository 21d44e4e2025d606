"""Patches 2d and 2e: a request's tenant comes from the one source the operator chose
(``graft.isolation.tenant_source``).

2d: the chat and completion handlers read the tenant from the ``user`` field or a
header while they build the request's ``SamplingParams``, which carry it to 2e. 2e:
where every request of every entry point (and of the offline ``LLM``) becomes an engine
request, its tenant field is set from the chosen source only."""

from __future__ import annotations

import contextvars

from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor

from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY
from vllm_graft.vllm.patching import call_original

GRAFT_REQUEST_PREFIX = "graft_"
MAX_TENANT_LENGTH = 256
#: the attribute of a ``SamplingParams`` holding the tenant an OpenAI handler read (2d):
#: an instance attribute, which vLLM neither copies nor sends, so no client can set it
FRONT_END_TENANT_ATTR = "_graft_front_end_tenant"
#: while an OpenAI handler runs (2d): the tenant it read for its request
_HANDLER_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "graft_handler_tenant", default=None)


def tenant_name(value: str | None) -> str | None:
    """The tenant a user field, header or cache salt names: none when empty or absent,
    the SHA-256 of one too long for a tenant field (any value the API accepts stays a
    valid request)."""
    if not value:
        return None
    if len(value) > MAX_TENANT_LENGTH:
        import hashlib

        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


def graft_isolation(vllm_config) -> dict | None:
    """The ``graft.isolation`` settings of a Graft engine's config; None for others."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    graft = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    return None if graft is None else graft["isolation"]


def handler_tenant(source: str, user: str | None, headers) -> str | None:
    """The tenant an OpenAI handler reads for its request under ``tenant_source``: the
    ``user`` field, or the named header (``headers``: the HTTP request's, None outside
    HTTP), which must come once; None for the other sources (read by 2e)."""
    if source == "user":
        return tenant_name(user)
    kind, _, name = source.partition(":")
    if kind != "header" or headers is None:
        return None
    values = headers.getlist(name)
    if len(values) > 1:
        raise VLLMValidationError(
            f"the header {name} names this request's tenant (graft.isolation."
            f"tenant_source) and must come once, got it {len(values)} times",
            parameter=name)
    return tenant_name(values[0]) if values else None


def request_tenant(isolation: dict, extra_args: dict | None, cache_salt: str | None,
                   handler: str | None) -> str | None:
    """A request's tenant, from the one source the operator chose: the Graft extra
    argument, the request's ``cache_salt``, or what the OpenAI handler read (the ``user``
    field or a header; None outside the OpenAI handlers). Nothing else counts."""
    source = isolation["tenant_source"]
    if source == "extra":
        tenant = (extra_args or {}).get(isolation["tenant_field"])
        return None if tenant is None else str(tenant)
    if source == "cache_salt":
        return tenant_name(cache_salt)
    return handler


def with_tenant(extra_args: dict | None, field: str, tenant: str | None) -> dict | None:
    """``extra_args`` (a new dict) whose ``field`` holds ``tenant``, or lacks it."""
    extra = {k: v for k, v in (extra_args or {}).items() if k != field}
    if tenant is not None:
        extra[field] = tenant
    return extra or None


def validate_graft_request_fields(extra_args: dict | None, tenant_field: str) -> None:
    """A request's Graft fields (its extra arguments named ``graft_*``): only the tenant
    field exists, and it holds a short non-empty string. Checked in the front end,
    so a bad request gets a 400 and never reaches the engine."""
    for key, value in (extra_args or {}).items():
        if not key.startswith(GRAFT_REQUEST_PREFIX):
            continue
        if key != tenant_field:
            raise VLLMValidationError(f"unknown Graft request field {key!r} (Graft reads "
                                      f"{tenant_field!r} only)", parameter=key, value=value)
        if not isinstance(value, str) or not 1 <= len(value) <= MAX_TENANT_LENGTH:
            raise VLLMValidationError(
                f"{key} must be a non-empty string of at most {MAX_TENANT_LENGTH} "
                f"characters", parameter=key, value=value)


def to_sampling_params_carrying_tenant(request_cls):
    """2d: ``request_cls.to_sampling_params``, whose ``SamplingParams`` carry the tenant
    the running OpenAI handler read."""
    def to_sampling_params(self, *args, **kwargs):
        params = call_original(request_cls, "to_sampling_params")(self, *args, **kwargs)
        tenant = _HANDLER_TENANT.get()
        if tenant is not None:
            setattr(params, FRONT_END_TENANT_ATTR, tenant)
        return params

    return to_sampling_params


def handler_reading_tenant(handler_cls, name: str):
    """2d: the OpenAI handler ``handler_cls.name``, which reads its request's tenant
    while it runs (a bad header gets the handler's error response)."""
    async def handler(self, request, raw_request=None, *args, **kwargs):
        original = call_original(handler_cls, name)
        engine = getattr(self, "engine_client", None)
        isolation = graft_isolation(getattr(engine, "vllm_config", None))
        if isolation is None:
            return await original(self, request, raw_request, *args, **kwargs)
        try:
            tenant = handler_tenant(isolation["tenant_source"],
                                    getattr(request, "user", None),
                                    None if raw_request is None else raw_request.headers)
        except VLLMValidationError as err:
            return self.create_error_response(err)
        token = _HANDLER_TENANT.set(tenant)
        try:
            return await original(self, request, raw_request, *args, **kwargs)
        finally:
            _HANDLER_TENANT.reset(token)

    return handler


def process_inputs(self, request_id, prompt, params, *args, **kwargs):
    """2e: ``InputProcessor.process_inputs``; the engine request's tenant field holds
    the tenant of the chosen source, or nothing."""
    request = call_original(InputProcessor, "process_inputs")(
        self, request_id, prompt, params, *args, **kwargs)
    isolation = graft_isolation(self.vllm_config)
    sampling = request.sampling_params
    if isolation is not None and sampling is not None:
        tenant = request_tenant(isolation, sampling.extra_args, request.cache_salt,
                                getattr(params, FRONT_END_TENANT_ATTR, None))
        sampling.extra_args = with_tenant(sampling.extra_args, isolation["tenant_field"],
                                          tenant)
    return request
