INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, retryable,
    fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts, created_at,
    updated_at, retention_ms, version, history, last_attempt_at, may_have_acted)
SELECT ?1, ?2, ?3, ?4,
    CASE WHEN ?12 IS NOT NULL AND s.seq > 1
        THEN ?12 || printf('%08x', (s.seq) & 4294967295) ELSE ?5 END,
    'processing', 0, ?6, ?7, (CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000), ?8,
    CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?9, 1,
    CAST(unixepoch('subsec') * 1000 AS INTEGER), CAST(unixepoch('subsec') * 1000 AS INTEGER), ?10,
    s.seq,
    printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', s.seq, NULL, NULL, 'processing', '0',
        (CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000),
        CAST(unixepoch('subsec') * 1000 AS INTEGER), length('worker'), 'worker',
        ifnull('|' || replace(replace(substr('claimed', 1, 512), '\', '\\'), char(10), '\n'), '')),
    CAST(unixepoch('subsec') * 1000 AS INTEGER), 0
FROM (SELECT COALESCE((SELECT last_seq FROM idempotency_key_tombstones
    WHERE scope = ?1 AND key = ?2), 0) + 1 AS seq) s
WHERE true
ON CONFLICT (scope, key)
DO NOTHING
RETURNING lease_token, lease_expires_at, attempts, provider_key, may_have_acted,
    'claimed' AS last_reason, created_at
