SELECT scope, `key`, operation, provider, provider_key, state, retryable, fingerprint, request,
    response_status, response_headers, response_body, error, lease_token, lease_owner,
    lease_expires_at, attempts, created_at, updated_at, expires_at, next_check_at, retention_ms,
    last_attempt_at, may_have_acted
FROM idempotency_keys
WHERE (scope, `key`) IN
