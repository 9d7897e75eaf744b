INSERT INTO idempotency_keys (scope, key, operation, provider, provider_key, state, retryable,
    fingerprint, request, response_status, response_headers, response_body, lease_token, attempts,
    created_at, updated_at, expires_at, retention_ms, version, history, last_attempt_at,
    may_have_acted)
SELECT ?1, ?2, ?3, ?4,
    CASE WHEN ?12 IS NOT NULL AND s.seq > 1
        THEN ?12 || printf('%08x', (s.seq) & 4294967295) ELSE ?5 END,
    'done', 0, ?6, ?7, ?13, ?14, ?15, (CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000), 1,
    CAST(unixepoch('subsec') * 1000 AS INTEGER), CAST(unixepoch('subsec') * 1000 AS INTEGER),
    CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?10, ?10, s.seq + 1,
    printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', s.seq, NULL, NULL, 'processing', '0',
        (CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000),
        CAST(unixepoch('subsec') * 1000 AS INTEGER), length('worker'), 'worker',
        ifnull('|' || replace(replace(substr('claimed', 1, 512), '\', '\\'), char(10), '\n'), ''))
    || char(10)
    || printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', s.seq + 1, 'processing', '0', 'done', '0',
        (CAST(unixepoch('subsec') * 1000 AS INTEGER) * 1000),
        CAST(unixepoch('subsec') * 1000 AS INTEGER), length('worker'), 'worker',
        ifnull('|' || replace(replace(substr(?16, 1, 512), '\', '\\'), char(10), '\n'), '')),
    CAST(unixepoch('subsec') * 1000 AS INTEGER), 0
FROM (SELECT COALESCE((SELECT last_seq FROM idempotency_key_tombstones
    WHERE scope = ?1 AND key = ?2), 0) + 1 AS seq) s
