WITH ins AS (
    INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state,
        retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts,
        created_at, updated_at, retention_ms, version, history, last_attempt_at, may_have_acted)
    SELECT $1::text, $2::text, $3::text, $4::text,
        CASE WHEN $12::text IS NOT NULL AND s.seq > 1
            THEN $12::text || lpad(to_hex((s.seq)::bigint & 4294967295), 8, '0')
            ELSE $5::text END,
        'processing', false, $6::text, $7::text,
        (extract(epoch FROM statement_timestamp()) * 1000000)::bigint, $8::text,
        statement_timestamp() + $9::bigint * interval '1 millisecond', 1, statement_timestamp(),
        statement_timestamp(), $10::bigint, s.seq,
        concat(s.seq, '|', NULL, '|', NULL, '|', 'processing', '|', '0', '|',
            (extract(epoch FROM statement_timestamp()) * 1000000)::bigint, '|',
            floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint, '|',
            length('worker'), '|', 'worker',
            '|' || replace(replace(left('claimed', 512), '\', '\\'), E'\n', '\n')),
        statement_timestamp(), false
    FROM (SELECT COALESCE((SELECT last_seq FROM idempotency_key_tombstones
        WHERE scope = $1::text AND key = $2::text), 0) + 1 AS seq) s
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING scope, key, operation, provider, provider_key, state, retryable, fingerprint,
        request, response_status, response_headers, response_body, error, lease_token,
        lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
        next_check_at, retention_ms, last_attempt_at, may_have_acted)
SELECT true AS claimed, 'claimed'::text AS last_reason, ins.scope, ins.key, ins.operation,
    ins.provider, ins.provider_key, ins.state, ins.retryable, ins.fingerprint, ins.request,
    ins.response_status, ins.response_headers, ins.response_body, ins.error, ins.lease_token,
    ins.lease_owner, ins.lease_expires_at, ins.attempts, ins.created_at, ins.updated_at,
    ins.expires_at, ins.next_check_at, ins.retention_ms, ins.last_attempt_at, ins.may_have_acted,
    statement_timestamp() AS db_now
FROM ins
UNION ALL
SELECT false, NULL::text, scope, key, operation, provider, provider_key, state, retryable,
    fingerprint, request, response_status, response_headers, response_body, error, lease_token,
    lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at, next_check_at,
    retention_ms, last_attempt_at, may_have_acted, statement_timestamp()
FROM idempotency_keys
WHERE scope = $1::text
    AND key = $2::text
