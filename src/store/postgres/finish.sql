UPDATE idempotency_keys
SET state = $3::text, retryable = $4::boolean, response_status = $5::integer,
    response_headers = $6::text, response_body = $7::bytea, error = $8::text,
    lease_token = CASE WHEN $9::bigint IS NULL THEN lease_token + 1 ELSE lease_token END,
    lease_owner = NULL, lease_expires_at = NULL,
    may_have_acted = CASE WHEN $4::boolean THEN false ELSE may_have_acted END,
    updated_at = statement_timestamp(),
    expires_at = statement_timestamp() + retention_ms * interval '1 millisecond',
    next_check_at = NULL, version = version + 1,
    history = CASE WHEN length(history) <= 14336 THEN history ELSE substr(right(history, 14336),
        strpos(right(history, 14336), E'\n') + 1) END || E'\n' || concat(version + 1, '|', state,
        '|', CASE WHEN retryable THEN '1' ELSE '0' END, '|', $3::text, '|',
        CASE WHEN $4::boolean THEN '1' ELSE '0' END, '|',
        CASE WHEN $9::bigint IS NULL THEN lease_token + 1 ELSE lease_token END, '|',
        floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|', length($10::text),
        '|', $10::text, '|' || replace(replace(left($11::text, 512), '\', '\\'), E'\n', '\n'))
WHERE scope = $1::text
    AND key = $2::text
    AND ($9::bigint IS NULL OR (state = 'processing' AND lease_token = $9::bigint))
    AND ($12::bigint IS NULL OR (state = 'processing' AND lease_token = $12::bigint))
RETURNING scope, key, operation, provider, provider_key, state, retryable, fingerprint, request,
    response_status, response_headers, response_body, error, lease_token, lease_owner,
    lease_expires_at, attempts, created_at, updated_at, expires_at, next_check_at, retention_ms,
    last_attempt_at, may_have_acted
