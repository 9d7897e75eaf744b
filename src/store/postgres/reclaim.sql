UPDATE idempotency_keys AS k
SET state = 'processing', retryable = false, request = COALESCE($7::text, k.request),
    provider_key = CASE
        WHEN k.state = 'failed' AND k.provider IS DISTINCT FROM $4::text THEN (CASE
            WHEN $12::text IS NULL THEN $5::text
            WHEN length(k.provider_key) <= length($5::text) THEN k.provider_key
            ELSE $12::text || lpad(to_hex((k.version + 1)::bigint & 4294967295), 8, '0') END)
        ELSE k.provider_key END,
    provider = CASE WHEN k.state = 'failed' THEN $4::text ELSE k.provider END,
    lease_token = k.lease_token + 1, lease_owner = $8::text,
    lease_expires_at = statement_timestamp() + $9::bigint * interval '1 millisecond',
    attempts = k.attempts + 1, updated_at = statement_timestamp(), expires_at = NULL,
    next_check_at = NULL, error = NULL, response_status = NULL, response_headers = NULL,
    response_body = NULL, retention_ms = $10::bigint, version = k.version + 1,
    last_attempt_at = statement_timestamp(),
    may_have_acted = CASE WHEN k.state = 'failed' THEN k.may_have_acted ELSE true END,
    history = CASE
            WHEN length(k.history) <= 14336 THEN k.history
            ELSE substr(right(k.history, 14336), strpos(right(k.history, 14336), E'\n') + 1) END
        || E'\n'
        || concat(k.version + 1, '|', k.state, '|', CASE WHEN k.retryable THEN '1' ELSE '0' END,
            '|', 'processing', '|', '0', '|', k.lease_token + 1, '|',
            floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|',
            length('worker'), '|', 'worker',
            '|' || replace(replace(left(CASE WHEN $13::text = 'failed'
                THEN 'reclaimed after a retryable failure'
                ELSE 'retry took over an expired lease' END, 512), '\', '\\'), E'\n', '\n'))
WHERE k.scope = $1::text
    AND k.key = $2::text
    AND k.state = $13::text
    AND COALESCE(k.fingerprint = $6::text
        AND ((k.state = 'failed' AND k.retryable
                AND (k.provider IS NOT DISTINCT FROM $4::text OR NOT k.may_have_acted))
            OR ($11::bigint IS NOT NULL AND k.state = 'processing'
                AND k.provider IS NOT DISTINCT FROM $4::text
                AND k.lease_expires_at <= statement_timestamp()
                AND k.created_at > statement_timestamp() - $11::bigint * interval '1 millisecond')),
        false)
RETURNING CASE WHEN $13::text = 'failed' THEN 'reclaimed after a retryable failure'
    ELSE 'retry took over an expired lease' END AS last_reason,
    k.scope, k.key, k.operation, k.provider, k.provider_key, k.state, k.retryable, k.fingerprint,
    k.request, k.response_status, k.response_headers, k.response_body, k.error, k.lease_token,
    k.lease_owner, k.lease_expires_at, k.attempts, k.created_at, k.updated_at, k.expires_at,
    k.next_check_at, k.retention_ms, k.last_attempt_at, k.may_have_acted
