WITH picked AS MATERIALIZED (SELECT scope,
    key FROM idempotency_keys WHERE state = 'processing'
    AND lease_expires_at <= statement_timestamp() AND (next_check_at IS NULL
    OR next_check_at <= statement_timestamp()) AND ($4::text IS NULL OR scope = $4::text)
    ORDER BY lease_expires_at LIMIT $3::bigint FOR UPDATE SKIP LOCKED)
UPDATE idempotency_keys k
SET lease_token = k.lease_token + 1, lease_owner = $1::text,
    last_attempt_at = CASE WHEN k.lease_owner IS NULL THEN k.last_attempt_at
        ELSE GREATEST(COALESCE(k.last_attempt_at, k.created_at), k.lease_expires_at) END,
    may_have_acted = true,
    lease_expires_at = statement_timestamp() + $2::bigint * interval '1 millisecond',
    attempts = k.attempts + 1, updated_at = statement_timestamp(), version = k.version + 1,
    history = CASE WHEN length(k.history) <= 14336 THEN k.history ELSE substr(right(k.history,
        14336), strpos(right(k.history, 14336), E'\n') + 1) END || E'\n' || concat(k.version + 1,
        '|', k.state, '|', CASE WHEN k.retryable THEN '1' ELSE '0' END, '|', k.state, '|',
        CASE WHEN k.retryable THEN '1' ELSE '0' END, '|', k.lease_token + 1, '|',
        floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|', length('sweeper'),
        '|', 'sweeper', '|' || replace(replace(left('sweeper took over an expired lease', 512), '\',
        '\\'), E'\n', '\n'))
FROM picked
WHERE k.scope = picked.scope
    AND k.key = picked.key
    AND k.state = 'processing'
RETURNING k.scope, k.key, k.operation, k.provider, k.provider_key, k.state, k.retryable,
    k.fingerprint, k.request, k.response_status, k.response_headers, k.response_body, k.error,
    k.lease_token, k.lease_owner, k.lease_expires_at, k.attempts, k.created_at, k.updated_at,
    k.expires_at, k.next_check_at, k.retention_ms, k.last_attempt_at, k.may_have_acted
